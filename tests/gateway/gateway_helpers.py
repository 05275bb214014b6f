"""Real processes for the gateway tests: ``tokenfleet serve`` (uvicorn) and ``tokenfleet
worker``, each a child process on the session's private Redis under a test's key prefix."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import redis

from tokenfleet.shared.keys import Keys
from tokenfleet.worker.devtools.local_redis import RedisServer

DEADLINE_S = 120.0


def wait_for(check: Callable[[], Any], what: str, timeout_s: float = DEADLINE_S) -> Any:
    """Poll ``check`` until it returns something truthy; AssertionError naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def free_port() -> int:
    """A TCP port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Proc:
    """A child process whose output goes to a log file."""

    def __init__(self, args: Sequence[str], env: dict[str, str], log_path: Path) -> None:
        self.log_path = log_path
        self.log = open(log_path, "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            list(args), env={**os.environ, **env}, stdout=self.log, stderr=subprocess.STDOUT
        )

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")[-6000:]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


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
        args = [sys.executable, "-m", "tokenfleet.worker.cli", "serve", "--port", str(self.port)]
        args += ["--log-level", "warning", *extra]
        full_env = {"REDIS_URL": redis_url, "TOKENFLEET_KEY_PREFIX": prefix, **(env or {})}
        super().__init__(args, full_env, log_dir / f"{name}.log")

    def wait_ready(self) -> Gateway:
        def ready() -> bool:
            if not self.alive():
                raise AssertionError(f"the gateway exited:\n{self.output()}")
            try:
                return httpx.get(self.url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, "the gateway's /health")
        return self


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
        args = [sys.executable, "-m", "tokenfleet.worker.cli", "worker", "--model", str(model_dir)]
        args += ["--name", name, "--threads", "1", "--heartbeat-ttl-s", "2", *extra]
        env = {"REDIS_URL": redis_url, "TOKENFLEET_KEY_PREFIX": prefix}
        super().__init__(args, env, log_dir / f"{name}.log")

    def wait_ready(self, r: redis.Redis) -> Worker:
        def ready() -> bool:
            if not self.alive():
                raise AssertionError(f"worker {self.name} exited:\n{self.output()}")
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
    worker: Worker
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
) -> Fleet:
    prefix = f"gw{uuid.uuid4().hex[:8]}"
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
) -> Iterator[Fleet]:
    """A module fixture's body: a fleet for the module's tests, stopped after them."""
    f = start_fleet(redis_server, r, model_dir, log_dir, gateway_args, worker_args)
    try:
        yield f
    finally:
        f.gateway.close()
        f.worker.close()
