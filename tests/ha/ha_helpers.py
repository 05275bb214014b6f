"""Sentinel- and cluster-mode helpers: settings and CLI flags for a ``LocalSentinel`` or a
``LocalCluster``, and real ``tokenfleet worker`` processes that reach it in that mode (in sentinel
mode their ``--redis-url`` names a port where nothing listens: only its db and credentials
count; in cluster mode it names one node, the seed)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from tokenfleet.shared.cluster_connection import fleet_slot
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.devtools.testing.local_cluster import LocalCluster
from tokenfleet.worker.devtools.testing.local_sentinel import LocalSentinel

DEADLINE_S = 120.0  # failure guard only: every wait polls for a state
NOWHERE_URL = "redis://127.0.0.1:1/0"  # nothing listens on port 1: proves the sentinels are used


def wait_for(predicate: Callable[[], Any], what: str, timeout_s: float = DEADLINE_S) -> Any:
    """Poll ``predicate`` until it returns something truthy; ``AssertionError`` at the deadline."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def ha_settings(setup: LocalSentinel, prefix: str) -> Settings:
    """Sentinel-mode settings for ``setup`` under key prefix ``prefix``."""
    return Settings(
        redis_url=NOWHERE_URL,
        key_prefix=prefix,
        redis_mode="sentinel",
        sentinels=setup.sentinels,
        sentinel_service=setup.service,
        redis_socket_timeout_s=5,
        redis_connect_timeout_s=2,
    )


def sentinel_flags(setup: LocalSentinel) -> list[str]:
    """The CLI flags that put a tokenfleet command in sentinel mode against ``setup``."""
    return ["--redis-url", NOWHERE_URL, "--redis-mode", "sentinel", "--sentinels",
            setup.sentinels, "--sentinel-service", setup.service]  # fmt: skip


def seed_url(cluster: LocalCluster, prefix: str) -> str:
    """A URL of a node that does not own the slot of ``prefix``'s default lane (proves the
    client finds the owner)."""
    owner = cluster.owner_port(fleet_slot(Keys(prefix, cluster=True, lane="default").root))
    return next(f"redis://127.0.0.1:{p}/0" for p in cluster.ports if p != owner)


def cluster_settings(cluster: LocalCluster, prefix: str) -> Settings:
    """Cluster-mode settings for ``cluster`` under key prefix ``prefix``."""
    return Settings(
        redis_url=seed_url(cluster, prefix),
        key_prefix=prefix,
        redis_mode="cluster",
        redis_socket_timeout_s=5,
        redis_connect_timeout_s=2,
    )


def cluster_flags(cluster: LocalCluster, prefix: str) -> list[str]:
    """The CLI flags that put a tokenfleet command in cluster mode against ``cluster``."""
    return ["--redis-url", seed_url(cluster, prefix), "--redis-mode", "cluster"]


class HAWorker:
    """A real ``tokenfleet worker`` process in sentinel or cluster mode (flags, not
    environment)."""

    def __init__(
        self, model_dir: Path, setup: LocalSentinel | LocalCluster, prefix: str, name: str,
        log_dir: Path, *extra: str, env: dict[str, str] | None = None, model: str = "default",
    ) -> None:  # fmt: skip
        self.name = name
        in_cluster = isinstance(setup, LocalCluster)
        self.keys = Keys(prefix, cluster=in_cluster).for_model(model)  # its lane (a cluster)
        self.model = model
        if model != "default":
            extra = ("--model-name", model, *extra)
        flags = cluster_flags(setup, prefix) if in_cluster else sentinel_flags(setup)  # type: ignore[arg-type]
        self.log_path = log_dir / f"{name}.log"
        env = {**os.environ, "TOKENFLEET_KEY_PREFIX": prefix, **(env or {})}
        for var in ("REDIS_URL", "TOKENFLEET_MODEL", "TOKENFLEET_REDIS_MODE"):
            env.pop(var, None)
        args = [sys.executable, "-m", "tokenfleet.worker.cli", "worker", "--model",
                str(model_dir), "--name", name, "--threads", "1", "--heartbeat-ttl-s", "2",
                "--claim-idle-s", "0.5", "--claim-interval-s", "0.5",
                *flags, *extra]  # fmt: skip
        self.log = open(self.log_path, "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(args, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def ready(self, r: redis.Redis) -> bool:
        """Whether its heartbeat is there (``r``: a client of the worker's lane's slot)."""
        if self.proc.poll() is not None:
            raise AssertionError(f"worker {self.name} exited early:\n{self.output()}")
        return bool(r.exists(self.keys.worker(self.name)))

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")[-6000:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def close(self) -> None:
        self.kill()
        self.log.close()
