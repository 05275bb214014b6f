"""Quotas hold exactly across processes: four real processes, each with its own connections
and many admits in flight, hammer one key; the admit script is the only arbiter.

Exactness needs a window with no refill: the processes pass the quota scripts one fixed test
clock (``clock_ms``), so the buckets cannot refill during the test. A last test runs on Redis
``TIME`` and bounds the count by the refill that elapsed, measured on the same clock."""

from __future__ import annotations

import sys
from contextlib import ExitStack
from pathlib import Path

import redis
from child_process import ChildProcess
from waiting import wait_for

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
    gate = redis.Redis.from_url(url, socket_timeout=90)  # (redis-py's default is 5 s: < the BLPOP)
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
    r: redis.Redis,
    settings: Settings,
    log_dir: Path,
    presented: str,
    attempts: int,
    tokens: int,
    now: str,
) -> list[int]:
    """Start the processes, let them go together, return each one's admitted count."""
    argv = [settings.redis_url, settings.key_prefix, presented, str(attempts), str(tokens), now]
    argv += [READY, GATE]
    with ExitStack() as stack:
        procs = []
        for i in range(PROCESSES):
            child = ChildProcess(
                [sys.executable, "-c", CHILD, *argv],
                log_dir / f"child-{i}.out",
                stderr_path=log_dir / f"child-{i}.err",
            )
            stack.callback(child.close)
            procs.append(child)
        wait_for(  # every child has authenticated and waits at the gate
            lambda: r.llen(READY) >= PROCESSES, "every child at the gate", timeout_s=60
        )
        assert r.llen(READY) == PROCESSES
        r.rpush(GATE, *["go"] * PROCESSES)
        counts = []
        for p in procs:
            assert p.wait(120) == 0, p.errors()
            counts.append(int(p.output(tail=None)))
        return counts


def test_rpm_is_exact_across_processes(r: redis.Redis, settings: Settings, tmp_path: Path) -> None:
    presented, _ = ApiKeyAdmin(r, settings).create("web", rpm=40)
    counts = _hammer(r, settings, tmp_path, presented, attempts=30, tokens=0, now="1700000000000")
    assert sum(counts) == 40  # of 120 attempts


def test_tpm_is_exact_across_processes(r: redis.Redis, settings: Settings, tmp_path: Path) -> None:
    presented, _ = ApiKeyAdmin(r, settings).create("web", rpm=1000, tpm=1000)
    counts = _hammer(r, settings, tmp_path, presented, attempts=60, tokens=7, now="1700000000000")
    assert sum(counts) == 1000 // 7  # 142 of 240 attempts; the requests limit never binds


def test_rpm_on_redis_time_is_bounded_by_the_refill(
    r: redis.Redis, settings: Settings, tmp_path: Path
) -> None:
    presented, _ = ApiKeyAdmin(r, settings).create("web", rpm=40)

    def redis_ms() -> int:
        seconds, micros = r.time()
        return seconds * 1000 + micros // 1000

    start = redis_ms()  # before any admit: the bucket is full until the first one
    counts = _hammer(r, settings, tmp_path, presented, attempts=30, tokens=0, now="")
    elapsed_ms = redis_ms() - start
    # Refused only when empty, so at least the capacity passes; at most the capacity plus
    # what refilled (40 per 60_000 ms) while the processes ran.
    assert 40 <= sum(counts) <= 40 + elapsed_ms * 40 // 60_000
