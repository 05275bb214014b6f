"""Chaos with the default settings (no ``TOKENFLEET_REDIS_WAIT_REPLICAS``): a Sentinel failover by
``SENTINEL FAILOVER``, a SIGKILLed sentinel-managed primary, and a SIGKILLed Cluster primary
(its replica promoted by the cluster), each mid-run under two real workers and streaming
clients (``Handle.stream()`` and SSE through a gateway). Replication is asynchronous, so each
switch may take writes the old primary acknowledged; the workers put back what it took
(worker/service/repair.py) and the handles submit again what Redis forgot. Every request ends
exactly once, ``done``, its stream gap-free, duplicate-free and equal to the undisturbed greedy
run; no worker ends a request ``error`` (tests/ha/chaos_fleet.py). The counts are printed.

The Sentinel setups run ``LocalSentinel``'s defaults, ``min-replicas-to-write 1`` /
``min-replicas-max-lag 3`` (docs/redis-modes.md): after a SIGKILL the promoted primary refuses
writes until the killed node is back as its replica, and the fleet waits as in an outage."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from chaos_fleet import ChaosFleet, chaos_fleet, heartbeat_of
from ha_helpers import cluster_flags, cluster_settings, ha_settings, sentinel_flags

from tokenfleet.shared.cluster_connection import fleet_slot
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.redis_connect import redis_client
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.devtools.testing.local_cluster import LocalCluster
from tokenfleet.worker.devtools.testing.local_sentinel import LocalSentinel

pytestmark = pytest.mark.slow
SHORT = 40  # requests that end around the switch


def _run(fleet: ChaosFleet, switch: Callable[[], str], reference: dict[str, list[int]]) -> None:
    """Load, the switch mid-run, more load after it, then every check."""
    fleet.submit(4, sse=2)
    fleet.submit(2, max_tokens=SHORT)
    fleet.wait_running(min_tokens=8)
    how = switch()
    fleet.submit(2, sse=1)
    fleet.check(reference, how)


def _sentinel_fleet(
    setup: LocalSentinel, prefix: str, model_dir: Path, log_dir: Path
) -> tuple[Settings, Any]:
    settings = ha_settings(setup, prefix)

    def inspect() -> redis.Redis:
        return redis_client(settings)

    fleet = chaos_fleet(
        model_dir,
        log_dir,
        settings=settings,
        flags=sentinel_flags(setup),
        inspect=inspect,
        ready=heartbeat_of(inspect, Keys(prefix)),
    )
    return settings, fleet


def test_sentinel_failover_with_the_defaults_loses_nothing(
    sentinel_setup: LocalSentinel,
    tiny_llama_dir: Path,
    chaos_reference: dict[str, list[int]],
    tmp_path: Path,
) -> None:
    _, ctx = _sentinel_fleet(sentinel_setup, "hadf", tiny_llama_dir, tmp_path)
    with ctx as fleet:

        def switch() -> str:
            old = sentinel_setup.primary_port()
            new = sentinel_setup.failover()
            return f"SENTINEL FAILOVER {old} -> {new}"

        _run(fleet, switch, chaos_reference)


def test_sentinel_failover_without_min_replicas_loses_nothing(
    tiny_llama_dir: Path, chaos_reference: dict[str, list[int]], tmp_path: Path
) -> None:
    """The setup the issue was found on: no ``min-replicas-to-write`` either, so the demoted
    primary takes writes until the sentinels turn it into a replica; they are discarded then,
    and the workers put them back."""
    with LocalSentinel(service="tfnominrep", min_replicas_to_write=0) as setup:
        _, ctx = _sentinel_fleet(setup, "hadn", tiny_llama_dir, tmp_path)
        with ctx as fleet:

            def switch() -> str:
                old = setup.primary_port()
                new = setup.failover()
                return f"SENTINEL FAILOVER {old} -> {new}, no min-replicas-to-write"

            _run(fleet, switch, chaos_reference)


def test_a_killed_sentinel_primary_with_the_defaults_loses_nothing(
    tiny_llama_dir: Path, chaos_reference: dict[str, list[int]], tmp_path: Path
) -> None:
    with LocalSentinel(service="tfdefkill") as setup:
        _, ctx = _sentinel_fleet(setup, "hadk", tiny_llama_dir, tmp_path)
        with ctx as fleet:

            def switch() -> str:
                old = setup.primary_port()
                new = setup.crash_primary()
                return f"sentinel primary {old} SIGKILLed, {new} promoted"

            _run(fleet, switch, chaos_reference)


def test_a_killed_cluster_primary_with_the_defaults_loses_nothing(
    redis_cluster: LocalCluster,
    tiny_llama_dir: Path,
    chaos_reference: dict[str, list[int]],
    tmp_path: Path,
) -> None:
    prefix = "hadc"
    settings = cluster_settings(redis_cluster, prefix)
    lane = dataclasses.replace(settings, lane="default")

    def inspect() -> redis.Redis:
        return redis_client(lane)

    keys = Keys(prefix, cluster=True).for_model("default")
    with chaos_fleet(
        tiny_llama_dir,
        tmp_path,
        settings=settings,
        flags=cluster_flags(redis_cluster, prefix),
        inspect=inspect,
        ready=heartbeat_of(inspect, keys),
    ) as fleet:

        def switch() -> str:
            old, new = redis_cluster.crash_primary(fleet_slot(keys.root))
            return f"cluster primary {old} SIGKILLed, replica {new} promoted"

        _run(fleet, switch, chaos_reference)
