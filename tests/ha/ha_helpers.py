"""Sentinel- and cluster-mode helpers: settings and CLI flags for a ``LocalSentinel`` or a
``LocalCluster``, and real ``tokenfleet worker`` processes that reach it in that mode (in sentinel
mode their ``--redis-url`` names a port where nothing listens: only its db and credentials
count; in cluster mode it names one node, the seed)."""

from __future__ import annotations

import os
from pathlib import Path

import redis
from child_process import ChildProcess, tokenfleet_args
from waiting import DEADLINE_S as DEADLINE_S  # (re-exported: HA tests import both from here)
from waiting import wait_for as wait_for

from tokenfleet.shared.cluster_connection import fleet_slot
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.devtools.testing.local_cluster import LocalCluster
from tokenfleet.worker.devtools.testing.local_sentinel import LocalSentinel

NOWHERE_URL = "redis://127.0.0.1:1/0"  # nothing listens on port 1: proves the sentinels are used


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


class HAWorker(ChildProcess):
    """A real ``tokenfleet worker`` process in sentinel or cluster mode (flags, not
    environment); killed (SIGKILL) at :meth:`close`."""

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
        env = {**os.environ, "TOKENFLEET_KEY_PREFIX": prefix, **(env or {})}
        for var in ("REDIS_URL", "TOKENFLEET_MODEL", "TOKENFLEET_REDIS_MODE"):
            env.pop(var, None)
        args = tokenfleet_args("worker", "--model", str(model_dir), "--name", name, "--threads",
                               "1", "--heartbeat-ttl-s", "2", "--claim-idle-s", "0.5",
                               "--claim-interval-s", "0.5", *flags, *extra)  # fmt: skip
        super().__init__(args, log_dir / f"{name}.log", env, inherit_env=False)

    def ready(self, r: redis.Redis) -> bool:
        """Whether its heartbeat is there (``r``: a client of the worker's lane's slot)."""
        self.check_alive(f"worker {self.name}")
        return bool(r.exists(self.keys.worker(self.name)))
