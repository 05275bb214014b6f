"""Gateway fixtures: one real worker (tiny Llama) and one real gateway process per module, on
the session's private Redis under the module's own key prefix. Nothing here flushes Redis (the
suite's ``r`` / ``redis_url`` fixtures do: gateway tests use ``plain_redis`` instead)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from gateway_helpers import Fleet, module_fleet

from tokenfleet.worker.devtools.local_redis import RedisServer


@pytest.fixture(scope="module")
def plain_redis(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


@pytest.fixture(scope="module")
def fleet(
    redis_server: RedisServer,
    plain_redis: redis.Redis,
    tiny_llama_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Fleet]:
    log_dir = tmp_path_factory.mktemp("gateway-logs")
    yield from module_fleet(redis_server, plain_redis, tiny_llama_dir, log_dir)
