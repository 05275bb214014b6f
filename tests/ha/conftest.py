"""Sentinel-mode fixtures: one private Sentinel setup per session (1 primary, 1 replica,
3 sentinels on loopback ports; ``LocalSentinel``), torn down after. Helpers: ``ha_helpers``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tokenfleet.worker.devtools.local_sentinel import LocalSentinel


@pytest.fixture(scope="session")
def sentinel_setup() -> Iterator[LocalSentinel]:
    with LocalSentinel(service="tfha") as setup:
        yield setup
