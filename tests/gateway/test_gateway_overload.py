"""A full queue: 429 with a Retry-After from the drain rate (nothing enqueued); a stream whose
request is evicted by a drop-oldest queue, or expires waiting, ends with an error naming why.

The worker here runs one sequence at a time, so one long request keeps it busy and the queue
behind it fills deterministically (each step waits for the state it needs, never for time)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from gateway_helpers import Fleet, module_fleet, wait_for

from tokenfleet.producer import Client
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.devtools.local_redis import RedisServer

pytestmark = pytest.mark.slow

HOG: dict[str, Any] = {"model": "default", "prompt": "hog", "max_tokens": 4000, "ignore_eos": True}


@pytest.fixture(scope="module")
def busy_fleet(
    redis_server: RedisServer,
    plain_redis: redis.Redis,
    tiny_llama_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Fleet]:
    log_dir = tmp_path_factory.mktemp("gateway-overload-logs")
    yield from module_fleet(
        redis_server,
        plain_redis,
        tiny_llama_dir,
        log_dir,
        worker_args=("--max-num-seqs", "1"),
        threaded=True,  # no test signals the worker
    )


def status(fleet: Fleet, rid: str) -> str:
    return httpx.get(f"{fleet.base_url}/requests/{rid}", timeout=10).json().get("status", "")


def set_queue(fleet: Fleet, *, max_waiting: int, policy: str) -> None:
    settings = Settings(redis_url=fleet.redis_url, key_prefix=fleet.prefix)
    with Client.from_url(settings=settings) as client:
        client.set_queue_config("normal", "default", max_waiting=max_waiting, policy=policy)


def client_of(fleet: Fleet) -> Client:
    return Client.from_url(settings=Settings(redis_url=fleet.redis_url, key_prefix=fleet.prefix))


@pytest.fixture
def hog(busy_fleet: Fleet) -> Iterator[str]:
    """A long request the worker is running (its one slot is taken)."""
    with client_of(busy_fleet) as client:
        rid = client.submit(**HOG).request_id
        wait_for(lambda: status(busy_fleet, rid) == "running", "the hog to run")
        yield rid
        client.cancel(rid)
    wait_for(lambda: status(busy_fleet, rid) == "cancelled", "the hog to end")


def queued(fleet: Fleet, **extra: Any) -> str:
    """Submit one request that will wait behind the hog (no stream: answered at its end)."""
    with client_of(fleet) as client:
        return client.submit(model="default", prompt="wait", max_tokens=4, **extra).request_id


def test_full_drop_newest_queue_is_429_with_retry_after(busy_fleet: Fleet, hog: str) -> None:
    set_queue(busy_fleet, max_waiting=1, policy="drop_newest")
    waiting = queued(busy_fleet)
    before = set(busy_fleet.r.scan_iter(match=f"{busy_fleet.prefix}:req:*"))
    resp = httpx.post(
        busy_fleet.base_url + "/chat/completions",
        json={"model": "default", "messages": [{"role": "user", "content": "x"}]},
        timeout=30,
    )
    assert resp.status_code == 429, resp.text
    assert resp.json()["error"]["code"] == "queue_full"
    assert resp.json()["error"]["type"] == "rate_limit_error"
    assert int(resp.headers["retry-after"]) >= 1
    assert set(busy_fleet.r.scan_iter(match=f"{busy_fleet.prefix}:req:*")) == before
    # what the Retry-After is derived from: workers count each start per queue
    assert int(busy_fleet.r.hget(busy_fleet.keys.drained, "default|normal") or 0) >= 1
    with client_of(busy_fleet) as client:
        client.cancel(waiting)


def test_a_stream_evicted_by_drop_oldest_ends_naming_why(busy_fleet: Fleet, hog: str) -> None:
    set_queue(busy_fleet, max_waiting=1, policy="drop_oldest")
    body = {"model": "default", "prompt": "evict me", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", busy_fleet.base_url + "/completions", json=body, timeout=60) as r:
        rid = r.headers["x-request-id"]
        newer = queued(busy_fleet)  # the queue holds one waiting request: ours is evicted
        datas = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    error = json.loads(datas[-1])["error"]
    assert error["code"] == "dropped"
    assert "drop" in error["message"]
    assert status(busy_fleet, rid) == "dropped"
    with client_of(busy_fleet) as client:
        client.cancel(newer)


def test_a_stream_whose_deadline_passes_while_waiting_ends_expired(
    busy_fleet: Fleet, hog: str
) -> None:
    set_queue(busy_fleet, max_waiting=100, policy="drop_newest")
    body = {"model": "default", "prompt": "too late", "max_tokens": 4, "stream": True}
    with httpx.stream(
        "POST",
        busy_fleet.base_url + "/completions",
        json=body,
        headers={"X-Deadline-S": "0.5"},
        timeout=60,
    ) as r:
        rid = r.headers["x-request-id"]
        record = httpx.get(f"{busy_fleet.base_url}/requests/{rid}", timeout=10).json()
        wait_for(lambda: time.time() > record["deadline"], "the deadline to pass")
        with client_of(busy_fleet) as client:  # the hog ends: the worker takes the next
            client.cancel(hog)
        datas = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    error = json.loads(datas[-1])["error"]
    assert error["code"] == "expired"
    assert status(busy_fleet, rid) == "expired"
