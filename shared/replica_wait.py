"""Asking Redis to confirm that a worker's writes reached a replica before they count.

Redis replicates asynchronously: a write the primary acknowledged can still be missing on the
replica that a failover promotes, and is then gone (the old primary, turned into a replica of the
new one, discards its own data). Between the promotion and the moment the sentinels demote the
old primary, it even goes on acknowledging writes that will all be discarded.

With ``Settings.redis_wait_replicas`` = N > 0, every round trip of the worker's pipelines (the
intake's reads and starts, the per-step publish of tokens and finishes:
``worker.pipelined.ScriptPipeline``) ends with ``WAIT N redis_wait_ms``. A reply below N means
the round trip's writes are not known to be on N replicas: the pipeline closes its connection and
raises ``ReplicationLagged`` (a ``redis.ConnectionError``), so the worker treats it as a lost
connection (``worker/service/outage.py``): it reconnects (in sentinel mode, to the primary the
sentinels name now) and sends the round trip again there (each part is idempotent for the same
worker). With one replica, what a worker acknowledged to itself is then what a failover keeps.

The producer's writes the same way (``producer/*_io/driver.py``: effects marked ``confirm`` —
a submit, a ``submit_many`` round trip, a cancel — end with ``WAIT`` on their connection); a
submit that raises ``ReplicationLagged`` is sent again with the same request id
(``client_core``), a cancel raises it to the caller.

Invariant: ``wait_of(client)`` is the requirement the client factory attached to ``client``
(``shared.redis_connect``); a client built elsewhere has none (0: no WAIT).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis

from tokenfleet.shared.scripts import registry

_ATTRIBUTE = "_tokenfleet_replica_wait"


@dataclass(frozen=True, slots=True)
class ReplicaWait:
    """``num_replicas`` replicas must confirm a round trip within ``timeout_ms``."""

    num_replicas: int
    timeout_ms: int


class ReplicationLagged(redis.ConnectionError):
    """A round trip's writes were not confirmed by enough replicas in time (a failover under
    way, or replication broken): handled like a lost connection."""


def attach(client: Any, wait: ReplicaWait | None) -> Any:
    """Mark ``client`` (a redis client the factory built) with its requirement; returns it."""
    setattr(client, _ATTRIBUTE, wait)
    return client


def wait_of(client: Any) -> ReplicaWait | None:
    """The requirement attached to ``client``, if any."""
    return getattr(client, _ATTRIBUTE, None)


def check(wait: ReplicaWait, reply: Any) -> None:
    """Raise ``ReplicationLagged`` unless ``reply`` (WAIT's) reaches ``wait.num_replicas``."""
    if isinstance(reply, BaseException) or int(reply) < wait.num_replicas:
        raise ReplicationLagged(
            f"WAIT {wait.num_replicas} {wait.timeout_ms}: {reply!r} replicas confirmed the "
            "round trip (a failover under way?); reconnecting"
        )


def checked(wait: ReplicaWait, script: registry.LuaScript, reply: Any, confirmed: Any) -> list[Any]:
    """A script's reply from a pipeline that ended with ``WAIT``: raise the script's own error
    first (nothing to confirm), then ``ReplicationLagged`` if too few replicas confirmed, else
    the checked reply (``registry.check_reply``)."""
    if isinstance(reply, BaseException):
        raise reply
    check(wait, confirmed)
    return registry.check_reply(script, reply)
