"""A batch step that WATCHes a key (``BatchStore._leave_validating``) on a primary that refuses
writes (``min-replicas-to-write``): redis-py reports the lost connection as a ``WatchError``;
the step must raise it as the lost connection it is (the gateway's outage handling), not take
it for a concurrent change and retry at once, forever."""

from __future__ import annotations

import asyncio

import pytest

from tokenfleet.producer.gateway.batches.store import BatchStore
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.redis_connect import async_redis_client
from tokenfleet.shared.replica_wait import ReplicationLagged
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.devtools.local_redis import RedisServer


def test_a_watched_step_on_a_primary_refusing_writes_raises_instead_of_spinning() -> None:
    with RedisServer() as server:
        settings = Settings(redis_url=server.url, key_prefix="tfrefuse")
        key = Keys("tfrefuse").batch("batch_x")

        async def body() -> None:
            r = async_redis_client(settings)
            try:
                await r.hset(key, "status", "validating")
                await r.config_set("min-replicas-to-write", 1)
                store = BatchStore(r, settings)
                step = store._leave_validating("batch_x", {"status": "failed"})
                with pytest.raises(ReplicationLagged):  # (the bug spun here until pytest's timeout)
                    await step
                await r.config_set("min-replicas-to-write", 0)
                assert await r.hget(key, "status") == b"validating"  # nothing was written
            finally:
                await r.aclose()

        asyncio.run(body())
