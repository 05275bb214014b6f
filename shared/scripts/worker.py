"""The worker's Lua scripts: start a request, append a step's tokens, hand a request back.

Each keeps one invariant of the durable record atomically:

* ``START`` moves ``queued -> running`` (or notices the request must not run), so a worker
  never starts a cancelled, expired, terminal or poisoned request, nor one whose record or
  token list is inconsistent (``corrupt``: the worker ends it ``error`` / ``corrupt_state``).
* ``APPEND_TOKENS`` (all the requests of one engine step in one call) appends a request's
  tokens only while the caller still owns it and only at the index its list has reached, so
  the token list (and the channel) stays gap-free and duplicate-free even when a worker that
  was presumed dead wakes up; a record that is gone, or a list that does not end where the
  owner's tokens start, is reported ``corrupt`` (the worker ends the request ``error``).
* ``HANDBACK`` re-queues a running request at the tail of its stream (new entry, old one acked
  and deleted) so that any worker resumes it at once from its token list.
* ``REPAIR`` puts back, from the worker's own memory, what a rollback (a failover, a restart from
  an older snapshot) took from a request it runs or ended: the missing tail of its token list
  (published again), its record, its end, and drops an entry that reappeared or was resubmitted;
  a list holding events the worker did not publish is ``divergent`` (nothing written).
* ``STEAL`` takes other workers' routed entries that waited too long; ``OVERFLOW`` is an
  overflow worker's take, which also admits aged requests from tenant queues (fairly).
* ``FORGET_ROUTERS`` drops a long-lapsed routed worker from its model's routers set only while
  its routed streams are empty, deleting them with it, so that no routed entry is orphaned.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from tokenfleet.shared.keys import CONSUMER_GROUP, Keys
from tokenfleet.shared.scripts.registry import KeyOrArg, load_lua

START = load_lua(
    "tokenfleet.shared.scripts",
    "worker_start.lua",
    ok_codes=("missing", "foreign", "terminal", "cancelled", "expired", "poison", "corrupt"),
)
APPEND_TOKENS = load_lua("tokenfleet.shared.scripts", "worker_append_tokens.lua")
HANDBACK = load_lua("tokenfleet.shared.scripts", "worker_handback.lua", ok_codes=("lost",))
PULL = load_lua("tokenfleet.shared.scripts", "worker_pull.lua")
STEAL = load_lua("tokenfleet.shared.scripts", "worker_steal.lua")
OVERFLOW = load_lua("tokenfleet.shared.scripts", "worker_overflow.lua")
FORGET_ROUTERS = load_lua("tokenfleet.shared.scripts", "worker_forget_routers.lua")
REPAIR = load_lua(
    "tokenfleet.shared.scripts", "worker_repair.lua", ok_codes=("retry", "yield", "divergent")
)


def append_tokens_keys_args(
    keys: Keys,
    worker: str,
    now: float,
    ttl_s: int,
    batch: Sequence[tuple[str, int, Sequence[bytes]]],
) -> tuple[list[KeyOrArg], list[KeyOrArg]]:
    """KEYS and ARGV of ``APPEND_TOKENS`` for ``batch``: (request id, index of its first event,
    its encoded events) per request, in the order the replies come back."""
    k: list[KeyOrArg] = []
    a: list[KeyOrArg] = [worker, repr(now), ttl_s, keys.publish_command]
    for rid, first, events in batch:
        k += (keys.record(rid), keys.tokens(rid), keys.channel(rid))
        a += (first, len(events), *events)
    return k, a


@dataclass(slots=True)
class RepairCall:
    """What ``REPAIR`` needs to put one request back (see worker_repair.lua's header).

    ``events`` holds the encoded token events this worker published, indices ``0 .. n-1``; only
    those from ``from_index`` on are sent. ``status``/``event`` are its end ("" / b"" while it
    runs)."""

    request_id: str
    stream: str  # the stream this worker's entry is in
    entry_id: str
    attempts: int
    events: Sequence[bytes]
    from_index: int
    record_fields: Mapping[str, str]  # written when the record is gone
    entry_fields: Mapping[str, bytes | str]  # re-added when a running request's entry is gone
    status: str = ""
    event: bytes = b""
    end_fields: Mapping[str, str] = field(default_factory=dict)
    other_stream: str = ""  # the stream of the entry the record names, if another one
    other_entry: str = ""


def repair_keys_args(
    keys: Keys, worker: str, now: float, ttl_s: int, call: RepairCall
) -> tuple[list[KeyOrArg], list[KeyOrArg]]:
    """KEYS and ARGV of ``REPAIR`` for ``call``."""
    rid = call.request_id
    k: list[KeyOrArg] = [
        keys.record(rid),
        keys.tokens(rid),
        keys.channel(rid),
        call.stream,
        call.other_stream or call.stream,
        keys.cancel_set,
        keys.tally,
    ]
    a: list[KeyOrArg] = [
        worker,
        repr(now),
        ttl_s,
        keys.publish_command,
        CONSUMER_GROUP,
        rid,
        "finished" if call.status else "running",
        len(call.events),
        call.from_index,
        call.attempts,
        call.entry_id,
        call.other_entry,
        call.status,
        call.event,
    ]
    for fields in (call.record_fields, call.entry_fields, call.end_fields):
        a.append(len(fields))
        for name, value in fields.items():
            a += (name, value)
    a.extend(call.events[call.from_index :])
    return k, a
