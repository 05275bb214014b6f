"""Gateway fixtures: one real worker (tiny Llama) and one real gateway process per module, on
the session's private Redis under the module's own key prefix. Nothing here flushes Redis (the
suite's ``r`` / ``redis_url`` fixtures do: gateway tests use ``plain_redis`` instead)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from gateway_helpers import Gateway, Worker

from tokenfleet.shared.keys import Keys
from tokenfleet.worker.devtools.local_redis import RedisServer


@dataclass
class Fleet:
    """What a gateway test talks to."""

    redis_url: str
    prefix: str
    keys: Keys
    r: redis.Redis
    gateway: Gateway
    worker: Worker
    log_dir: Path

    @property
    def base_url(self) -> str:
        return self.gateway.url + "/v1"

    def second_gateway(self, *extra: str, name: str = "gateway-2") -> Gateway:
        return Gateway(self.redis_url, self.prefix, self.log_dir, *extra, name=name).wait_ready()


@pytest.fixture(scope="module")
def plain_redis(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


def start_fleet(
    redis_server: RedisServer,
    r: redis.Redis,
    model_dir: Path,
    log_dir: Path,
    gateway_args: tuple[str, ...] = (),
    worker_args: tuple[str, ...] = (),
) -> Fleet:
    prefix = f"gw{uuid.uuid4().hex[:8]}"
    worker = Worker(model_dir, redis_server.url, prefix, "gw-worker", log_dir, *worker_args)
    gateway = Gateway(redis_server.url, prefix, log_dir, *gateway_args)
    try:
        worker.wait_ready(r)
        gateway.wait_ready()
    except BaseException:
        worker.close()
        gateway.close()
        raise
    return Fleet(redis_server.url, prefix, Keys(prefix), r, gateway, worker, log_dir)


@pytest.fixture(scope="module")
def fleet(
    redis_server: RedisServer,
    plain_redis: redis.Redis,
    tiny_llama_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Fleet]:
    log_dir = tmp_path_factory.mktemp("gateway-logs")
    f = start_fleet(redis_server, plain_redis, tiny_llama_dir, log_dir)
    try:
        yield f
    finally:
        f.gateway.close()
        f.worker.close()
