"""The durable record of a request: a Redis hash at ``Keys.record(id)`` plus a token list.

Fields of the hash (all values are strings; times are epoch seconds). The enqueue script writes
only status, model, priority, stream_id, enqueued_at and those of the optional ones that apply;
an absent field reads as its default (every reader, Python or Lua, treats it so):

    status          a ``RequestStatus`` value
    model, priority where it was queued
    stream_id       its entry id in the queue stream (used to evict, cancel or ack it)
    enqueued_at, started_at, first_token_at, finished_at
    deadline        epoch seconds by which it must have started; absent or "" for none
    num_tokens      token events published so far (== length of the token list); absent: 0
    worker          name of the worker running it; absent or "" when none
    ran_on          name of the last worker that started it (kept after it ends); absent: none
    attempts        how many workers have taken it (the poison guard counts these); absent: 0
    fingerprint     hash of the request body without its times (set by the enqueue script
                    when the client chose the id, else absent; a resubmit under the same id must
                    match it, see ``request_fingerprint``)
    route           how routing placed it: "prefix:N" (N leading chain links matched),
                    "session";
                    absent: "shared" (docs/routing.md)
    routed_to       the worker of its routed stream; absent: none (both kept when another
                    worker takes it; a request waiting in a tenant queue gets both when it is
                    admitted into that worker's routed stream, docs/routing.md)
    taken           another worker took it after it waited: "stolen_by:W" (from a routed
                    stream) or "overflow:W" (an overflow worker); absent: nobody
    tenant          whose request it is, when it waited in a tenant queue (docs/fairness.md);
                    absent: the default tenant, admitted to the shared stream directly
    tenant_queued   "1" while it waits in its tenant's queue (``Keys.tenant_queue``: cancel and
                    expiry take it out of there); "" once it is admitted. Absent: never was
    waiting_on      the model, when the request was accepted while no live worker served it
                    (declared, or an empty fleet); removed by the worker's START. Absent else
    text            final text (set with the terminal status)
    finish_reason, code, message        how it ended
    usage, timings  JSON objects, set with the terminal status

Invariant: ``status`` moves queued -> running (-> queued again when handed back) -> one terminal
status, and never leaves a terminal status; the only writer of a terminal status is the
``finish`` script, which also publishes the terminal event, so the two always agree.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from tokenfleet.shared.schema import RequestStatus


def as_str(value: bytes | str | None) -> str | None:
    """Decode a reply value that may be bytes (clients without ``decode_responses``)."""
    if value is None or isinstance(value, str):
        return value
    return value.decode("utf-8", "replace")


def _float(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        return None


def _int(value: str | None) -> int:
    """A count field; 0 when absent or not an integer (a poisoned record must not make reading
    it raise: the worker ends such a request ``error`` / ``corrupt_state``)."""
    try:
        return int(value) if value else 0
    except ValueError:
        return 0


def _json(value: str | None) -> dict[str, Any]:
    if not value:
        return {}
    try:
        data = orjson.loads(value)
    except orjson.JSONDecodeError:
        return {}
    return data if isinstance(data, dict) else {}


@dataclass(slots=True)
class RequestRecord:
    """A parsed durable record (what ``Client.status()`` returns)."""

    request_id: str
    status: RequestStatus
    model: str = ""
    priority: str = ""
    enqueued_at: float | None = None
    started_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    deadline: float | None = None
    num_tokens: int = 0
    worker: str = ""
    attempts: int = 0
    text: str | None = None
    finish_reason: str | None = None
    code: str | None = None
    message: str | None = None
    usage: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, Any] = field(default_factory=dict)
    waiting_on: str = ""  # the model it waits on: accepted while no live worker served it
    route: str = "shared"  # why it went where: prefix:N | session | shared
    routed_to: str = ""  # the worker whose routed stream it went to
    taken: str = ""  # stolen_by:W | overflow:W when another worker took it after it waited
    ran_on: str = ""  # the last worker that started it (``worker`` is cleared at the end)
    tenant: str = ""  # whose request, when it went through a tenant queue; "": the default one

    @classmethod
    def from_hash(
        cls, request_id: str, raw: Mapping[bytes | str, bytes | str]
    ) -> RequestRecord | None:
        """Parse ``HGETALL`` output; ``None`` when the hash is empty (unknown or expired)."""
        if not raw:
            return None
        h = {as_str(k): as_str(v) for k, v in raw.items()}
        try:
            status = RequestStatus(h.get("status") or "queued")
        except ValueError:
            status = RequestStatus.QUEUED
        return cls(
            request_id=request_id,
            status=status,
            model=h.get("model") or "",
            priority=h.get("priority") or "",
            enqueued_at=_float(h.get("enqueued_at")),
            started_at=_float(h.get("started_at")),
            first_token_at=_float(h.get("first_token_at")),
            finished_at=_float(h.get("finished_at")),
            deadline=_float(h.get("deadline")),
            num_tokens=_int(h.get("num_tokens")),
            worker=h.get("worker") or "",
            attempts=_int(h.get("attempts")),
            text=h.get("text"),
            finish_reason=h.get("finish_reason") or None,
            code=h.get("code") or None,
            message=h.get("message") or None,
            usage=_json(h.get("usage")),
            timings=_json(h.get("timings")),
            waiting_on=h.get("waiting_on") or "",
            route=h.get("route") or "shared",
            routed_to=h.get("routed_to") or "",
            taken=h.get("taken") or "",
            ran_on=h.get("ran_on") or "",
            tenant=h.get("tenant") or "",
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (for ``tokenfleet status --json`` and rq job results)."""
        return {
            "request_id": self.request_id,
            "status": self.status.value,
            "model": self.model,
            "priority": self.priority,
            "enqueued_at": self.enqueued_at,
            "started_at": self.started_at,
            "first_token_at": self.first_token_at,
            "finished_at": self.finished_at,
            "deadline": self.deadline,
            "num_tokens": self.num_tokens,
            "worker": self.worker,
            "attempts": self.attempts,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "code": self.code,
            "message": self.message,
            "usage": self.usage,
            "timings": self.timings,
            "waiting_on": self.waiting_on,
            "route": self.route,
            "routed_to": self.routed_to,
            "taken": self.taken,
            "ran_on": self.ran_on,
            "tenant": self.tenant,
        }
