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

The server's side of the same promise, ``min-replicas-to-write N`` (docs/redis-modes.md): a
primary with fewer than N replicas acknowledging within ``min-replicas-max-lag`` refuses every
write with ``NOREPLICAS`` (a script at its first write, so before it changed anything). Every
connection the client factory builds, in every mode, takes that reply as this module's
``ReplicationLagged`` too (:func:`refusing`): it closes itself and the callers' outage handling
waits and sends the refused round trip again, instead of reading it as the command's own error.

Invariant: ``wait_of(client)`` is the requirement the client factory attached to ``client``
(``shared.redis_connect``); a client built elsewhere has none (0: no WAIT). A connection of a
:func:`refusing` class never returns a ``NOREPLICAS`` reply to its caller.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio

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
    """Raise ``ReplicationLagged`` unless ``reply`` (WAIT's) reaches ``wait.num_replicas``; a
    WAIT the ACL refuses (``NOPERM``) is raised as it is: a setup fault, not a lagging replica
    (waiting would never end). Any other error reply counts as lag (a demoted primary answers
    that WAIT cannot be used on a replica)."""
    if isinstance(reply, redis.exceptions.NoPermissionError):
        raise reply
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


def refused_for_replicas(exc: BaseException) -> bool:
    """Whether an error reply is a primary's ``min-replicas-to-write`` refusal: ``NOREPLICAS``
    (Redis 7 starts a script's refusal the same; 6.2 wraps it: ``ERR Error running script ...
    -NOREPLICAS ...``)."""
    return isinstance(exc, redis.ResponseError) and "NOREPLICAS" in str(exc)


def _lagged(conn: Any, exc: BaseException) -> ReplicationLagged:
    where = getattr(conn, "path", "") or f"{getattr(conn, 'host', '')}:{getattr(conn, 'port', '')}"
    return ReplicationLagged(
        f"{where} refused a write: {exc} (min-replicas-to-write); reconnecting"
    )


class _Refusing:
    """Sync mixin: a ``NOREPLICAS`` reply closes the connection (the rest of a pipeline's
    replies stay unread) and raises :class:`ReplicationLagged`."""

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().read_response(*args, **kwargs)  # type: ignore[misc]
        except redis.ResponseError as exc:
            if not refused_for_replicas(exc):
                raise
            self.disconnect()  # type: ignore[attr-defined]
            raise _lagged(self, exc) from exc


class _AsyncRefusing:
    """Asyncio mixin: as :class:`_Refusing`."""

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().read_response(*args, **kwargs)  # type: ignore[misc]
        except redis.ResponseError as exc:
            if not refused_for_replicas(exc):
                raise
            await self.disconnect()  # type: ignore[attr-defined]
            raise _lagged(self, exc) from exc


@functools.cache
def refusing(connection_class: type) -> type:
    """``connection_class`` (a redis-py connection class, sync or asyncio, TCP, TLS or Unix
    socket) with ``NOREPLICAS`` taken as :class:`ReplicationLagged`; one subclass per class."""
    if issubclass(connection_class, (_Refusing, _AsyncRefusing)):
        return connection_class
    is_async = issubclass(connection_class, redis.asyncio.connection.AbstractConnection)
    mixin = _AsyncRefusing if is_async else _Refusing
    return type(f"Refusing{connection_class.__name__}", (mixin, connection_class), {})
