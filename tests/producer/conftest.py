"""Producer fixtures: clients on the suite's private server (key prefix ``tft``) and a
scripted fake worker (``producer_helpers.FakeWorker``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from producer_helpers import FakeWorker

from tokenfleet.producer import Client
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.settings import Settings


@pytest.fixture
def client(r: redis.Redis, settings: Settings) -> Iterator[Client]:
    c = Client(r, settings=settings, recheck_s=1.0)
    yield c
    c.close()


@pytest.fixture
def worker(redis_url: str, keys: Keys) -> Iterator[FakeWorker]:
    conn = redis.Redis.from_url(redis_url)
    yield FakeWorker(conn, keys)
    conn.close()
