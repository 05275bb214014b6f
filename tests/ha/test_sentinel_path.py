"""The full path in sentinel mode: producer and two real workers reach the primary only through
the sentinels (their URLs name a port where nothing listens). Submit -> worker -> stream, cancel,
both overflow policies, the KV pool, KEDA's lag figure, the gateway (`tokenfleet serve` with the
sentinel flags, driven by the openai SDK), and crash recovery (SIGKILL of the worker
holding a request; the other resumes it gap-free). The tests run in file order on one module
fleet; the crash test, which kills a worker, comes last."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
import redis
from ha_checks import (
    check_cancel,
    check_crash_recovery,
    check_gateway_serves,
    check_overflow_policies,
    indices,
    terminal,
)
from ha_helpers import HAWorker, ha_settings, sentinel_flags
from waiting import DEADLINE_S, wait_for

from tokenfleet.producer import Client
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.record import RequestRecord
from tokenfleet.shared.redis_connect import redis_client
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.cli import main
from tokenfleet.worker.devtools.testing.local_sentinel import LocalSentinel
from tokenfleet.worker.pool.admin import create_pool, pool_snapshot
from tokenfleet.worker.pool.config import PoolConfig

pytestmark = pytest.mark.slow
PREFIX = "hapath"
SERVED = "critical,normal"  # batch is left unserved: its requests stay queued


class Fleet:
    def __init__(self, setup: LocalSentinel, workers: list[HAWorker]) -> None:
        self.setup = setup
        self.workers = workers
        self.settings: Settings = ha_settings(setup, PREFIX)
        self.r = redis_client(self.settings)  # through the sentinels, like every process
        self.keys = Keys(PREFIX)

    def record(self, rid: str) -> RequestRecord | None:
        return RequestRecord.from_hash(rid, self.r.hgetall(self.keys.record(rid)))


@pytest.fixture(scope="module")
def fleet(
    sentinel_setup: LocalSentinel, tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Fleet]:
    settings = ha_settings(sentinel_setup, PREFIX)
    with redis_client(settings) as r:
        config = PoolConfig(
            total_blocks=64, block_size=4, cap_permille=1000, chunk_blocks=8, lease_ms=5000
        )
        create_pool(r, Keys(PREFIX), "p", config)
    log_dir = tmp_path_factory.mktemp("ha-workers")
    extra = ("--priorities", SERVED, "--kv-pool", "p", "--block-size", "4", "--kv-blocks", "64")
    workers = [
        HAWorker(tiny_llama_dir, sentinel_setup, PREFIX, f"ha-{n}", log_dir, *extra)
        for n in ("a", "b")
    ]
    fleet = Fleet(sentinel_setup, workers)
    try:
        for w in workers:
            wait_for(lambda: w.ready(fleet.r), f"{w.name}'s heartbeat")  # noqa: B023
        yield fleet
    finally:
        for w in workers:
            w.close()
        fleet.r.close()


def test_submit_stream_and_status_through_the_sentinels(fleet: Fleet) -> None:
    with Client.from_url(settings=fleet.settings) as client:
        handle = client.submit("Hello sentinel", max_tokens=12, ignore_eos=True)
        events = list(handle.stream(timeout=DEADLINE_S))
        assert indices(events) == list(range(12))
        assert terminal(events) == "done" and len(events) == 13
        rec = client.status(handle.request_id)
        assert rec.status == "done" and rec.num_tokens == 12
    # every connection of the fleet is on the primary the sentinels name
    with redis.Redis.from_url(fleet.setup.url(fleet.setup.primary_port())) as direct:
        assert direct.info("replication")["role"] == "master"
        assert direct.exists(fleet.keys.record(handle.request_id))


def test_cancel_through_the_sentinels(fleet: Fleet) -> None:
    check_cancel(fleet)


def test_overflow_policies_on_an_unserved_queue(fleet: Fleet) -> None:
    check_overflow_policies(fleet)


def test_status_json_reports_the_lag_keda_reads(
    fleet: Fleet, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with Client.from_url(settings=fleet.settings) as client:
        client.set_queue_config("batch", max_waiting=100, policy="drop_newest")
        rids = [client.submit("lag", priority="batch", max_tokens=4).request_id for _ in range(5)]
        monkeypatch.setenv("TOKENFLEET_KEY_PREFIX", PREFIX)
        assert main(["status", "--json", *sentinel_flags(fleet.setup)]) == 0
        snap = orjson.loads(capsys.readouterr().out)
        batch = next(q for q in snap["queues"] if q["priority"] == "batch")
        stream = fleet.keys.stream("default", Priority.BATCH)
        group = next(
            g for g in fleet.r.xinfo_groups(stream) if g["name"] in (b"workers", "workers")
        )
        print(f"[counts] batch queue: waiting={batch['waiting']} lag={batch['lag']} "
              f"pending={batch['pending']} XINFO lag={group['lag']}")  # fmt: skip
        assert (batch["stream"], batch["consumer_group"]) == (stream, "workers")
        assert batch["lag"] == group["lag"] == batch["waiting"] == len(rids)
        assert batch["pending"] == 0
        for rid in rids:
            client.cancel(rid)


def test_kv_pool_members_through_the_sentinels(fleet: Fleet) -> None:
    with Client.from_url(settings=fleet.settings) as client:
        handles = [client.submit(f"pool {i}", max_tokens=8, ignore_eos=True) for i in range(4)]
        for h in handles:
            assert len(h.result(timeout=DEADLINE_S).token_ids) == 8
    snap = pool_snapshot(fleet.r, fleet.keys, "p")
    members = {m["name"] for m in snap["members"]}
    assert members == {w.name for w in fleet.workers}
    assert sum(m["held"] for m in snap["members"]) == snap["held"] <= snap["total"]


def test_the_gateway_serves_through_the_sentinels(
    fleet: Fleet, tmp_path: Path, tiny_llama_dir: Path
) -> None:
    check_gateway_serves(fleet, PREFIX, sentinel_flags(fleet.setup), tmp_path, tiny_llama_dir)


def test_a_killed_worker_s_request_resumes_on_the_other_gap_free(fleet: Fleet) -> None:
    check_crash_recovery(fleet)
