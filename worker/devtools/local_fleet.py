"""Start and stop a few local worker processes (the demo and the end-to-end benchmark use it).

``LocalFleet`` runs ``python -m tokenfleet.worker.cli worker`` N times with one key prefix,
waits until each has a heartbeat in Redis, and stops them with SIGTERM (SIGKILL after a grace).
``delete_prefix()`` removes a run's private key prefix afterwards. (The tiny model's cache,
``cached_tiny_model()``, lives with the model in ``tiny_model``.)

Invariant: after ``start()`` returns, every process is alive and has a heartbeat; after
``stop()`` none is running.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis

from tokenfleet.shared.keys import Keys


def delete_prefix(redis_url: str, key_prefix: str) -> int:
    """Delete every key under ``key_prefix:`` (a demo's or benchmark's private prefix); best
    effort, returns how many were deleted."""
    client = redis.Redis.from_url(redis_url)
    deleted = 0
    try:
        batch: list[Any] = []
        for key in client.scan_iter(match=f"{key_prefix}:*", count=500):
            batch.append(key)
            if len(batch) >= 500:
                deleted += int(client.delete(*batch))
                batch.clear()
        if batch:
            deleted += int(client.delete(*batch))
    except redis.RedisError:
        pass
    finally:
        client.close()
    return deleted


class LocalFleet:
    """N worker processes on this machine, sharing one Redis and one key prefix."""

    def __init__(
        self,
        model: str | os.PathLike[str],
        redis_url: str,
        *,
        key_prefix: str,
        num_workers: int,
        threads: int = 1,
        extra_args: Sequence[str] = (),
        name_prefix: str | None = None,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.model = os.fspath(model)
        self.redis_url = redis_url
        self.keys = Keys(key_prefix)
        self.key_prefix = key_prefix
        self.threads = threads
        self.extra_args = list(extra_args)
        base = name_prefix or f"local-{uuid.uuid4().hex[:6]}"
        self.names = [f"{base}-w{i}" for i in range(num_workers)]
        self.log_dir = Path(tempfile.mkdtemp(prefix="tokenfleet-workers-"))
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, timeout_s: float = 180.0) -> LocalFleet:
        """Start every worker and wait for its heartbeat; ``RuntimeError`` with its log if not."""
        env = {
            **os.environ,
            "REDIS_URL": self.redis_url,
            "TOKENFLEET_KEY_PREFIX": self.key_prefix,
            "TOKENFLEET_MODEL": self.model,
        }
        for name in self.names:
            log = open(self.log_dir / f"{name}.log", "wb")  # noqa: SIM115 - closed by the child
            args = [
                sys.executable,
                "-m",
                "tokenfleet.worker.cli",
                "worker",
                "--name",
                name,
                "--threads",
                str(self.threads),
                *self.extra_args,
            ]
            self.procs.append(subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT))
            log.close()
        client = redis.Redis.from_url(self.redis_url)
        try:
            deadline = time.monotonic() + timeout_s
            waiting = set(self.names)
            while waiting:
                for name, proc in zip(self.names, self.procs, strict=True):
                    if proc.poll() is not None:
                        self.stop()
                        raise RuntimeError(
                            f"worker {name} exited with {proc.returncode}:\n" + self.log_tail(name)
                        )
                waiting = {n for n in waiting if not client.exists(self.keys.worker(n))}
                if waiting and time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"workers {sorted(waiting)} did not start in {timeout_s}s")
                if waiting:
                    time.sleep(0.1)
        finally:
            client.close()
        return self

    def log_tail(self, name: str, num_chars: int = 4000) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace")[-num_chars:] if path.exists() else ""

    def stop(self, grace_s: float = 30.0) -> list[int]:
        """SIGTERM every worker, wait up to ``grace_s``, SIGKILL the rest; their exit codes."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        codes = []
        deadline = time.monotonic() + grace_s
        for proc in self.procs:
            try:
                codes.append(proc.wait(max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes.append(proc.wait())
        return codes

    def cleanup(self) -> None:
        """Remove the log folder."""
        shutil.rmtree(self.log_dir, ignore_errors=True)

    def __enter__(self) -> LocalFleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self.cleanup()
