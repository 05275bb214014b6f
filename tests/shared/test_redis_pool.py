"""The clients every process builds (``shared.redis_connect``) hold more than redis-py 8's
default 100 connections, and an asyncio client at its limit waits for a free one instead of
failing with ``MaxConnectionsError`` (a gateway or batch runner with hundreds of requests in
flight, each holding a connection while it blocks)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable
from typing import Any

import pytest
import redis
from waiting import wait_for_async

from tokenfleet.shared.redis_connect import async_redis_client
from tokenfleet.shared.settings import Settings


def _task(awaitable: Awaitable[Any]) -> asyncio.Task[Any]:
    async def run() -> Any:
        return await awaitable

    return asyncio.create_task(run())


def test_hundreds_of_blocked_commands_at_once_all_answer(settings: Settings) -> None:
    async def main() -> None:
        client = async_redis_client(settings)
        try:
            keys = [f"{settings.key_prefix}:pool-test:{i}" for i in range(250)]
            blocked = [_task(client.blpop([k], timeout=5)) for k in keys]
            await asyncio.sleep(0)
            pusher = async_redis_client(settings)
            for k in keys:  # each waiter holds a connection until its push
                await pusher.rpush(k, "x")
            got = await asyncio.gather(*blocked)
            await pusher.aclose()
            assert all(g is not None for g in got)
        finally:
            await client.aclose()

    asyncio.run(main())


def test_a_client_at_its_limit_waits_for_a_connection(settings: Settings) -> None:
    small = dataclasses.replace(settings, redis_max_connections=2)

    async def main() -> None:
        client = async_redis_client(small)
        try:
            key = f"{settings.key_prefix}:pool-wait"
            other = redis.Redis.from_url(settings.redis_url)
            first = _task(client.blpop([key + "1"], timeout=30))
            second = _task(client.blpop([key + "2"], timeout=30))

            async def both_blocked() -> bool:  # both connections of the pool are now taken
                return sum(c.get("cmd") == "blpop" for c in other.client_list()) >= 2

            await wait_for_async(both_blocked, "the BLPOPs to block", timeout_s=10, poll_s=0.01)
            third = _task(client.ping())  # no free connection: waits, not fails
            await asyncio.sleep(0.1)
            assert not third.done()
            other.rpush(key + "1", "x")
            assert await asyncio.wait_for(third, 5) is True
            other.rpush(key + "2", "x")
            other.close()
            await asyncio.gather(first, second)
        finally:
            await client.aclose()

    asyncio.run(main())


def test_the_pool_size_is_a_checked_setting() -> None:
    with pytest.raises(ValueError, match="redis_max_connections"):
        Settings(redis_max_connections=0)
