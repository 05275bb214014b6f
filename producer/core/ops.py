"""Pieces both clients share: script replies to outcomes, queue names, stats rows, backoff.

Nothing here does I/O, so the sync ``Client`` and the ``AsyncClient`` stay two thin shells
around the same decisions.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
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


def enqueue_answers(reply: Sequence[Any], num_requests: int) -> list[tuple[int, str, str]]:
    """The (index, code, value) triples of a checked ENQUEUE reply (``reply[0]`` is "ok"): one
    per request of the call that was not enqueued anew, ``index`` counted from 0; a request not
    listed is new. ``ScriptError`` if the reply is not of that shape (a script of another
    version)."""
    triples: list[tuple[int, str, str]] = []
    if (len(reply) - 1) % 3 == 0:
        for n in range(1, len(reply), 3):
            index = reply[n]
            if type(index) is not int or not (triples[-1][0] if triples else -1) < index - 1:
                break
            if index > num_requests:
                break
            triples.append((index - 1, as_str(reply[n + 1]) or "", as_str(reply[n + 2]) or ""))
        else:
            return triples
    raise ScriptError(f"script enqueue answered {list(reply)!r} for {num_requests} requests")


_ENQUEUED = frozenset({"new", "exists"})


def enqueue_refusals(
    reply: Sequence[Any], request_ids: Sequence[str], model: str | None = None
) -> list[TokenfleetError | None]:
    """Per request of a checked ENQUEUE reply (``request_ids`` in the call's order, all for
    ``model``): None when it is enqueued (new, or ``exists`` from an earlier call), else the
    exception of its refusal."""
    out: list[TokenfleetError | None] = [None] * len(request_ids)
    if len(reply) == 1:  # everything new: the bulk path's usual answer
        return out
    for i, code, value in enqueue_answers(reply, len(request_ids)):
        if code not in _ENQUEUED:
            out[i] = refusal(code, value, request_ids[i], model)
    return out


def enqueue_pair(reply: Sequence[Any]) -> tuple[str, str]:
    """The (code, value) of a checked ENQUEUE reply for one request (``submit``): ("new", "")
    when it was enqueued anew."""
    if len(reply) == 1:
        return "new", ""
    [(_, code, value)] = enqueue_answers(reply, 1)  # one triple: its indices only increase
    return code, value


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


def stats_keys_args(
    keys: Keys,
    queues: Sequence[tuple[str, Priority]],
    routers: Mapping[str, Sequence[str]],
    group: str,
    tenants: Mapping[tuple[str, Priority], Sequence[str]] | None = None,
) -> tuple[list[str], list[str | int]]:
    """KEYS and ARGV for QUEUE_STATS: stream and config hash of each queue, then the routed
    streams of its model's ``routers`` (every worker that took routed work, live or not), then
    the tenant queues of its active ``tenants`` (docs/fairness.md: their requests wait too)."""
    out: list[str] = []
    args: list[str | int] = [group]
    for model, priority in queues:
        out += [keys.stream(model, priority), keys.queue_config(model, priority)]
        names = routers.get(model, ())
        out += [keys.routed(model, priority, w) for w in names]
        active = (tenants or {}).get((model, priority), ())
        out += [keys.tenant_queue(model, priority, t) for t in active]
        args.append(f"{len(names)} {len(active)}" if active else len(names))
    return out, args


def stats_rows(queues: Sequence[tuple[str, Priority]], reply: Sequence[Any]) -> list[QueueStats]:
    """QUEUE_STATS reply -> one ``QueueStats`` per queue, in the order asked."""
    values = list(reply[1:])
    rows = []
    for i, (model, priority) in enumerate(queues):
        length, pending, max_waiting, policy, oldest = values[5 * i : 5 * i + 5]
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
                oldest_waiting_at=stream_id_time(as_str(oldest) or ""),
            )
        )
    return rows


def stream_id_time(entry_id: str) -> float | None:
    """The epoch seconds at which Redis added the stream entry ``entry_id`` (its ``MS-SEQ`` id's
    first part); None for "" or an id of another shape."""
    ms, _, seq = entry_id.partition("-")
    return int(ms) / 1000 if ms.isdigit() and seq.isdigit() else None


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
