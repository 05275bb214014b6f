"""Connections to the Redis Cluster primary that owns one hash slot (cluster mode).

In cluster mode every key and channel of a fleet starts with a hash tag (``shared.keys.Keys``):
a model's lane ``{prefix|model}`` or the fleet's own ``{prefix}``, each one slot, held by one
primary at a time, and no script, pipeline or subscription spans two. tokenfleet therefore needs
no cluster-aware client: a plain connection to a slot's primary serves everything in that slot,
exactly as on a standalone Redis, and a process holds one such client per slot it uses.

* :class:`SlotOwner` / :class:`AsyncSlotOwner` find the slot's primary: they ask a node
  (``CLUSTER SLOTS``) — first the owner found last time, then every node the cluster reported
  then, then the seed (``REDIS_URL``'s host and port) — and keep the first answer that names an
  owner.
* :class:`SlotConnection` (and its TLS and asyncio twins) asks its ``SlotOwner`` on every connect,
  by the pool or not (``worker.pipelined.dedicated_connection``, the producer's pub/sub
  connection build from ``connection_kwargs``), and turns a reply that says the slot is not
  (or not yet, or no longer) served here — ``MOVED``, ``ASK``, ``TRYAGAIN``, ``CLUSTERDOWN``,
  ``READONLY``, ``MASTERDOWN``, and ``UNBLOCKED`` (a blocked read the node ended because it
  became a replica) — into :class:`SlotMoved`, a ``redis.ConnectionError``, after
  closing itself. The callers' outage handling (the worker's loop, a handle's retries, the
  gateway's) then reconnects, which resolves the owner anew: a failover or a migration of the
  slot is ridden out like a short outage, with the machinery that already exists.

A command that got such a reply did not run (the node refused it before running it), so sending
it again is always safe: :func:`slot_retry` gives the connections a redis-py ``Retry`` on
``SlotMoved`` only (a few tries within about a second), so a one-shot command (a handle's
``status()``) sent on a pooled connection still connected to the old owner reaches the new one
without its caller seeing anything. Any other lost connection is left to the callers, as in the
other modes.

Invariant: a connection of these classes is only ever connected to the node a cluster node
named as the slot's primary at the moment it connected, and it never returns a redirection
reply to its caller.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis
import redis.asyncio
import redis.asyncio.retry
import redis.retry
from redis.backoff import ExponentialBackoff
from redis.crc import key_slot
from redis.exceptions import (
    AskError,
    ClusterDownError,
    MasterDownError,
    MovedError,
    ReadOnlyError,
    TryAgainError,
)

Address = tuple[str, int]
_NOT_SERVED_HERE: tuple[type[redis.ResponseError], ...] = (
    *(MovedError, AskError, TryAgainError, ClusterDownError, ReadOnlyError, MasterDownError),
)


class SlotMoved(redis.ConnectionError):
    """The node this connection reached does not serve the client's slot (now): the slot moved
    (failover, migration) or the cluster is down. Handled like a lost connection."""


def not_served_here(exc: redis.ResponseError) -> bool:
    """Whether an error reply says this node does not serve the slot (now): a redirection, the
    cluster or the primary down, or a blocked read ended by a role change (``UNBLOCKED``, which
    redis-py leaves a plain ``ResponseError``)."""
    return isinstance(exc, _NOT_SERVED_HERE) or str(exc).startswith("UNBLOCKED")


def fleet_slot(root: str) -> int:
    """The hash slot of every name that starts with ``root`` (``{prefix}``, ``{prefix|model}``)."""
    return int(key_slot(root.encode()))


def owner_in(reply: Any, slot: int, asked: Address) -> tuple[Address | None, list[Address]]:
    """From a ``CLUSTER SLOTS`` reply: the primary serving ``slot`` (None if none does), and
    every node the reply names (to ask next time). An empty host means the node asked."""
    owner: Address | None = None
    nodes: list[Address] = []
    for entry in reply or ():
        start, end, *members = entry
        for i, member in enumerate(members):
            host = member[0].decode() if isinstance(member[0], bytes) else str(member[0])
            address = (host or asked[0], int(member[1]))
            nodes.append(address)
            if i == 0 and int(start) <= slot <= int(end):
                owner = address
    return owner, nodes


class _Directory:
    """The addresses to ask, in order, and what the last answer taught (shared state of the
    sync and asyncio owners; replacing a list is atomic, so threads may share one)."""

    def __init__(
        self, seeds: Sequence[Address], slot: int, query_class: type, query_kwargs: dict[str, Any]
    ) -> None:
        self.seeds = list(seeds)
        self.slot = slot
        self.query_class = query_class
        self.query_kwargs = query_kwargs
        self.owner: Address | None = None
        self.known: list[Address] = []

    def candidates(self) -> list[Address]:
        order = ([self.owner] if self.owner else []) + self.known + self.seeds
        return list(dict.fromkeys(order))

    def learn(self, owner: Address, nodes: list[Address]) -> Address:
        self.owner, self.known = owner, nodes
        return owner

    def failed(self, errors: list[str]) -> redis.ConnectionError:
        return redis.ConnectionError(
            f"no Redis Cluster node named a primary for slot {self.slot} "
            f"(asked: {'; '.join(errors) or 'nobody'})"
        )


class SlotOwner(_Directory):
    """Sync: finds the primary of one slot (see the module docstring)."""

    def address(self) -> Address:
        """The slot's primary now; ``redis.ConnectionError`` if no node could name one."""
        errors: list[str] = []
        for host, port in self.candidates():
            conn = self.query_class(host=host, port=port, **self.query_kwargs)
            try:
                conn.send_command("CLUSTER", "SLOTS")
                owner, nodes = owner_in(conn.read_response(), self.slot, (host, port))
            except (redis.RedisError, OSError) as exc:
                errors.append(f"{host}:{port}: {exc}")
                continue
            finally:
                conn.disconnect()
            if owner is not None:
                return self.learn(owner, nodes)
            errors.append(f"{host}:{port}: slot {self.slot} unassigned")
        raise self.failed(errors)


class AsyncSlotOwner(_Directory):
    """Asyncio: finds the primary of one slot (see the module docstring)."""

    async def address(self) -> Address:
        """The slot's primary now; ``redis.ConnectionError`` if no node could name one."""
        errors: list[str] = []
        for host, port in self.candidates():
            conn = self.query_class(host=host, port=port, **self.query_kwargs)
            try:
                await conn.send_command("CLUSTER", "SLOTS")
                owner, nodes = owner_in(await conn.read_response(), self.slot, (host, port))
            except (redis.RedisError, OSError) as exc:
                errors.append(f"{host}:{port}: {exc}")
                continue
            finally:
                await conn.disconnect()
            if owner is not None:
                return self.learn(owner, nodes)
            errors.append(f"{host}:{port}: slot {self.slot} unassigned")
        raise self.failed(errors)


class SlotConnection(redis.Connection):
    """Sync: connects to the slot's primary; a redirection reply is a lost connection."""

    def __init__(self, *args: Any, slot_owner: SlotOwner, **kwargs: Any) -> None:
        self.slot_owner = slot_owner
        super().__init__(*args, **kwargs)

    def connect_check_health(self, *args: Any, **kwargs: Any) -> None:
        if self._sock is None:
            self.host, self.port = self.slot_owner.address()
        super().connect_check_health(*args, **kwargs)

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().read_response(*args, **kwargs)
        except redis.ResponseError as exc:
            if not not_served_here(exc):
                raise
            self.disconnect()
            raise SlotMoved(f"{self.host}:{self.port} does not serve the slot now: {exc}") from exc


class SlotSSLConnection(SlotConnection, redis.SSLConnection):
    """Sync, TLS."""


class AsyncSlotConnection(redis.asyncio.Connection):
    """Asyncio: connects to the slot's primary; a redirection reply is a lost connection."""

    def __init__(self, *args: Any, slot_owner: AsyncSlotOwner, **kwargs: Any) -> None:
        self.slot_owner = slot_owner
        super().__init__(*args, **kwargs)

    async def connect_check_health(self, *args: Any, **kwargs: Any) -> None:
        if not self.is_connected:
            self.host, self.port = await self.slot_owner.address()
        await super().connect_check_health(*args, **kwargs)

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().read_response(*args, **kwargs)
        except redis.ResponseError as exc:
            if not not_served_here(exc):
                raise
            await self.disconnect()
            raise SlotMoved(f"{self.host}:{self.port} does not serve the slot now: {exc}") from exc


class AsyncSlotSSLConnection(AsyncSlotConnection, redis.asyncio.SSLConnection):
    """Asyncio, TLS."""


SLOT_RETRIES = 6  # backoff 20, 40, ... 500 ms: about 1.3 s of a slot changing hands


def slot_retry(module: Any) -> Any:
    """A ``Retry`` (of ``module``: ``redis`` or ``redis.asyncio``) on :class:`SlotMoved` only."""
    backoff = ExponentialBackoff(cap=0.5, base=0.02)
    return module.retry.Retry(backoff, SLOT_RETRIES, supported_errors=(SlotMoved,))


def is_slot_client(client: Any) -> bool:
    """Whether ``client`` (sync or asyncio) was built for cluster mode (its connections are
    slot connections): its pub/sub must then be sharded (SSUBSCRIBE)."""
    pool = getattr(client, "connection_pool", None)
    return "slot_owner" in getattr(pool, "connection_kwargs", {})
