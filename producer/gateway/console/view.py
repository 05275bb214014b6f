"""``ConsoleData``: what the console shows, read through the client's own code paths.

The fleet (workers, queues, routed streams, models, dead letters, pools) is
``AsyncClient.fleet_status()``: the very plan ``tokenfleet status --json`` runs, so the numbers
on the page are the ones the command prints at the same moment. Beside it, each bounded: the
newest requests and dead letters (``core.fleet_records``), the newest batches
(``BatchStore.list``) and, with API keys on, each key's use (``auth.usage``).

A snapshot is plain data; ``rows`` adds the few figures the tables derive from it (a request's
queue wait and time to first token, a batch's progress), computed here once so that every
fragment shows the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis.asyncio

from tokenfleet.producer.async_client import AsyncClient
from tokenfleet.producer.core import fleet_records
from tokenfleet.producer.gateway.auth.usage import key_usage
from tokenfleet.producer.gateway.batches.store import BatchStore
from tokenfleet.shared.errors import ProtocolError
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.record import RequestRecord
from tokenfleet.shared.schema import GenerationRequest

LISTED = 30  # requests listed per snapshot
DEAD_LISTED = 20  # dead letters listed per snapshot (each one's payload is decoded)
BATCHES_LISTED = 20
KEYS_LISTED = 50
PREVIEW_CHARS = 160  # of a dead letter's prompt shown in its row


@dataclass(frozen=True, slots=True)
class ConsoleData:
    """Reads and actions of one console (a gateway's, or ``tokenfleet console``'s)."""

    client: AsyncClient
    redis: redis.asyncio.Redis
    batches: BatchStore
    keys_on: bool  # API keys are required: list them with their use

    async def snapshot(self) -> dict[str, Any]:
        """Everything the page shows, read now (module docstring)."""
        status = await self.client.fleet_status()
        requests = await self.client._run(fleet_records.recent_requests(self.client, LISTED))
        dead = await self.client._run(fleet_records.dead_letters(self.client, DEAD_LISTED))
        batches, _ = await self.batches.list(limit=BATCHES_LISTED)
        keys = []
        if self.keys_on:
            fleet = Keys.for_settings(self.client.settings).fleet
            keys = [u.to_dict() for u in await key_usage(self.redis, fleet, KEYS_LISTED)]
        return {
            "status": status,
            "requests": [request_row(r) for r in requests],
            "dead": [dead_row(lane, letter) for lane, letter in dead],
            "batches": [batch_row(b.to_dict()) for b in batches],
            "keys": keys,
            "keys_on": self.keys_on,
        }

    async def request(self, request_id: str) -> tuple[RequestRecord, GenerationRequest | None]:
        """A request's record and, while its queue entry exists, its payload
        (``UnknownRequest`` when there is no record)."""
        record = await self.client.status(request_id)
        payload = await self.client._run(fleet_records.waiting_request(self.client, record))
        return record, payload

    async def requeue(self, lane: str, entry: str) -> str:
        """Run dead letter ``entry`` of ``lane`` again; the new request's id."""
        return await self.client._run(fleet_records.requeue(self.client, lane, entry))

    async def discard(self, lane: str, entry: str) -> bool:
        """Delete dead letter ``entry`` of ``lane``; whether it was there."""
        return await self.client._run(fleet_records.discard(self.client, lane, entry))


def request_row(record: RequestRecord) -> dict[str, Any]:
    """A listed request: its record, with its queue wait, time to first token and duration."""
    row = record.to_dict()
    enqueued = record.enqueued_at
    row["queue_s"] = _span(enqueued, record.started_at)
    row["ttft_s"] = _span(enqueued, record.first_token_at)
    row["e2e_s"] = _span(enqueued, record.finished_at)
    row["ran_by"] = record.worker or record.ran_on
    return row


def _span(start: float | None, end: float | None) -> float | None:
    return end - start if start is not None and end is not None else None


def dead_row(lane: str, letter: Any) -> dict[str, Any]:
    """A listed dead letter: its fields, its lane, and the start of its prompt when it decodes
    (with the payload's request id when the letter holds none: an entry whose record had
    lapsed)."""
    row = letter.to_dict()
    row["lane"] = lane
    request = decoded(letter.payload)
    row["prompt"] = request_text(request)[:PREVIEW_CHARS] if request is not None else None
    if request is not None and not row["request_id"]:
        row["request_id"] = request.request_id
    row["requeueable"] = not letter.cut and request is not None
    return row


def decoded(payload: bytes) -> GenerationRequest | None:
    """The request a dead letter's payload holds; None when it does not decode."""
    try:
        return GenerationRequest.decode(payload, max(len(payload), 1))
    except ProtocolError:  # the row says it does not decode
        return None


def request_text(request: GenerationRequest) -> str:
    """A request's prompt as text: its prompt, its messages (``role: content`` lines), or its
    token ids."""
    if request.prompt is not None:
        return request.prompt
    if request.messages:
        return "\n".join(f"{m['role']}: {m['content']}" for m in request.messages)
    return " ".join(str(t) for t in request.prompt_token_ids or ())


def batch_row(batch: dict[str, Any]) -> dict[str, Any]:
    """A listed batch (OpenAI's object): its counts and progress (0..1) added."""
    counts = batch["request_counts"]
    total = counts["total"]
    done = counts["completed"] + counts["failed"]
    return {**batch, "progress": done / total if total else 0.0, "done_lines": done}
