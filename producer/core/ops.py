"""Pieces both clients share: script replies to outcomes, queue names, stats rows, backoff.

Nothing here does I/O, so the sync ``Client`` and the ``AsyncClient`` stay two thin shells
around the same decisions.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

from tokenfleet.producer.core.request import Prepared
from tokenfleet.shared.errors import (
    IdempotencyConflict,
    ModelNotServed,
    Overloaded,
    ScriptError,
    TokenfleetError,
)
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.queue_config import OverflowPolicy, QueueConfig, QueueStats
from tokenfleet.shared.record import RequestRecord, as_str
from tokenfleet.shared.schema import RequestStatus
from tokenfleet.shared.scripts.registry import ERROR_CODES

# submit() on a "block" queue polls for room: first delay, growth factor, largest delay (s).
BLOCK_POLL = (0.005, 1.5, 0.1)
# submit_many() sends at most this many requests per enqueue script call.
ENQUEUE_CHUNK = 256


def enqueue_pairs(reply: Sequence[Any]) -> list[tuple[str, str]]:
    """The (code, value) pairs of a checked ENQUEUE reply (``reply[0]`` is "ok")."""
    items = [as_str(v) or "" for v in reply[1:]]
    return list(zip(items[0::2], items[1::2], strict=True))


_ENQUEUED = frozenset({"new", "exists", b"new", b"exists"})


def enqueue_refusals(
    reply: Sequence[Any], request_ids: Sequence[str], model: str | None = None
) -> list[TokenfleetError | None]:
    """Per request of a checked ENQUEUE reply (``request_ids`` in the call's order, all for
    ``model``): None when it is enqueued (``new``, or ``exists`` from an earlier call), else the
    exception of its refusal. The same outcomes as :func:`enqueue_pairs` with :func:`refusal`,
    without decoding the values of enqueued ones."""
    codes, values = reply[1::2], reply[2::2]
    if len(codes) != len(values):
        return [refusal(c, v) for c, v in enqueue_pairs(reply)]  # raises as enqueue_pairs does
    return [
        None if code in _ENQUEUED else refusal(as_str(code) or "", as_str(value) or "", rid, model)
        for code, value, rid in zip(codes, values, request_ids, strict=True)
    ]


def enqueue_pair(reply: Sequence[Any]) -> tuple[str, str]:
    """The (code, value) of a checked ENQUEUE reply for one request (``submit``): the same as
    ``enqueue_pairs(reply)[0]``, without building the list on the submit path."""
    if len(reply) != 3:
        return enqueue_pairs(reply)[0]  # not one pair: fails (or not) as enqueue_pairs does
    return as_str(reply[1]) or "", as_str(reply[2]) or ""


def refusal(
    code: str, message: str, request_id: str | None = None, model: str | None = None
) -> TokenfleetError:
    """The exception for a per-request refusal code of the enqueue script (``request_id`` and
    ``model``: the refused request's, carried by ``IdempotencyConflict`` / ``ModelNotServed``)."""
    if code == "full":
        return Overloaded(message)
    if code == "conflict":
        return IdempotencyConflict(message, request_id=request_id)
    if code == "unserved":
        return ModelNotServed(message, model=model)
    error = ERROR_CODES.get(code)
    if error is None:
        return ScriptError(f"script enqueue returned unknown code {code!r}: {message}")
    return error(message)


def parse_member(member: bytes | str) -> tuple[str, Priority] | None:
    """``model|label`` from the queues set, or None if malformed."""
    text = as_str(member) or ""
    model, _, label = text.rpartition("|")
    try:
        return (model, Priority.parse(label)) if model else None
    except TokenfleetError:
        return None


def stats_keys(keys: Keys, queues: Sequence[tuple[str, Priority]]) -> list[str]:
    """KEYS for QUEUE_STATS: stream and config hash of each queue."""
    out: list[str] = []
    for model, priority in queues:
        out += [keys.stream(model, priority), keys.queue_config(model, priority)]
    return out


def stats_rows(queues: Sequence[tuple[str, Priority]], reply: Sequence[Any]) -> list[QueueStats]:
    """QUEUE_STATS reply -> one ``QueueStats`` per queue, in the order asked."""
    values = list(reply[1:])
    rows = []
    for i, (model, priority) in enumerate(queues):
        length, pending, max_waiting, policy = values[4 * i : 4 * i + 4]
        stored = {"max_waiting": as_str(max_waiting) or "", "policy": as_str(policy) or ""}
        config = QueueConfig.from_hash({k: v for k, v in stored.items() if v})
        running = int(pending)
        rows.append(
            QueueStats(
                model=model,
                priority=priority.label,
                length=int(length),
                running=running,
                waiting=int(length) - running,
                max_waiting=config.max_waiting,
                policy=config.policy,
                configured=bool(stored["max_waiting"] or stored["policy"]),
            )
        )
    return rows


def sorted_queues(members: Iterable[bytes | str]) -> list[tuple[str, Priority]]:
    """Parse and sort the queues set (by model, then most urgent first)."""
    parsed = {q for q in (parse_member(m) for m in members) if q is not None}
    return sorted(parsed, key=lambda q: (q[0], int(q[1])))


def merged_config(current: QueueConfig, max_waiting: int | None, policy: str | None) -> QueueConfig:
    """``current`` with the given fields replaced (validated)."""
    return QueueConfig(
        max_waiting=current.max_waiting if max_waiting is None else max_waiting,
        policy=current.policy if policy is None else OverflowPolicy.parse(policy),
    )


def is_overdue(record: RequestRecord) -> bool:
    """A queued request whose deadline has passed (it must end ``expired``)."""
    return (
        record.status is RequestStatus.QUEUED
        and record.deadline is not None
        and record.deadline <= time.time()
    )


def plan_batches(prepared: Sequence[Prepared]) -> list[tuple[tuple[str, Priority], list[int]]]:
    """Group request indices by queue, in chunks of at most :data:`ENQUEUE_CHUNK`."""
    queues = [(p.model, p.priority) for p in prepared]
    groups: dict[tuple[str, Priority], list[int]] = {}
    if queues and queues.count(queues[0]) == len(queues):  # the usual bulk call: one queue
        groups[queues[0]] = list(range(len(queues)))
    else:
        for i, queue in enumerate(queues):
            groups.setdefault(queue, []).append(i)
    plan = []
    for queue, indices in groups.items():
        for j in range(0, len(indices), ENQUEUE_CHUNK):
            plan.append((queue, indices[j : j + ENQUEUE_CHUNK]))
    return plan
