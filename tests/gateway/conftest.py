"""Gateway fixtures: one real worker (tiny Llama) and one real gateway process, started once
per session on a private Redis server of their own (the suite's ``r`` / ``redis_url`` fixtures
flush the shared one, and some tests assert that it holds nothing they did not write) and shared
by every module that takes the default ``fleet`` (modules that need other flags start their
own, per module, on the shared server). Nothing here flushes Redis (gateway tests use
``plain_redis`` instead)."""

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


@pytest.fixture(scope="session")
def fleet(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """The default fleet, shared by the modules that use it: no test of theirs signals or stops
    its worker or gateway, nor changes a setting of theirs (a test that kills a gateway starts a
    second one: ``Fleet.second_gateway``). Its tests reach its Redis through ``fleet.r`` and
    ``fleet.redis_url``."""
    server = RedisServer(unix_socket=True, prefer="system").start()
    client = redis.Redis.from_url(server.url)
    log_dir = tmp_path_factory.mktemp("gateway-logs")
    try:
        yield from module_fleet(server, client, tiny_llama_dir, log_dir, threaded=True)
    finally:
        client.close()
        server.stop()
