"""HA fixtures: one private Sentinel setup per session (1 primary, 1 replica, 3 sentinels on
loopback ports; ``LocalSentinel``) and one private Redis Cluster (3 primaries + 3 replicas;
``LocalCluster``), each started when a test first asks for it and torn down after. Helpers:
``ha_helpers``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tokenfleet.worker.devtools.testing.local_cluster import LocalCluster
from tokenfleet.worker.devtools.testing.local_sentinel import LocalSentinel


@pytest.fixture(scope="session")
def sentinel_setup() -> Iterator[LocalSentinel]:
    with LocalSentinel(service="tfha") as setup:
        yield setup


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[LocalCluster]:
    with LocalCluster(num_primaries=3) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def ref_engine(tiny_llama_dir: Path) -> Any:
    """An in-process engine on the tiny Llama: what the fleet's greedy output must equal."""
    import torch

    from tokenfleet.worker.engine.engine import Engine

    torch.set_num_threads(1)
    return Engine(tiny_llama_dir, device="cpu")


@pytest.fixture(scope="session")
def chaos_reference(ref_engine: Any) -> dict[str, list[int]]:
    """The chaos tests' undisturbed greedy runs (``chaos_fleet.reference_runs``), computed once:
    every chaos scenario compares its streams with the same ones."""
    from chaos_fleet import reference_runs

    return reference_runs(ref_engine)
