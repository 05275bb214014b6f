"""Quotas hold exactly across processes: four real processes, each with its own connections
and many admits in flight, hammer one key; the admit script is the only arbiter.

Exactness needs a window with no refill: the processes pass the quota scripts one fixed test
clock (``clock_ms``), so the buckets cannot refill during the test. A last test runs on Redis
``TIME`` and bounds the count by the refill that elapsed, measured on the same clock."""

from __future__ import annotations

import subprocess
import sys

import redis

from tokenfleet.producer.gateway.auth import ApiKeyAdmin
from tokenfleet.shared.settings import Settings

PROCESSES = 4
READY = "test:auth:ready"  # each child pushes here once it has authenticated
GATE = "test:auth:gate"  # the test pushes here once every child is ready: they start together

CHILD = """
import asyncio, sys
import redis, redis.asyncio
from tokenfleet.producer.gateway.auth import ApiKeyStore
from tokenfleet.shared.settings import Settings

url, prefix, presented, attempts, tokens, now, READY, GATE = sys.argv[1:9]

async def main():
    settings = Settings(redis_url=url, key_prefix=prefix)
    client = redis.asyncio.Redis.from_url(url, max_connections=16)
    clock = (lambda: int(now)) if now else None
    store = ApiKeyStore(client, settings, clock_ms=clock)
    key = await store.authenticate(presented)
    gate = redis.Redis.from_url(url)
    gate.rpush(READY, 1)
    assert gate.blpop([GATE], timeout=60), "no start signal"
    sem = asyncio.Semaphore(16)

    async def one():
        async with sem:
            return (await store.admit(key, int(tokens))).allowed

    results = await asyncio.gather(*(one() for _ in range(int(attempts))))
    print(sum(results))
    await client.aclose()

asyncio.run(main())
"""


def _hammer(
    r: redis.Redis, settings: Settings, presented: str, attempts: int, tokens: int, now: str
) -> list[int]:
    """Start the processes, let them go together, return each one's admitted count."""
    argv = [settings.redis_url, settings.key_prefix, presented, str(attempts), str(tokens), now]
    argv += [READY, GATE]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for _ in range(PROCESSES)
    ]
    try:
        for _ in range(PROCESSES):  # every child has authenticated and waits at the gate
            assert r.blpop([READY], timeout=60), "a child did not start"
        r.rpush(GATE, *["go"] * PROCESSES)
        counts = []
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err.decode()
            counts.append(int(out))
        return counts
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_rpm_is_exact_across_processes(r: redis.Redis, settings: Settings) -> None:
    presented, _ = ApiKeyAdmin(r, settings).create("web", rpm=40)
    counts = _hammer(r, settings, presented, attempts=30, tokens=0, now="1700000000000")
    assert sum(counts) == 40  # of 120 attempts


def test_tpm_is_exact_across_processes(r: redis.Redis, settings: Settings) -> None:
    presented, _ = ApiKeyAdmin(r, settings).create("web", rpm=1000, tpm=1000)
    counts = _hammer(r, settings, presented, attempts=60, tokens=7, now="1700000000000")
    assert sum(counts) == 1000 // 7  # 142 of 240 attempts; the requests limit never binds


def test_rpm_on_redis_time_is_bounded_by_the_refill(r: redis.Redis, settings: Settings) -> None:
    presented, _ = ApiKeyAdmin(r, settings).create("web", rpm=40)

    def redis_ms() -> int:
        seconds, micros = r.time()
        return seconds * 1000 + micros // 1000

    start = redis_ms()  # before any admit: the bucket is full until the first one
    counts = _hammer(r, settings, presented, attempts=30, tokens=0, now="")
    elapsed_ms = redis_ms() - start
    # Refused only when empty, so at least the capacity passes; at most the capacity plus
    # what refilled (40 per 60_000 ms) while the processes ran.
    assert 40 <= sum(counts) <= 40 + elapsed_ms * 40 // 60_000
