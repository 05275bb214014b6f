"""A scripted pretend worker for tests that need a request to end ``error`` on demand: it reads
the oldest waiting entry of a queue as a worker would (the fleet's consumer group) and ends it
through the real finish script, which copies the entry to the dead letters."""

from __future__ import annotations

import time
from typing import Any

import redis

from tokenfleet.shared.keys import CONSUMER_GROUP, Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.schema import TerminalEvent, TerminalStatus
from tokenfleet.shared.scripts import registry
from tokenfleet.shared.scripts.finish import FINISH, finish_keys_args


def fail_waiting(r: redis.Redis, keys: Keys, model: str, code: str = "engine_error") -> str:
    """Take the oldest waiting request of ``model``'s normal queue and end it ``error``
    (message "failed on purpose"); its id. ``r`` and ``keys``: a client and the names of
    ``model``'s lane (on a cluster, a client of that lane's primary)."""
    stream = keys.stream(model, Priority.NORMAL)
    reply: Any = r.xreadgroup(CONSUMER_GROUP, "pretend", {stream: ">"}, count=1)
    entry, fields = reply[0][1][0]
    rid = fields[b"id"].decode()
    event = TerminalEvent(rid, TerminalStatus.ERROR, code=code, message="failed on purpose")
    k, a = finish_keys_args(
        keys,
        event,
        model=model,
        priority=Priority.NORMAL,
        now=time.time(),
        ttl_s=600,
        stream_id=entry.decode(),
    )
    assert registry.call(r, FINISH, k, a)[0] == "ok"
    return rid
