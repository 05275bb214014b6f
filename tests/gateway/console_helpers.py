"""What the console's tests share: a fleet with API keys on and a key of each role, a scripted
pretend worker that ends a request ``error`` (its entry goes to the dead letters; the suite's
``pretend_worker``), and reading ``tokenfleet status --json`` as a user runs it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import redis
from child_process import run_command, tokenfleet_args
from gateway_helpers import Fleet, start_fleet

from tokenfleet.producer import Client
from tokenfleet.producer.gateway.auth import ApiKeyAdmin
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.devtools.local_redis import RedisServer

IDLE_MODEL = "nobody"  # declared, no worker: its requests wait for as long as a test needs


@dataclass(frozen=True)
class ConsoleKeys:
    """A presented key of each role."""

    user: str
    viewer: str
    admin: str

    def bearer(self, role: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {getattr(self, role)}"}


def make_keys(r: redis.Redis, settings: Settings) -> ConsoleKeys:
    admin = ApiKeyAdmin(r, settings)
    tag = os.urandom(3).hex()
    made = {
        role: admin.create(f"{role}-{tag}", role=role)[0] for role in ("user", "viewer", "admin")
    }
    return ConsoleKeys(**made)


def status_json(redis_url: str, prefix: str) -> dict[str, Any]:
    """``tokenfleet status --json`` run as a user runs it (its own process)."""
    out = run_command(
        tokenfleet_args("status", "--json"),
        {"REDIS_URL": redis_url, "TOKENFLEET_KEY_PREFIX": prefix},
        timeout_s=60,
    )
    assert out.returncode == 0, out.stderr
    data: dict[str, Any] = orjson.loads(out.stdout)
    return data


def client(redis_url: str, prefix: str, **settings: Any) -> Client:
    return Client.from_url(settings=Settings(redis_url=redis_url, key_prefix=prefix, **settings))


def console_fleet(
    redis_server: RedisServer,
    r: redis.Redis,
    model_dir: Path,
    log_dir: Path,
    *,
    worker_args: tuple[str, ...] = (),
    gateway_env: dict[str, str] | None = None,
    threaded: bool = False,
) -> Iterator[Fleet]:
    """A module fixture's body: a gateway with API keys required and one worker, the idle
    model declared; stopped after the module. ``threaded``: the worker runs in a thread (for
    modules that never signal it)."""
    f = start_fleet(
        redis_server,
        r,
        model_dir,
        log_dir,
        gateway_args=("--auth", "required"),
        worker_args=worker_args,
        gateway_env=gateway_env,
        threaded=threaded,
    )
    f.r.sadd(f.keys.declared, IDLE_MODEL)
    try:
        yield f
    finally:
        f.gateway.close()
        f.worker.close()
