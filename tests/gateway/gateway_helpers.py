"""Real processes for the gateway tests: ``tokenfleet serve`` (uvicorn) and ``tokenfleet
worker``, each a child process on the session's private Redis under a test's key prefix."""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import redis
from child_process import ChildProcess, free_port, tokenfleet_args
from thread_worker import ThreadWorker
from waiting import wait_for

from tokenfleet.shared.keys import Keys
from tokenfleet.worker.devtools.local_redis import RedisServer


class Proc(ChildProcess):
    """A child process whose output goes to a log file (SIGTERM, 15 s, then SIGKILL at close)."""

    def __init__(self, args: Sequence[str], env: dict[str, str], log_path: Path) -> None:
        super().__init__(args, log_path, env)

    def close(self, grace_s: float = 15.0) -> None:
        super().close(grace_s)


class Gateway(Proc):
    """``tokenfleet serve`` on a free port."""

    def __init__(
        self,
        redis_url: str,
        prefix: str,
        log_dir: Path,
        *extra: str,
        name: str = "gateway",
        env: dict[str, str] | None = None,
        port: int | None = None,
    ) -> None:
        self.port = free_port() if port is None else port
        self.url = f"http://127.0.0.1:{self.port}"
        args = tokenfleet_args("serve", "--port", str(self.port))
        args += ["--log-level", "warning", *extra]
        full_env = {"REDIS_URL": redis_url, "TOKENFLEET_KEY_PREFIX": prefix, **(env or {})}
        super().__init__(args, full_env, log_dir / f"{name}.log")

    def wait_ready(self) -> Gateway:
        def ready() -> bool:
            self.check_alive("the gateway")
            try:
                return httpx.get(self.url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, "the gateway's /health")
        return self


GATEWAY_FLAGS = ("--threads", "1", "--heartbeat-ttl-s", "2")  # a gateway test's worker's


class Worker(Proc):
    """``tokenfleet worker`` on a model folder."""

    def __init__(
        self,
        model_dir: Path,
        redis_url: str,
        prefix: str,
        name: str,
        log_dir: Path,
        *extra: str,
    ) -> None:
        self.name = name
        self.keys = Keys(prefix)
        args = tokenfleet_args("worker", "--model", str(model_dir))
        args += ["--name", name, *GATEWAY_FLAGS, *extra]
        env = {"REDIS_URL": redis_url, "TOKENFLEET_KEY_PREFIX": prefix}
        super().__init__(args, env, log_dir / f"{name}.log")

    def wait_ready(self, r: redis.Redis) -> Worker:
        def ready() -> bool:
            self.check_alive(f"worker {self.name}")
            return bool(r.exists(self.keys.worker(self.name)))

        wait_for(ready, f"worker {self.name}'s heartbeat")
        return self


def sse_lines(response: httpx.Response) -> Any:
    """(field, value) pairs of an SSE response, one per non-empty line; ``("", "")`` at each
    blank line (an event's end)."""
    for line in response.iter_lines():
        if not line:
            yield "", ""
            continue
        name, _, value = line.partition(":")
        yield name, value.removeprefix(" ")


@dataclass
class Fleet:
    """What a gateway test talks to."""

    redis_url: str
    prefix: str
    keys: Keys
    r: redis.Redis
    gateway: Gateway
    worker: Worker | ThreadWorker
    log_dir: Path

    @property
    def base_url(self) -> str:
        return self.gateway.url + "/v1"

    def second_gateway(self, *extra: str, name: str = "gateway-2") -> Gateway:
        return Gateway(self.redis_url, self.prefix, self.log_dir, *extra, name=name).wait_ready()


def start_fleet(
    redis_server: RedisServer,
    r: redis.Redis,
    model_dir: Path,
    log_dir: Path,
    gateway_args: tuple[str, ...] = (),
    worker_args: tuple[str, ...] = (),
    gateway_env: dict[str, str] | None = None,
    *,
    threaded: bool = False,
) -> Fleet:
    """A worker and a gateway under a fresh key prefix, both ready. ``threaded``: the worker
    runs in a thread of the test (``ThreadWorker``: for tests that never signal or kill it)."""
    prefix = f"gw{uuid.uuid4().hex[:8]}"
    worker: Worker | ThreadWorker
    if threaded:
        worker = ThreadWorker(
            model_dir, redis_server.url, prefix, "gw-worker", *worker_args, flags=GATEWAY_FLAGS
        )
    else:
        worker = Worker(model_dir, redis_server.url, prefix, "gw-worker", log_dir, *worker_args)
    gateway = Gateway(redis_server.url, prefix, log_dir, *gateway_args, env=gateway_env)
    try:
        worker.wait_ready(r)
        gateway.wait_ready()
    except BaseException:
        worker.close()
        gateway.close()
        raise
    return Fleet(redis_server.url, prefix, Keys(prefix), r, gateway, worker, log_dir)


def module_fleet(
    redis_server: RedisServer,
    r: redis.Redis,
    model_dir: Path,
    log_dir: Path,
    gateway_args: tuple[str, ...] = (),
    worker_args: tuple[str, ...] = (),
    *,
    threaded: bool = False,
) -> Iterator[Fleet]:
    """A module fixture's body: a fleet for the module's tests, stopped after them."""
    f = start_fleet(
        redis_server, r, model_dir, log_dir, gateway_args, worker_args, threaded=threaded
    )
    try:
        yield f
    finally:
        f.gateway.close()
        f.worker.close()
