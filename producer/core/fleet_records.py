"""The console's reads and actions on requests, as plans (``effects``): the newest requests,
the dead letters, a waiting request's payload; requeue and discard a dead letter.

Each read is bounded by its ``limit`` (``LRANGE``/``XREVRANGE ... COUNT``, then one pipelined
``HMGET`` per listed request), never by the size of a stream or a list. On a cluster they go
lane by lane (``core.lanes``); a dead letter is named by its lane (the model, "" off a cluster)
and its entry id there.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from typing import Any

from redis.commands.core import HashCommands, ListCommands, StreamCommands

from tokenfleet.producer.core.client_core import ClientCore
from tokenfleet.producer.core.effects import Command, Plan, Transaction
from tokenfleet.producer.core.request import prepared_for
from tokenfleet.shared.dead_letters import DeadLetter, parse_entries
from tokenfleet.shared.errors import InvalidRequest, ProtocolError, UnknownRequest
from tokenfleet.shared.keys import Keys, check_request_id
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.record import RequestRecord
from tokenfleet.shared.schema import GenerationRequest

# What a listing reads of each record: everything but the final text (which may be long).
LISTED_FIELDS = (
    "status",
    "model",
    "priority",
    "enqueued_at",
    "started_at",
    "first_token_at",
    "finished_at",
    "deadline",
    "num_tokens",
    "worker",
    "attempts",
    "finish_reason",
    "code",
    "message",
    "usage",
    "ran_on",
    "route",
    "routed_to",
)
MAX_LISTED = 200  # the most requests or dead letters one listing reads


def _limit(limit: int) -> int:
    if not isinstance(limit, int) or not 1 <= limit <= MAX_LISTED:
        raise InvalidRequest(f"limit must be in 1..{MAX_LISTED}, got {limit!r}")
    return limit


def recent_requests(views: ClientCore[Any], limit: int) -> Plan[list[RequestRecord]]:
    """The ``limit`` newest requests whose records still exist, newest first (``Keys.recent``
    of each lane, then their records)."""
    limit = _limit(limit)
    found: list[RequestRecord] = []
    for keys in (yield from views._lane_keys()):
        ids = [
            i.decode() if isinstance(i, bytes) else str(i)
            for i in (yield Command(ListCommands.lrange, (keys.recent, 0, limit - 1)))
        ]
        if not ids:
            continue
        rows = yield Transaction(
            tuple(Command(HashCommands.hmget, (keys.record(i), LISTED_FIELDS)) for i in ids)
        )
        for rid, values in zip(ids, rows, strict=True):
            raw: dict[bytes | str, bytes | str] = {
                f: v for f, v in zip(LISTED_FIELDS, values, strict=True) if v is not None
            }
            record = RequestRecord.from_hash(rid, raw)
            if record is not None:  # (its record expired: the list outlives it)
                found.append(record)
    found.sort(key=lambda r: r.enqueued_at or 0.0, reverse=True)
    return found[:limit]


def dead_letters(views: ClientCore[Any], limit: int) -> Plan[list[tuple[str, DeadLetter]]]:
    """The ``limit`` newest dead letters of each lane, newest first: ``(lane, letter)``."""
    limit = _limit(limit)
    out: list[tuple[str, DeadLetter]] = []
    for keys in (yield from views._lane_keys()):
        entries = yield Command(StreamCommands.xrevrange, (keys.dead_letter, "+", "-", limit))
        out += [(keys.lane, letter) for letter in parse_entries(entries)]
    return out


def _dead_letter(views: ClientCore[Any], lane: str, entry: str) -> Plan[tuple[Keys, DeadLetter]]:
    keys = views._keys.for_model(lane) if lane else views._keys
    found = yield Command(StreamCommands.xrange, (keys.dead_letter, entry, entry, 1))
    letters = parse_entries(found) if _is_entry_id(entry) else []
    if not letters:
        raise UnknownRequest(f"no dead letter {entry} (discarded or trimmed since)")
    return keys, letters[0]


def requeue_id(letter: DeadLetter, request_id: str) -> str:
    """The id a requeued dead letter runs under: the old id and a tag derived from the dead
    letter (a second requeue of the same letter names the same request, which the enqueue
    script then answers as existing: requeue is idempotent). Keeps the old id's owner prefix,
    so the API key that owned it owns the new one (``gateway.identity``)."""
    tag = hashlib.blake2b(letter.entry.encode(), digest_size=4).hexdigest()
    new = f"{request_id}.r{tag}"
    if len(new) > 128:
        new = f"{request_id[:117]}.r{tag}"
    return check_request_id(new)


def requeue(core: ClientCore[Any], lane: str, entry: str) -> Plan[str]:
    """Submit dead letter ``entry`` of ``lane`` again as a new request (``requeue_id``), with
    no deadline (its old one has passed), then drop the letter; the new id. Refused with
    ``InvalidRequest`` when the letter was kept cut or does not decode, ``Overloaded`` when its
    queue is full (nothing is evicted for it), ``UnknownRequest`` when it is gone."""
    keys, letter = yield from _dead_letter(core, lane, entry)
    request = letter.request(core.settings.max_payload_bytes)
    again = dataclasses.replace(
        request,
        request_id=requeue_id(letter, request.request_id),
        enqueued_at=time.time(),
        deadline=None,
    )
    prepared = prepared_for(core.settings, again, chosen_id=True)
    handle = yield from core._submit_prepared(prepared, timeout=0.0, try_only=True)
    handle.close()  # (the console follows it by id; the submit's subscription is not needed)
    yield Command(StreamCommands.xdel, (keys.dead_letter, letter.entry))
    return again.request_id


def discard(views: ClientCore[Any], lane: str, entry: str) -> Plan[bool]:
    """Delete dead letter ``entry`` of ``lane``; whether it was there."""
    keys = views._keys.for_model(lane) if lane else views._keys
    if not _is_entry_id(entry):
        return False
    return bool((yield Command(StreamCommands.xdel, (keys.dead_letter, entry))))


def waiting_request(core: ClientCore[Any], record: RequestRecord) -> Plan[GenerationRequest | None]:
    """The payload of a request that still has its queue entry (waiting or running), read from
    that one entry; None once it ended (the entry is deleted then) or when it does not decode."""
    if record.status.value not in ("queued", "running") or not record.model:
        return None
    keys = core._keys.for_model(record.model)
    sid = yield Command(HashCommands.hget, (keys.record(record.request_id), "stream_id"))
    sid = sid.decode() if isinstance(sid, bytes) else sid
    if not sid or not _is_entry_id(sid):
        return None
    priority = Priority.parse(record.priority or "normal")
    streams = [keys.stream(record.model, priority)]
    if record.routed_to:
        streams.insert(0, keys.routed(record.model, priority, record.routed_to))
    for stream in streams:
        for _, fields in (yield Command(StreamCommands.xrange, (stream, sid, sid, 1))):
            payload = fields.get(b"d") or fields.get("d")
            try:
                return GenerationRequest.decode(payload, core.settings.max_payload_bytes)
            except ProtocolError:
                return None
    return None


def _is_entry_id(entry: str) -> bool:
    ms, _, seq = entry.partition("-")
    return ms.isdigit() and seq.isdigit()
