"""What one console refresh asks of Redis is bounded by the fleet's shape, not by how much waits:
the same commands, as many of each, on a fleet with a few requests queued as on one with tens of
thousands queued and thousands of dead letters; no ``KEYS``, no ``SCAN``, and every range read
carries its bound; with API keys on, the same whatever number of keys were created and revoked.
Counted on a Redis server of the test's own (``INFO commandstats`` and ``MONITOR``), with the
console's reading run as the gateway runs it (``ConsoleData``)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import redis.asyncio

from tokenfleet.producer import AsyncClient, Client
from tokenfleet.producer.gateway.auth import ApiKeyAdmin
from tokenfleet.producer.gateway.batches.store import BatchStore
from tokenfleet.producer.gateway.console.view import DEAD_LISTED, KEYS_LISTED, LISTED, ConsoleData
from tokenfleet.shared import dead_letters
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.devtools.local_redis import RedisServer

PREFIX = "reads"


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer(prefer="system") as s:
        yield s


def _fleet(url: str, waiting: int, dead: int) -> None:
    """A fleet with ``waiting`` requests queued (two models, three priorities), ``dead`` dead
    letters and a live worker's heartbeat."""
    r = redis.Redis.from_url(url)
    r.flushall()
    keys = Keys(PREFIX)
    r.sadd(keys.declared, "bulk", "other")
    with Client.from_url(settings=Settings(redis_url=url, key_prefix=PREFIX)) as client:
        for p in ("critical", "normal", "batch"):
            client.set_queue_config(p, "bulk", max_waiting=1_000_000)
            client.set_queue_config(p, "other", max_waiting=1_000_000)
        for start in range(0, waiting, 5_000):
            n = min(5_000, waiting - start)
            prio = ("critical", "normal", "batch")[start // 5_000 % 3]
            client.submit_many([{"prompt": "p", "model": "bulk", "priority": prio}] * n)
        client.submit_many([{"prompt": "q", "model": "other"}] * 60)
    pipe = r.pipeline(transaction=False)
    for i in range(dead):
        fields: dict[Any, Any] = {"stream": "s", "entry_id": f"{i}-0", "id": f"d{i}", "d": b"{}"}
        pipe.xadd(keys.dead_letter, {**fields, "reason": "x", "worker": "w", "size": "2"})
    now = time.time()
    pipe.hset(keys.worker("w1"), mapping={"model": "bulk", "beat_at": now, "started_at": now})
    pipe.zadd(keys.workers, {"w1": now})
    pipe.execute()
    assert r.xlen(keys.dead_letter) == dead
    r.close()


async def _refresh(url: str, keys_on: bool = False) -> dict[str, Any]:
    settings = Settings(redis_url=url, key_prefix=PREFIX)
    r = redis.asyncio.Redis.from_url(url)
    client = AsyncClient(r, settings=settings)
    batches = BatchStore(r, settings, default_max_tokens=16, lease_ms=1000)
    try:
        return await ConsoleData(client, r, batches, keys_on=keys_on).snapshot()
    finally:
        await client.aclose()
        await r.aclose()


def _counted_refresh(url: str, keys_on: bool = False) -> tuple[dict[str, int], dict[str, Any]]:
    """Calls per command of one refresh (its scripts loaded by one refresh before), and what it
    read."""
    asyncio.run(_refresh(url, keys_on))
    r = redis.Redis.from_url(url)
    r.config_resetstat()
    snapshot = asyncio.run(_refresh(url, keys_on))
    stats: Any = r.info("commandstats")
    r.close()
    assert len(snapshot["requests"]) == LISTED and len(snapshot["dead"]) == DEAD_LISTED
    calls = {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}
    calls.pop("config|resetstat", None)
    calls.pop("info", None)
    return calls, snapshot


def _monitored(url: str) -> list[str]:
    """The commands one refresh sends, as MONITOR prints them (script bodies' too)."""
    lines: list[str] = []
    ready = threading.Event()
    done = threading.Event()

    def watch() -> None:
        r = redis.Redis.from_url(url)
        with r.monitor() as m:
            ready.set()
            for line in m.listen():
                lines.append(line["command"])
                if done.is_set() and "PING" in line["command"].upper():
                    break
        r.close()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    ready.wait(10)
    asyncio.run(_refresh(url))
    done.set()
    r = redis.Redis.from_url(url)
    r.ping()
    thread.join(10)
    r.close()
    return lines


def test_one_refresh_reads_the_same_whatever_waits(server: RedisServer) -> None:
    _fleet(server.url, waiting=100, dead=60)
    small, _ = _counted_refresh(server.url)
    _fleet(server.url, waiting=30_000, dead=6_000)
    large, _ = _counted_refresh(server.url)
    assert small == large
    assert not {c for c in large if c.split("|")[0] in {"keys", "scan", "hscan", "sscan", "zscan"}}
    assert sum(large.values()) < 300  # (about 115: the fleet's shape, the listed rows)
    assert dead_letters.MAXLEN >= 6_000  # (the large fleet's dead letters are all kept)

    ranges = [c for c in _monitored(server.url) if c.split()[0].upper() in {"XRANGE", "XREVRANGE"}]
    assert ranges and all("COUNT" in c.upper() for c in ranges), ranges
    lists = [c.split() for c in _monitored(server.url) if c.split()[0].upper() == "LRANGE"]
    assert lists and all(int(c[-1]) < LISTED for c in lists), lists


def test_one_refresh_reads_as_many_keys_whatever_was_created(server: RedisServer) -> None:
    """With API keys on: the live keys' names, then at most ``KEYS_LISTED`` keys (two reads
    each); revoked keys, which only accumulate, are never read."""
    _fleet(server.url, waiting=100, dead=60)
    r = redis.Redis.from_url(server.url)
    admin = ApiKeyAdmin(r, Settings(redis_url=server.url, key_prefix=PREFIX))

    def create(n: int, tag: str) -> list[str]:
        return [admin.create(f"{tag}-{i:03}", rpm=60)[1].key_id for i in range(n)]

    create(KEYS_LISTED + 10, "a")
    few, snap = _counted_refresh(server.url, keys_on=True)
    names = [k["name"] for k in snap["keys"]]
    assert names == [f"a-{i:03}" for i in range(KEYS_LISTED)]  # the first by name, all live
    for key_id in create(300, "b"):
        admin.revoke(key_id)
    create(140, "0")  # live, and first by name now
    many, snap = _counted_refresh(server.url, keys_on=True)
    assert [k["name"] for k in snap["keys"]] == [f"0-{i:03}" for i in range(KEYS_LISTED)]
    assert r.scard(Keys(PREFIX).api_keys) == KEYS_LISTED + 10 + 300 + 140
    r.close()
    assert few == many
    assert few["hgetall"] >= KEYS_LISTED and few["evalsha"] >= KEYS_LISTED
