"""Start and stop a local ``tokenfleet serve`` (the HTTP gateway) for benchmarks and demos.

``LocalGateway`` runs ``python -m tokenfleet.worker.cli serve`` on a loopback port with a
Redis URL and a key prefix of its own (a ``LocalFleet``'s, so it reaches those workers), waits
until ``/health`` answers, and stops it with SIGTERM (SIGKILL after a grace).

Invariant: after ``start()`` returns, the process is alive and ``/health`` answered 200; after
``stop()`` it is not running.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

from tokenfleet.worker.devtools.local_redis import free_port


class LocalGateway:
    """One gateway process on 127.0.0.1, its output in a log file of its own."""

    def __init__(
        self,
        redis_url: str,
        *,
        key_prefix: str,
        port: int | None = None,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.redis_url = redis_url
        self.key_prefix = key_prefix
        self.port = port or free_port()
        self.extra_args = list(extra_args)
        self.env = dict(env or {})
        self.log_dir = Path(tempfile.mkdtemp(prefix="tokenfleet-gateway-"))
        self.log_path = self.log_dir / "gateway.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The gateway's base URL (the OpenAI API is under ``/v1``)."""
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 120.0) -> LocalGateway:
        """Start the process and wait for ``/health``; ``RuntimeError`` with its log if not."""
        env = {
            **os.environ,
            "REDIS_URL": self.redis_url,
            "TOKENFLEET_KEY_PREFIX": self.key_prefix,
            **self.env,
        }
        args = [sys.executable, "-m", "tokenfleet.worker.cli", "serve", "--port", str(self.port)]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [*args, *self.extra_args], env=env, stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + timeout_s
        while not self.healthy():
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"the gateway exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"the gateway did not answer in {timeout_s}s:\n{self.log_tail()}"
                )
            time.sleep(0.1)
        return self

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as answer:
                return bool(answer.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def log_tail(self, num_chars: int = 4000) -> str:
        if not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def stop(self, grace_s: float = 30.0) -> int | None:
        """SIGTERM the process, wait up to ``grace_s``, SIGKILL it then; its exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def cleanup(self) -> None:
        """Remove the log folder."""
        shutil.rmtree(self.log_dir, ignore_errors=True)

    def __enter__(self) -> LocalGateway:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self.cleanup()
