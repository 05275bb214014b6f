"""The events a fleet on a Redis Cluster must ride out, each under load: two real workers and a
producer run streaming requests, and mid-run a replica of the fleet's slot takes over (``CLUSTER
FAILOVER``), or the slot's primary is SIGKILLed (the cluster promotes the replica on its own; the
killed node comes back empty as its replica), or the slot, with every key in it, is migrated to
another primary (``SETSLOT IMPORTING/MIGRATING``, ``MIGRATE``, ``SETSLOT NODE``). Every request
must end exactly once, every client stream (live sharded pub/sub, gap-filled from the durable
token record across the switch) must be gap-free and duplicate-free, and afterwards the slot's
new primary must hold every record done with the very text the client saw. The counts are
printed.

A killed primary loses what it had not replicated yet (Redis replicates asynchronously): that
test runs the workers and the producer with ``TOKENFLEET_REDIS_WAIT_REPLICAS=1``
(``shared.replica_wait``), as docs/redis-modes.md recommends; a ``CLUSTER FAILOVER`` and a
migration lose nothing by themselves (the replica catches up before it takes over; ``MIGRATE``
moves each key atomically), so those tests run without it.

Each test has its own key prefix, so its own slot (``{hafo}``, ``{hacrash}``, ``{hamig}``)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from ha_helpers import HAWorker, cluster_settings
from waiting import DEADLINE_S, wait_for

from tokenfleet.producer import AsyncClient, Client
from tokenfleet.shared.cluster_connection import fleet_slot
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.record import RequestRecord
from tokenfleet.shared.redis_connect import redis_client
from tokenfleet.shared.schema import TerminalEvent, TokenEvent
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.devtools.testing.local_cluster import LocalCluster

pytestmark = pytest.mark.slow
NUM_REQUESTS = 16
MAX_TOKENS = 160
FLAGS = ("--max-num-seqs", "4")
WAIT_ENV = {"TOKENFLEET_REDIS_WAIT_REPLICAS": "1", "TOKENFLEET_REDIS_WAIT_MS": "200"}


@contextlib.contextmanager
def running_workers(
    cluster: LocalCluster,
    model_dir: Path,
    prefix: str,
    log_dir: Path,
    env: dict[str, str] | None = None,
) -> Iterator[list[HAWorker]]:
    """Two workers of fleet ``prefix`` on ``cluster``, ready (heartbeats seen); killed after."""
    ws = [
        HAWorker(model_dir, cluster, prefix, f"{prefix}-{n}", log_dir, *FLAGS, env=env)
        for n in "ab"
    ]
    try:
        lane = dataclasses.replace(cluster_settings(cluster, prefix), lane="default")
        with redis_client(lane) as r:  # (the workers' lane: their heartbeats are there)
            for w in ws:
                wait_for(lambda: w.ready(r), f"{w.name}'s heartbeat")  # noqa: B023
        yield ws
    finally:
        for w in ws:
            w.close()


@pytest.fixture
def failover_workers(
    redis_cluster: LocalCluster, tiny_llama_dir: Path, tmp_path: Path
) -> Iterator[list[HAWorker]]:
    with running_workers(redis_cluster, tiny_llama_dir, "hafo", tmp_path) as ws:
        yield ws


@pytest.fixture
def crash_workers(
    redis_cluster: LocalCluster, tiny_llama_dir: Path, tmp_path: Path
) -> Iterator[list[HAWorker]]:
    with running_workers(redis_cluster, tiny_llama_dir, "hacrash", tmp_path, WAIT_ENV) as ws:
        yield ws


@pytest.fixture
def migration_workers(
    redis_cluster: LocalCluster, tiny_llama_dir: Path, tmp_path: Path
) -> Iterator[list[HAWorker]]:
    with running_workers(redis_cluster, tiny_llama_dir, "hamig", tmp_path) as ws:
        yield ws


def follow_async(
    settings: Settings, rids: list[str], streams: dict[str, list[Any]], errors: list[BaseException]
) -> None:
    """Follow ``rids`` with an ``AsyncClient`` (the gateway's client) on a loop of its own."""

    async def body() -> None:
        async with AsyncClient.from_url(settings=settings) as client:

            async def one(rid: str) -> None:
                handle = client.handle(rid)
                streams[rid] = [e async for e in handle.stream(timeout=DEADLINE_S)]

            await asyncio.gather(*(one(rid) for rid in rids))

    try:
        asyncio.run(body())
    except BaseException as exc:  # reported by the test
        errors.append(exc)


def run_through(
    cluster: LocalCluster, prefix: str, event: Callable[[int], str], wait_replicas: int = 0
) -> None:
    """Run the load, call ``event(slot)`` once some requests are done and some running, and
    check every request ended once, gap-free, and is durable on the slot's owner after. Half the
    streams are followed by the sync client, half by the asyncio one; ``wait_replicas``: the
    producer's ``redis_wait_replicas``."""
    settings = dataclasses.replace(
        cluster_settings(cluster, prefix), redis_wait_replicas=wait_replicas, redis_wait_ms=200
    )
    lane = dataclasses.replace(settings, lane="default")  # the requests' lane: the event's slot
    keys = Keys.for_settings(lane)
    slot = fleet_slot(keys.root)
    streams: dict[str, list[Any]] = {}
    errors: list[BaseException] = []

    def follow(handle: Any) -> None:
        try:
            streams[handle.request_id] = list(handle.stream(timeout=DEADLINE_S))
        except BaseException as exc:  # reported below with the request id
            errors.append(exc)

    with Client.from_url(settings=settings) as client, redis_client(lane) as r:
        handles = [
            client.submit(f"Cluster load {i}", max_tokens=MAX_TOKENS, ignore_eos=True)
            for i in range(NUM_REQUESTS)
        ]
        half = NUM_REQUESTS // 2
        threads = [threading.Thread(target=follow, args=(h,)) for h in handles[:half]]
        rids = [h.request_id for h in handles[half:]]
        threads.append(
            threading.Thread(target=follow_async, args=(settings, rids, streams, errors))
        )
        for t in threads:
            t.start()

        def records() -> list[RequestRecord | None]:
            return [
                RequestRecord.from_hash(h.request_id, r.hgetall(keys.record(h.request_id)))
                for h in handles
            ]

        def some_done_some_running() -> bool:
            recs = records()
            return any(x and x.status == "done" for x in recs) and any(
                x and x.status == "running" for x in recs
            )

        wait_for(some_done_some_running, "the run to be under way")
        in_flight = sum(1 for x in records() if x is None or x.status != "done")
        assert in_flight, "the run ended before the event: no load to ride out"
        what = event(slot)
        for t in threads:
            t.join(DEADLINE_S)
        assert not errors, errors
        assert len(streams) == NUM_REQUESTS
        statuses = [str(client.status(h.request_id).status.value) for h in handles]
    gap_free = 0
    for rid, events in streams.items():
        idx = [e.index for e in events if isinstance(e, TokenEvent)]
        assert idx == list(range(MAX_TOKENS)), f"{rid}: {idx}"
        ends = [e for e in events if isinstance(e, TerminalEvent)]
        assert len(ends) == 1 and events[-1] is ends[0], rid
        gap_free += 1
    print(
        f"[counts] {what} with {in_flight} requests not done when it began: "
        f"{len(streams)}/{NUM_REQUESTS} requests ended once ({statuses.count('done')} done), "
        f"{gap_free} streams gap-free and duplicate-free, {gap_free * MAX_TOKENS} tokens"
    )
    assert statuses == ["done"] * NUM_REQUESTS
    with redis.Redis(port=cluster.owner_port(slot)) as direct:  # the slot's primary now
        for h in handles:
            rec = RequestRecord.from_hash(h.request_id, direct.hgetall(keys.record(h.request_id)))
            assert rec is not None and rec.status == "done", (h.request_id, rec)
            assert direct.llen(keys.tokens(h.request_id)) == MAX_TOKENS, h.request_id
            seen = "".join(e.text for e in streams[h.request_id] if isinstance(e, TokenEvent))
            assert rec.text == seen, f"{h.request_id}: the record kept other tokens than were sent"


def test_a_cluster_failover_mid_run_loses_no_request_and_no_token(
    redis_cluster: LocalCluster, failover_workers: list[HAWorker]
) -> None:
    def failover(slot: int) -> str:
        old, new = redis_cluster.failover(slot)
        return f"CLUSTER FAILOVER of slot {slot}: {old} -> {new}"

    run_through(redis_cluster, "hafo", failover)
    for w in failover_workers:  # the demoted node ended the doorbell's XREAD: re-armed, not off
        assert "doorbell's XREAD was refused" not in w.output(), w.output()


def test_a_killed_primary_mid_run_loses_no_request_and_no_token(
    redis_cluster: LocalCluster, crash_workers: list[HAWorker]
) -> None:
    def crash(slot: int) -> str:
        old, new = redis_cluster.crash_primary(slot)
        return f"primary of slot {slot} SIGKILLed, replica promoted by the cluster: {old} -> {new}"

    run_through(redis_cluster, "hacrash", crash, wait_replicas=1)


def test_a_slot_migration_mid_run_loses_no_request_and_no_token(
    redis_cluster: LocalCluster, migration_workers: list[HAWorker]
) -> None:
    def migrate(slot: int) -> str:
        src = redis_cluster.owner_port(slot)
        dst = next(p for p in redis_cluster.primaries() if p != src)
        moved = redis_cluster.migrate_slot(slot, dst)
        return f"migration of slot {slot}: {src} -> {dst}, {moved} keys moved"

    run_through(redis_cluster, "hamig", migrate)
