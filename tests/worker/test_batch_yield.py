"""Batch work yields to interactive work in a real worker: the doorbell (against a real Redis),
reserved sequence slots, and steps cut short, with every request still ending once and whole."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from worker_helpers import WorkerProc, record, token_events, wait_for, wait_terminal

from tokenfleet.producer import Client
from tokenfleet.shared.keys import CONSUMER_GROUP, Keys
from tokenfleet.shared.schema import RequestStatus
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.devtools.local_redis import RedisServer, free_port
from tokenfleet.worker.intake import doorbell as doorbell_module
from tokenfleet.worker.intake.doorbell import Doorbell

PREFIX = "tfy"
KEYS = Keys(PREFIX)


# -- the doorbell against a real Redis ------------------------------------------------------------


def _barrier(rr: redis.Redis) -> None:
    """A round trip after a write: Redis has served every client its write unblocked."""
    rr.ping()


def test_the_doorbell_rings_once_per_arm_for_watched_streams_and_consumes_nothing(
    rr: redis.Redis,
) -> None:
    watched, other = "tfy-bell:q:m:normal", "tfy-bell:q:m:batch"
    rr.xgroup_create(watched, CONSUMER_GROUP, id="0", mkstream=True)
    bell = Doorbell(rr, [watched, "tfy-bell:q:m:critical"])
    try:
        assert not bell.rang()  # not armed
        bell.arm()
        rr.xadd(other, {"x": "1"})
        _barrier(rr)
        assert not bell.rang()  # another stream
        rr.xadd(watched, {"x": "2"})
        assert wait_for(bell.rang, "the doorbell to ring", 10)
        assert not bell.rang() and bell.rings == 1  # once, until armed again
        rr.xadd(watched, {"x": "3"})
        _barrier(rr)
        assert not bell.rang()  # disarmed: an arrival now is the pulls' business
        bell.arm()
        rr.xadd(watched, {"x": "4"})
        assert wait_for(bell.rang, "the second ring", 10)
        # nothing was read for any consumer: the group still gets all three entries
        got: Any = rr.xreadgroup(CONSUMER_GROUP, "w", {watched: ">"})
        assert [f[b"x"] for _, f in got[0][1]] == [b"2", b"3", b"4"]
    finally:
        bell.close()


def test_a_lost_doorbell_connection_disarms_quietly_and_arms_again(
    rr: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(doorbell_module, "RETRY_S", 0.0)
    stream = "tfy-bell2:q:m:normal"
    bell = Doorbell(rr, [stream])
    try:
        bell.arm()

        def blocked_xread() -> list[str]:
            return [c["id"] for c in rr.client_list() if c.get("cmd") == "xread"]

        (client_id,) = wait_for(blocked_xread, "the doorbell's XREAD to block", 10)
        rr.client_kill_filter(_id=client_id)
        assert bell.armed
        assert wait_for(lambda: not bell.rang() and not bell.armed, "the loss to be seen", 10)
        assert bell.rings == 0  # a lost connection is no ring
        bell.arm()
        rr.xadd(stream, {"x": "1"})
        assert wait_for(bell.rang, "a ring on the new connection", 10)
    finally:
        bell.close()


# -- a real worker ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def metrics_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def worker(
    tiny_model_dir: Path,
    redis_server: RedisServer,
    rr: redis.Redis,
    tmp_path_factory: pytest.TempPathFactory,
    metrics_port: int,
) -> Iterator[WorkerProc]:
    w = WorkerProc(
        tiny_model_dir,
        redis_server.url,
        PREFIX,
        "yield-1",
        tmp_path_factory.mktemp("logs"),
        "--max-num-seqs",
        "3",
        "--urgent-slots",
        "1",
        "--metrics-port",
        str(metrics_port),
    )
    try:
        w.wait_ready(rr)
        yield w
        w.signal(15)
        assert w.wait() == 0, w.output()
    finally:
        w.close()


def _statuses(rr: redis.Redis, rids: list[str]) -> list[RequestStatus]:
    out = []
    for rid in rids:
        rec = record(rr, KEYS, rid)
        assert rec is not None, rid
        out.append(rec.status)
    return out


def _metrics(port: int, *series: str) -> list[float]:
    """From one scrape of /metrics: the value of the first line of each of ``series`` (a name
    and its label brace), 0.0 where there is none."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as f:
        lines = f.read().decode().splitlines()
    return [
        next((float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name)), 0.0)
        for name in series
    ]


def _counter(port: int, name: str) -> float:
    return _metrics(port, name + "_total{")[0]


def _batch_in_every_slot(port: int) -> bool:
    """The last step ran three requests and left none waiting in the engine: the batch requests
    alone, a preempted one back in its slot. (Right after an interactive request ends, a scrape
    can still show the step before: three running with it, the preempted one waiting.)"""
    running, waiting = _metrics(
        port, "tokenfleet:num_requests_running{", "tokenfleet:num_requests_waiting{"
    )
    return running == 3 and waiting == 0


@pytest.mark.slow
def test_interactive_work_takes_slots_from_batch_work_and_cuts_its_steps(
    worker: WorkerProc, rr: redis.Redis, metrics_port: int
) -> None:
    client = Client(rr, settings=Settings(key_prefix=PREFIX))
    long_batch = {"max_tokens": 3000, "ignore_eos": True, "temperature": 0, "priority": "batch"}
    batch = client.submit_many(
        [{"prompt": f"Batch line {i}", "request_id": f"yb-{i}", **long_batch} for i in range(4)]
    )
    rids = [f"yb-{i}" for i in range(4)]
    running = RequestStatus.RUNNING
    wait_for(lambda: _statuses(rr, rids).count(running) == 3, "three batch requests running")
    assert _statuses(rr, rids).count(RequestStatus.QUEUED) == 1  # batch filled every slot
    preempted = _counter(metrics_port, "tokenfleet:num_preemptions")

    for i in range(10):  # interactive requests, one after the other, while the batch runs
        # the preempted batch request has its slot back first (else the next one finds it free)
        wait_for(lambda: _batch_in_every_slot(metrics_port), "the batch in every slot again")
        rid = f"yn-{i}"
        client.submit(f"Question {i}?", request_id=rid, max_tokens=3, temperature=0)
        rec = wait_terminal(rr, KEYS, rid, timeout_s=60)
        assert rec.status is RequestStatus.DONE and rec.num_tokens == 3
        statuses = _statuses(rr, rids)  # it did not wait for a batch request to end
        assert statuses.count(running) == 3 and RequestStatus.DONE not in statuses, statuses
    # each took a slot from a running batch request (which went on from its cached prefix)
    assert _counter(metrics_port, "tokenfleet:num_preemptions") - preempted >= 10
    # ten arrivals, (nearly) all during batch-only steps
    assert _counter(metrics_port, "tokenfleet:batch_steps_cut") >= 1

    for rid in rids:  # the batch: cut steps and sat-out steps lost and repeated no token
        client.cancel(rid)
    for rid, handle in zip(rids, batch, strict=True):
        assert not isinstance(handle, Exception)
        rec = wait_terminal(rr, KEYS, rid, timeout_s=60)
        tokens = token_events(rr, KEYS, rid)
        assert [e.index for e in tokens] == list(range(len(tokens))), rid
        assert rec.num_tokens == len(tokens)
        assert rec.status in (RequestStatus.CANCELLED, RequestStatus.DONE)
