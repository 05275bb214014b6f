"""The full path in cluster mode on a real 3-primary Redis Cluster: producer and two real workers
reach the primaries owning the fleet's slots (the ``default`` model's lane ``{hacl|default}``,
the fleet's own ``{hacl}``) from a seed URL naming another node; a second model's lane on
another primary serves beside it (one fleet over several primaries). Submit -> worker ->
stream (sharded pub/sub), cancel, both overflow policies, the KV pool, KEDA's lag figure, the
gateway (`tokenfleet serve` with the cluster flags, driven by the openai SDK: the asyncio
client), and crash recovery (SIGKILL of the worker holding a request; the other resumes it
gap-free). The tests run in file order on one module fleet; the crash test, which kills a
worker, comes last."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import openai
import orjson
import pytest
import redis
from ha_checks import (
    check_cancel,
    check_crash_recovery,
    check_gateway_serves,
    check_overflow_policies,
    gateway_process,
    indices,
    terminal,
)
from ha_helpers import HAWorker, cluster_flags, cluster_settings
from waiting import DEADLINE_S, wait_for

from tokenfleet.producer import Client
from tokenfleet.shared.cluster_connection import fleet_slot
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.record import RequestRecord
from tokenfleet.shared.redis_connect import redis_client
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.cli import main
from tokenfleet.worker.devtools.testing.local_cluster import LocalCluster
from tokenfleet.worker.pool.admin import create_pool, pool_snapshot
from tokenfleet.worker.pool.config import PoolConfig

pytestmark = pytest.mark.slow
PREFIX = "hacl"
SERVED = "critical,normal"  # batch is left unserved: its requests stay queued


class Fleet:
    def __init__(self, setup: LocalCluster, workers: list[HAWorker]) -> None:
        self.setup = setup
        self.workers = workers
        self.settings: Settings = cluster_settings(setup, PREFIX)
        lane = replace(self.settings, lane="default")
        self.r = redis_client(lane)  # to the default lane's primary, like its workers
        self.fleet_r = redis_client(self.settings)  # to the fleet slot's (registry, pool)
        self.keys = Keys.for_settings(lane)
        self.slot = fleet_slot(self.keys.root)
        self.fleet_slot = fleet_slot(self.keys.fleet_root)

    def record(self, rid: str) -> RequestRecord | None:
        return RequestRecord.from_hash(rid, self.r.hgetall(self.keys.record(rid)))


@pytest.fixture(scope="module")
def fleet(
    redis_cluster: LocalCluster, tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Fleet]:
    settings = cluster_settings(redis_cluster, PREFIX)
    with redis_client(settings) as r:
        config = PoolConfig(
            total_blocks=64, block_size=4, cap_permille=1000, chunk_blocks=8, lease_ms=5000
        )
        create_pool(r, Keys.for_settings(settings), "p", config)
    log_dir = tmp_path_factory.mktemp("ha-workers")
    extra = ("--priorities", SERVED, "--kv-pool", "p", "--block-size", "4", "--kv-blocks", "64")
    workers = [
        HAWorker(tiny_llama_dir, redis_cluster, PREFIX, f"cl-{n}", log_dir, *extra)
        for n in ("a", "b")
    ]
    fleet = Fleet(redis_cluster, workers)
    try:
        for w in workers:
            wait_for(lambda: w.ready(fleet.r), f"{w.name}'s heartbeat")  # noqa: B023
        yield fleet
    finally:
        for w in workers:
            w.close()
        fleet.r.close()
        fleet.fleet_r.close()


def test_submit_stream_and_status_on_the_cluster(fleet: Fleet) -> None:
    owner = fleet.setup.owner_port(fleet.slot)
    assert f":{owner}/" not in fleet.settings.redis_url  # the seed is another node
    with Client.from_url(settings=fleet.settings) as client:
        handle = client.submit("Hello cluster", max_tokens=12, ignore_eos=True)
        events = list(handle.stream(timeout=DEADLINE_S))
        assert indices(events) == list(range(12))
        assert terminal(events) == "done" and len(events) == 13
        rec = client.status(handle.request_id)
        assert rec.status == "done" and rec.num_tokens == 12
    # the request's names are in its model's lane, the registry in the fleet's slot; each on
    # the primary owning that slot, and nothing of the fleet in any other slot
    record = fleet.keys.record(handle.request_id)
    assert record.startswith("{hacl|default}:") and fleet_slot(record) == fleet.slot
    slots = {fleet.slot, fleet.fleet_slot}
    counts = {}
    for port in fleet.setup.primaries():
        with redis.Redis(port=port) as direct:
            assert direct.info("replication")["role"] == "master"
            ours = [  # (not "{hacl*": other tests' prefixes start so too)
                k.decode()
                for pattern in ("{hacl}*", "{hacl|*")
                for k in direct.scan_iter(match=pattern, count=1000)
            ]
            mine = {s for s in slots if fleet.setup.owner_port(s) == port}
            assert {fleet_slot(k) for k in ours} <= mine, f"a fleet key in another slot on {port}"
            counts[port] = len(ours)
    with redis.Redis(port=owner) as direct:
        assert direct.exists(record, fleet.keys.tokens(handle.request_id)) == 2
    with redis.Redis(port=fleet.setup.owner_port(fleet.fleet_slot)) as direct:
        assert direct.sismember(fleet.keys.fleet.lanes, "default")
        assert direct.zscore(fleet.keys.fleet.served, "default")
    print(
        f"[counts] lane slot {fleet.slot}, fleet slot {fleet.fleet_slot}; keys by primary {counts}"
    )


def test_tenants_are_admitted_fairly_in_the_model_s_lane(fleet: Fleet) -> None:
    """Fair admission on the cluster (docs/fairness.md): two tenants' requests wait in tenant
    queues and are admitted by the workers' pulls; every tenant key (queues, active set, book),
    including those the scripts build from templates, is in the model's lane."""
    with Client.from_url(settings=fleet.settings) as client:
        specs = [
            {"prompt": f"tenant {t} {i}", "max_tokens": 3, "ignore_eos": True, "tenant": t}
            for i in range(6)
            for t in ("acme", "globex")
        ]
        handles = client.submit_many(specs)
        ids = [h.request_id for h in handles if not isinstance(h, Exception)]
        assert len(ids) == len(specs)

        def all_done() -> bool:
            records = [fleet.record(rid) for rid in ids]
            return all(rec is not None and rec.status == "done" for rec in records)

        wait_for(all_done, "both tenants' requests done")
        rows = {t["tenant"]: t for t in client.tenant_stats()}
    assert rows["acme"]["admitted"] == 6 and rows["globex"]["admitted"] == 6
    assert rows["acme"]["served_tokens"] > 0 and rows["acme"]["waiting"] == 0
    keys = fleet.keys
    for name in (
        keys.tenant_book("default"),
        keys.tenants_active("default", Priority.NORMAL),
        keys.tenant_queue("default", Priority.NORMAL, "acme"),
    ):
        assert name.startswith("{hacl|default}:") and fleet_slot(name) == fleet.slot


def test_cancel_on_the_cluster(fleet: Fleet) -> None:
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
        assert main(["status", "--json", *cluster_flags(fleet.setup, PREFIX)]) == 0
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


def test_kv_pool_members_on_the_cluster(fleet: Fleet) -> None:
    with Client.from_url(settings=fleet.settings) as client:
        handles = [client.submit(f"pool {i}", max_tokens=8, ignore_eos=True) for i in range(4)]
        for h in handles:
            assert len(h.result(timeout=DEADLINE_S).token_ids) == 8
    snap = pool_snapshot(fleet.fleet_r, fleet.keys.fleet, "p")  # (pools: the fleet's slot)
    members = {m["name"] for m in snap["members"]}
    assert members == {w.name for w in fleet.workers}
    assert sum(m["held"] for m in snap["members"]) == snap["held"] <= snap["total"]


def _model_on_another_primary(fleet: Fleet) -> str:
    """A model name whose lane's slot is owned by another primary than the default lane's."""
    taken = fleet.setup.owner_port(fleet.slot)
    for n in range(100):
        name = f"second-{n}"
        if fleet.setup.owner_port(fleet_slot(fleet.keys.for_model(name).root)) != taken:
            return name
    raise AssertionError("no model name with a lane on another primary in 100 tries")


def test_two_models_of_one_fleet_run_on_two_primaries(
    fleet: Fleet,
    tiny_llama_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    second = _model_on_another_primary(fleet)
    lane = fleet.keys.for_model(second)
    worker = HAWorker(tiny_llama_dir, fleet.setup, PREFIX, "cl-2nd", tmp_path, model=second)
    try:
        with redis_client(replace(fleet.settings, lane=second)) as r2:
            wait_for(lambda: worker.ready(r2), "the second model's worker")
            with Client.from_url(settings=fleet.settings) as client:
                handles = {
                    m: [client.submit(f"{m} {i}", model=m, max_tokens=6) for i in range(3)]
                    for m in ("default", second)
                }
                for hs in handles.values():
                    for h in hs:
                        assert len(h.result(timeout=DEADLINE_S).token_ids) > 0
                served = {m.name: m for m in client.models()}
                assert served["default"].served and served[second].served
                assert served[second].workers == ("cl-2nd",)
                # a lookup by id alone finds each request in its model's lane
                again = Client.from_url(settings=fleet.settings)
                with again:
                    for m, hs in handles.items():
                        assert {again.status(h.request_id).model for h in hs} == {m}
                ran_on = {m: {client.status(h.request_id).ran_on for h in hs}
                          for m, hs in handles.items()}  # fmt: skip
            assert ran_on[second] == {"cl-2nd"} and "cl-2nd" not in ran_on["default"]
            rid = handles[second][0].request_id
            assert r2.exists(lane.record(rid))
        owners = {
            m: fleet.setup.owner_port(fleet_slot(fleet.keys.for_model(m).root))
            for m in ("default", second)
        }
        assert owners["default"] != owners[second]
        with redis.Redis(port=owners[second]) as direct:  # the record is on its lane's primary
            assert direct.exists(lane.record(rid))
        monkeypatch.setenv("TOKENFLEET_KEY_PREFIX", PREFIX)
        assert main(["status", "--json", *cluster_flags(fleet.setup, PREFIX)]) == 0
        snap = orjson.loads(capsys.readouterr().out)
        assert {w["name"] for w in snap["workers"]} >= {"cl-a", "cl-b", "cl-2nd"}
        # through a real gateway (uvicorn) and the openai SDK: both models, and a request of
        # the second read by id alone (its lane found by a gateway that never saw it)
        with gateway_process(PREFIX, cluster_flags(fleet.setup, PREFIX), tmp_path) as url:
            sdk = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            assert {"default", second} <= {m.id for m in sdk.models.list()}
            for m in ("default", second):
                out = sdk.completions.create(
                    model=m, prompt=f"gateway {m}", max_tokens=5, extra_body={"ignore_eos": True}
                )
                assert out.choices[0].finish_reason == "length" and out.model == m
            got = httpx.get(f"{url}/v1/requests/{rid}", timeout=30).json()
            assert (got["status"], got["model"]) == ("done", second), got
            with httpx.stream("GET", f"{url}/v1/requests/{rid}/events", timeout=30) as resp:
                lines = [x for x in resp.iter_lines() if x]
            assert sum(x.startswith("id: ") for x in lines) == 6 and lines[-1] == "data: [DONE]"
        print(f"[counts] one fleet, two models on primaries {owners}: 3 requests each, done")
    finally:
        worker.close()


def test_the_gateway_serves_on_the_cluster(
    fleet: Fleet, tmp_path: Path, tiny_llama_dir: Path
) -> None:
    flags = cluster_flags(fleet.setup, PREFIX)
    check_gateway_serves(fleet, PREFIX, flags, tmp_path, tiny_llama_dir)


def test_a_killed_worker_s_request_resumes_on_the_other_gap_free(fleet: Fleet) -> None:
    check_crash_recovery(fleet)
