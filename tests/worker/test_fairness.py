"""Fair shares between tenants with real workers, a real Redis and the Python client
(docs/fairness.md). Two worker processes with two sequence slots each (four slots in all) run
the tiny model with short generations, so every figure here is a count of admissions or tokens
read from the requests' records and the tenant book, never a duration.

* a flood does not delay a newcomer: the flood's admissions between a light tenant's arrival
  and its last start stay within a bound that does not involve the flood's size;
* equal weights split the tokens served over the contended interval evenly (Jain's index);
* weights 1:3 split them 1:3 (within 10 %);
* a tenant returning from idle gets no burst: it is lifted to the busy tenant's virtual time;
* a lone tenant uses every slot (work-conserving);
* a worker SIGKILLed mid-run loses nothing and counts nothing twice (served tokens and
  admissions equal what the records say, once each), and what KEDA reads (the shared stream's
  lag + the tenant backlog's length) is what really waits all along, the kill and the claims
  included.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest
import redis
from keda_figure import keda_and_waiting
from worker_helpers import WorkerProc, wait_for

from tokenfleet.producer import tenants as tenant_admin
from tokenfleet.producer.client import Client
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.record import as_str
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.devtools.local_redis import RedisServer

pytestmark = pytest.mark.slow
MODEL = "default"
SLOTS_PER_WORKER = 2
WORKERS = 2
SLOTS = SLOTS_PER_WORKER * WORKERS
MAX_TOKENS = 6
PROMPT = "The quick brown fox jumps over the lazy dog."  # one length for every tenant's requests


@dataclass
class Fleet:
    r: redis.Redis
    keys: Keys
    client: Client
    workers: list[WorkerProc]


def _fleet(redis_server: RedisServer, model_dir: Path, log_dir: Path, prefix: str) -> Fleet:
    workers = [
        WorkerProc(
            model_dir,
            redis_server.url,
            prefix,
            f"{prefix}-w{i}",
            log_dir,
            "--max-num-seqs",
            str(SLOTS_PER_WORKER),
        )
        for i in range(WORKERS)
    ]
    r = redis.Redis.from_url(redis_server.url)
    for w in workers:
        w.wait_ready(r)
    settings = Settings(redis_url=redis_server.url, key_prefix=prefix, routing="off")
    return Fleet(r, Keys(prefix), Client.from_url(settings=settings), workers)


@pytest.fixture(scope="module")
def fleet(
    redis_server: RedisServer, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Fleet]:
    f = _fleet(redis_server, tiny_model_dir, tmp_path_factory.mktemp("fair"), "tffair")
    yield f
    f.client.close()
    for w in f.workers:
        w.close()
    f.r.close()


def submit(fleet: Fleet, tenant: str, n: int, tag: str) -> list[str]:
    """``n`` requests of ``tenant`` in one submit_many; returns their ids."""
    specs = [
        {
            "prompt": PROMPT,
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "ignore_eos": True,
            "tenant": tenant,
            "request_id": f"{tag}-{i:04d}",
        }
        for i in range(n)
    ]
    handles = fleet.client.submit_many(specs)
    assert all(not isinstance(h, Exception) for h in handles), handles
    return [str(s["request_id"]) for s in specs]


def records(fleet: Fleet, ids: list[str]) -> list[dict[str, str]]:
    pipe = fleet.r.pipeline(transaction=False)
    for rid in ids:
        pipe.hgetall(fleet.keys.record(rid))
    return [
        {as_str(k) or "": as_str(v) or "" for k, v in raw.items()} | {"id": rid}
        for rid, raw in zip(ids, pipe.execute(), strict=True)
    ]


def wait_done(fleet: Fleet, ids: list[str], timeout_s: float = 240.0) -> list[dict[str, str]]:
    def ended() -> list[dict[str, str]] | None:
        recs = records(fleet, ids)
        return recs if all(r.get("status") == "done" for r in recs) else None

    out: list[dict[str, str]] = wait_for(ended, f"{len(ids)} requests done", timeout_s, 0.1)
    return out


def tokens_of(rec: dict[str, str]) -> int:
    """Prompt + output tokens the worker reported for an ended request."""
    usage = orjson.loads(rec.get("usage") or "{}")
    return int(usage.get("prompt_tokens", 0)) + int(rec.get("num_tokens") or 0)


def served_in(recs: list[dict[str, str]], t0: float, t1: float) -> int:
    """Tokens of the requests in ``recs`` that ended within (t0, t1]."""
    return sum(tokens_of(r) for r in recs if t0 < float(r["finished_at"]) <= t1)


def contended_interval(*groups: list[dict[str, str]]) -> tuple[float, float]:
    """From the moment every group has a request running to the start of the last request of
    the group that ran out first: every group was backlogged in between."""
    t0 = max(min(float(r["started_at"]) for r in g) for g in groups)
    t1 = min(max(float(r["started_at"]) for r in g) for g in groups)
    assert t1 > t0
    return t0, t1


def jain(xs: list[float]) -> float:
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs))


def test_a_flood_does_not_delay_a_newcomer_beyond_a_bound(fleet: Fleet) -> None:
    flood = submit(fleet, "flood", 200, "fl")
    wait_for(
        lambda: sum(r.get("status") != "queued" for r in records(fleet, flood)) >= SLOTS,
        "the flood running",
    )
    arrived = time.time()
    light = submit(fleet, "light", 20, "li")
    light_recs = wait_done(fleet, light)
    last_light = max(float(r["started_at"]) for r in light_recs)
    flood_recs = wait_done(fleet, flood)
    ahead = [r for r in flood_recs if arrived < float(r["started_at"]) < last_light]
    # the two alternate: at most one flood admission per light one, plus the slots, the one
    # entry admitted ahead (the wake-up) and a tie; never the 180-odd the flood still had waiting
    assert len(ahead) <= len(light) + SLOTS + 2, len(ahead)
    first_light = min(float(r["started_at"]) for r in light_recs)
    before_first = [r for r in flood_recs if arrived < float(r["started_at"]) < first_light]
    assert len(before_first) <= SLOTS + 2, len(before_first)


def test_equal_weights_split_served_tokens_evenly(fleet: Fleet) -> None:
    a = submit(fleet, "even-a", 60, "ea")
    b = submit(fleet, "even-b", 60, "eb")
    ra, rb = wait_done(fleet, a), wait_done(fleet, b)
    t0, t1 = contended_interval(ra, rb)
    xs = [float(served_in(ra, t0, t1)), float(served_in(rb, t0, t1))]
    assert min(xs) > 0 and jain(xs) >= 0.95, xs


def test_weights_one_to_three_split_served_tokens_one_to_three(fleet: Fleet) -> None:
    r, keys = fleet.r, fleet.keys
    tenant_admin.set_tenant(r, keys, "w-one", weight=1)
    tenant_admin.set_tenant(r, keys, "w-three", weight=3)
    one = submit(fleet, "w-one", 60, "w1")
    three = submit(fleet, "w-three", 180, "w3")
    r1, r3 = wait_done(fleet, one), wait_done(fleet, three)
    t0, t1 = contended_interval(r1, r3)
    ratio = served_in(r3, t0, t1) / max(1, served_in(r1, t0, t1))
    assert 2.7 <= ratio <= 3.3, ratio


def test_an_idle_tenant_returning_gets_no_burst(fleet: Fleet) -> None:
    busy = submit(fleet, "busy", 120, "bu")
    wait_for(
        lambda: sum(r.get("status") == "done" for r in records(fleet, busy)) >= 40,
        "busy served alone for a while",
    )
    arrived = time.time()
    idle = submit(fleet, "idle", 40, "id")
    ri, rb = wait_done(fleet, idle), wait_done(fleet, busy)
    after = sorted(
        [("idle", float(r["started_at"])) for r in ri]
        + [("busy", float(r["started_at"])) for r in rb if float(r["started_at"]) > arrived],
        key=lambda x: x[1],
    )
    first = [name for name, _ in after[:40]]
    # a tenant with banked credit (virtual time 0 against busy's 40-odd requests) would take
    # all 40 first; lifted to busy's time it shares, up to the entries decided ahead and a tie
    assert first.count("idle") <= 20 + 2, first


def test_a_lone_tenant_uses_every_slot(fleet: Fleet) -> None:
    ids = submit(fleet, "lone", 80, "lo")
    most = 0

    def all_done() -> bool:  # meanwhile: the most the workers' heartbeats say run at once
        nonlocal most
        beats = [fleet.r.hget(fleet.keys.worker(w.name), "running") for w in fleet.workers]
        most = max(most, sum(int(b or 0) for b in beats))
        return all(r.get("status") == "done" for r in records(fleet, ids))

    wait_for(all_done, "the lone tenant's requests done", 240.0, 0.05)
    assert most == SLOTS  # every slot of both workers: nothing held back for absent tenants


def test_a_worker_killed_mid_run_loses_nothing_and_counts_nothing_twice(
    redis_server: RedisServer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    f = _fleet(redis_server, tiny_model_dir, tmp_path, "tfkill")
    try:
        specs: dict[str, list[str]] = {}
        for tenant in ("k-a", "k-b"):
            specs[tenant] = [f"{tenant}-{i:03d}" for i in range(24)]
            handles = f.client.submit_many(
                [
                    {
                        "prompt": PROMPT,
                        "max_tokens": 48,
                        "temperature": 0.0,
                        "ignore_eos": True,
                        "tenant": tenant,
                        "request_id": rid,
                    }
                    for rid in specs[tenant]
                ]
            )
            assert all(not isinstance(h, Exception) for h in handles)
        everyone = specs["k-a"] + specs["k-b"]
        figures: list[tuple[str, int, int]] = []  # (when, KEDA's figure, really waiting)

        def sample(when: str) -> None:
            keda, waiting = keda_and_waiting(f.r, f.keys, MODEL, Priority.NORMAL, everyone)
            figures.append((when, keda, waiting))

        sample("submitted")

        def victim_running() -> bool:
            return any(
                rec.get("status") == "running"
                and rec.get("worker") == f.workers[0].name
                and int(rec.get("num_tokens") or 0) >= 4
                for rec in records(f, everyone)
            )

        wait_for(victim_running, "a request mid-run on the first worker")
        sample("mid-run")
        f.workers[0].signal(signal.SIGKILL)
        f.workers[0].wait()
        sample("killed")

        def ended() -> bool:
            sample("claimed and running")
            return all(r.get("status") == "done" for r in records(f, everyone))

        wait_for(ended, "every request done", 240.0, 0.1)
        recs = wait_done(f, everyone)
        assert [x for x in figures if x[1] != x[2]] == [], figures
        assert figures[0][2] >= 40 and figures[-1][2] == 0
        assert all(int(r["num_tokens"]) == 48 for r in recs)
        assert any(int(r.get("attempts") or 0) >= 2 for r in recs)  # someone was resumed
        book = {
            as_str(k) or "": as_str(v) or ""
            for k, v in f.r.hgetall(f.keys.tenant_book(MODEL)).items()
        }
        for tenant, ids in specs.items():
            mine = [r for r in recs if r["id"] in ids]
            assert int(book[f"admitted|{tenant}"]) == len(ids)  # each admitted once
            assert int(book[f"served|{tenant}"]) == sum(tokens_of(r) for r in mine)
    finally:
        f.client.close()
        for w in f.workers:
            w.close()
        f.r.close()
