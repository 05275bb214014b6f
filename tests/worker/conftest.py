"""Worker-service fixtures: the tiny model (built once), an in-process reference engine, and a
Redis client on the session's private server that does not flush (module-scoped workers share it;
each test module uses its own key prefix)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from worker_helpers import worker_service

from tokenfleet.shared.settings import Settings
from tokenfleet.worker.devtools.local_redis import RedisServer


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_llama_dir: Path) -> Path:
    """The tiny Llama (seed 0) the worker tests serve: the suite-wide one."""
    return tiny_llama_dir


@pytest.fixture(scope="session")
def ref_engine(tiny_model_dir: Path) -> Any:
    """An in-process engine on the same model: what a worker's greedy output must equal."""
    import torch

    from tokenfleet.worker.engine.engine import Engine

    torch.set_num_threads(1)
    return Engine(tiny_model_dir, device="cpu")


@pytest.fixture
def cold_ref_engine(ref_engine: Any) -> Any:
    """``ref_engine`` with its prefix cache emptied (blocks cached by other tests were computed
    in other batches; their last-bit rounding can flip a greedy near-tie)."""
    ref_engine.block_manager.reset_prefix_cache()
    return ref_engine


@pytest.fixture(scope="module")
def rr(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """A client on the private server that never flushes (safe beside a running worker)."""
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


@pytest.fixture
def service(r: redis.Redis, settings: Settings, tiny_model_dir: Path) -> Iterator[Any]:
    """An in-process ``WorkerService`` named "w1" on the tiny model, its loop driven by hand (no
    heartbeat is written: other workers find it dead); its run table's invariants checked at
    the end."""
    svc = worker_service(r, settings, tiny_model_dir, "w1")
    yield svc
    svc.outbox.flush()
    svc.table.check_invariants()
