"""Sentinel-managed connections that find the primary however they are connected.

redis-py's ``SentinelManagedConnection`` asks the sentinels for the primary only in
``connect()``, which its pool calls when it hands a connection out. A connection used outside the
pool (``worker.pipelined.dedicated_connection``: the worker's intake reader and publisher) is
connected by ``send_packed_command`` through ``connect_check_health``, which skips that step and
dials the ``host``/``port`` the connection was built with (``localhost:6379`` by default: not
this fleet's Redis at all). These subclasses resolve the primary in ``connect_check_health``
itself, so every connect, by the pool or not, goes to the primary the sentinels name now (a
reconnect after a failover reaches the new one).

Invariant: a connection of these classes is only ever connected to the address the sentinels
reported as the service's master at the moment it connected.
"""

from __future__ import annotations

from typing import Any

import redis
import redis.asyncio
import redis.asyncio.sentinel
import redis.sentinel


class PrimaryConnection(redis.sentinel.SentinelManagedConnection):
    """Sync: resolves the primary on every connect (see the module docstring)."""

    def connect_check_health(self, *args: Any, **kwargs: Any) -> None:
        if self._sock is None:
            self.host, self.port = self.connection_pool.get_master_address()
        super().connect_check_health(*args, **kwargs)


class PrimarySSLConnection(PrimaryConnection, redis.sentinel.SentinelManagedSSLConnection):
    """Sync, TLS."""


class AsyncPrimaryConnection(redis.asyncio.sentinel.SentinelManagedConnection):
    """Asyncio: resolves the primary on every connect (see the module docstring)."""

    async def connect_check_health(self, *args: Any, **kwargs: Any) -> None:
        if not self.is_connected:
            self.host, self.port = await self.connection_pool.get_master_address()
        await super().connect_check_health(*args, **kwargs)


class AsyncPrimarySSLConnection(
    AsyncPrimaryConnection, redis.asyncio.sentinel.SentinelManagedSSLConnection
):
    """Asyncio, TLS."""


class SentinelRedis(redis.Redis):
    """A sync client whose ``close()`` also closes the connections to the sentinels (redis-py
    leaves them to the ``Sentinel`` object, which only this client references)."""

    def close(self) -> None:
        try:
            super().close()
        finally:
            pool: Any = self.connection_pool  # a SentinelConnectionPool (master_for)
            pool.sentinel_manager.close()


class AsyncSentinelRedis(redis.asyncio.Redis):
    """The asyncio twin of :class:`SentinelRedis` (``aclose()``)."""

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        try:
            await super().aclose(close_connection_pool)
        finally:
            pool: Any = self.connection_pool  # a SentinelConnectionPool (master_for)
            await pool.sentinel_manager.aclose()
