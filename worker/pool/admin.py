"""Pool administration: create a pool, list pools, inspect one, move a manual clock.

``tokenfleet pool`` and ``tokenfleet status`` use these; none of them joins the pool.
"""

from __future__ import annotations

from typing import Any

from tokenfleet.shared.errors import InvalidRequest
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.pool.scripts import (
    POOL_ADVANCE_CLOCK,
    POOL_CREATE,
    POOL_INSPECT,
    pool_keys,
)
from tokenfleet.shared.pool.view import pool_view
from tokenfleet.shared.scripts import registry
from tokenfleet.worker.pool.config import PoolConfig


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
