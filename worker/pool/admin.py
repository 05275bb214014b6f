"""Pool administration: create a pool, list pools, inspect one, move a manual clock.

``tokenfleet pool`` and ``tokenfleet status`` use these; none of them joins the pool.
"""

from __future__ import annotations

from typing import Any

import orjson

from tokenfleet.shared.errors import InvalidRequest
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.scripts import registry
from tokenfleet.worker.pool.config import PoolConfig
from tokenfleet.worker.pool.scripts import (
    POOL_ADVANCE_CLOCK,
    POOL_CREATE,
    POOL_INSPECT,
    pool_keys,
)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def create_pool(client: Any, keys: Keys, name: str, config: PoolConfig) -> bool:
    """Create the pool unless it exists with the same size; returns True if it was created.
    Raises ``PoolError`` if it exists with another total or block size."""
    reply = registry.call(client, POOL_CREATE, pool_keys(keys, name), config.args(name))
    return bool(int(reply[1]))


def advance_manual_clock(client: Any, keys: Keys, name: str, ms: int) -> int:
    """Move a manual-clock pool's clock forward by ``ms``; returns the new time (ms)."""
    if not isinstance(ms, int) or ms < 0:
        raise InvalidRequest(f"ms must be a non-negative integer, got {ms!r}")
    return int(registry.call(client, POOL_ADVANCE_CLOCK, pool_keys(keys, name), [str(ms)])[1])


def pool_names(client: Any, keys: Keys) -> list[str]:
    """Names of every pool created under this prefix, sorted."""
    return sorted(_text(n) for n in client.smembers(keys.pools))


def pool_snapshot(client: Any, keys: Keys, name: str) -> dict[str, Any]:
    """The pool as its next call will see it: settings, members (weight, held, entitlement,
    active, loan, token share, lease left) and pending preemptions. Read-only.

    Raises ``PoolError`` if the pool does not exist.
    """
    reply = registry.call(client, POOL_INSPECT, pool_keys(keys, name), [])
    return pool_view(name, reply)


def pool_view(name: str, reply: list[Any]) -> dict[str, Any]:
    """A checked ``POOL_INSPECT`` reply as :func:`pool_snapshot` returns it (no I/O: the fleet
    status plan, ``producer.core.fleet_status``, runs the script on either client face)."""
    view: dict[str, Any] = orjson.loads(reply[1])
    view["name"] = name
    # cjson writes an empty Lua table as {}: normalise the lists.
    for field in ("members", "preemptions"):
        if not isinstance(view.get(field), list):
            view[field] = []
    for member in view["members"]:
        member["weight"] = member.pop("weight_milli") / 1000
        member["active"] = bool(member["active"])
        if not isinstance(member["blocks_by_priority"], list):
            member["blocks_by_priority"] = []
    for order in view["preemptions"]:
        order["delivered"] = bool(order["delivered"])
    view["members"].sort(key=lambda m: m["name"])
    view["preemptions"].sort(key=lambda o: o["id"])
    view["free"] = view["total"] - view["held"]
    return view
