"""Helpers of the API-key tests: run a coroutine with an :class:`ApiKeyStore` on a fresh
asyncio client, a settable clock, and a dump of everything in Redis."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import redis
import redis.asyncio

from tokenfleet.producer.gateway.auth import ApiKeyStore
from tokenfleet.shared.settings import Settings

T = TypeVar("T")


class Clock:
    """A clock a test sets by hand: ``ms`` for the quota scripts, ``s`` for the key cache."""

    def __init__(self, ms: int = 1_700_000_000_000) -> None:
        self.ms = ms
        self.s = 1000.0

    def now_ms(self) -> int:
        return self.ms

    def monotonic(self) -> float:
        return self.s


def with_store(
    settings: Settings, body: Callable[[ApiKeyStore], Awaitable[T]], **store_kwargs: Any
) -> T:
    """``body(store)`` on a new event loop, the client closed afterwards."""

    async def main() -> T:
        client = redis.asyncio.Redis.from_url(settings.redis_url)
        try:
            return await body(ApiKeyStore(client, settings, **store_kwargs))
        finally:
            await client.aclose()

    return asyncio.run(main())


def dump_redis(r: redis.Redis) -> bytes:
    """Every key name and every value in the database (hash fields, set and list members,
    strings), concatenated: what a leak check searches."""
    out: list[Any] = []  # bytes: the client does not decode responses
    for name in r.scan_iter(count=1000):
        out.append(name)
        kind = r.type(name)
        if kind == b"hash":
            for field, value in r.hgetall(name).items():
                out += [field, value]
        elif kind == b"set":
            out += list(r.smembers(name))
        elif kind == b"string":
            out.append(r.get(name) or b"")
        elif kind == b"list":
            out += list(r.lrange(name, 0, -1))
        else:
            raise AssertionError(f"unexpected {kind!r} at {name!r}")
    return b"\n".join(out)
