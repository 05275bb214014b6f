"""Item 7 with a real process: an exception inside an engine step, and priorities under load."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis
from thread_worker import ThreadWorker
from worker_helpers import (
    WorkerProc,
    enqueue,
    make_request,
    record,
    subscribe,
    wait_for,
    wait_terminal,
)

from tokenfleet.shared.keys import Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.schema import SamplingParams
from tokenfleet.worker.devtools.local_redis import RedisServer
from tokenfleet.worker.service.step_failure import EXIT_ENGINE_BROKEN, MAX_CONSECUTIVE_STEP_FAILURES

pytestmark = pytest.mark.slow
FAULTY = Path(__file__).with_name("faulty_worker.py")


def test_step_exception_errors_affected_requests_then_exits_when_broken(
    tiny_model_dir: Path, redis_server: RedisServer, rr: redis.Redis, tmp_path: Path
) -> None:
    keys = Keys("tff")
    w = WorkerProc(tiny_model_dir, redis_server.url, "tff", "f-1", tmp_path, script=FAULTY)
    try:
        w.wait_ready(rr)
        log = subscribe(rr, keys, ["innocent", "fault-0", "good", "fault-1", "fault-2", "fault-3"])
        long = SamplingParams(max_tokens=20000, temperature=0.0, ignore_eos=True)
        enqueue(rr, keys, make_request("innocent", sampling=long))
        wait_for(lambda: len(log.tokens("innocent")) >= 2, "innocent's first tokens")
        enqueue(rr, keys, make_request("fault-0"))
        for rid in ("innocent", "fault-0"):  # both were in the failed step
            term = log.wait_terminal(rid)
            assert term.status == "error" and term.code == "engine_error", term
            assert "injected fault" in (term.message or "")
            assert term.num_tokens == rr.llen(keys.tokens(rid))
        # the worker keeps serving
        enqueue(rr, keys, make_request("good", sampling=SamplingParams(max_tokens=3)))
        assert log.wait_terminal("good").status == "done"
        assert w.alive()
        # MAX_CONSECUTIVE_STEP_FAILURES failed steps in a row: exit for the supervisor
        for i in range(1, MAX_CONSECUTIVE_STEP_FAILURES + 1):
            rid = f"fault-{i}"
            enqueue(rr, keys, make_request(rid))
            assert log.wait_terminal(rid).code == "engine_error"
        assert w.wait() == EXIT_ENGINE_BROKEN
        assert not rr.exists(keys.worker("f-1"))
    finally:
        w.close()


def test_critical_requests_behind_50_batch_ones_get_their_first_token_first(
    tiny_model_dir: Path, redis_server: RedisServer, rr: redis.Redis, tmp_path: Path
) -> None:
    keys = Keys("tfp")
    small = SamplingParams(max_tokens=4, temperature=0.0)
    batch = [f"p-batch-{i}" for i in range(50)]
    critical = ["p-crit-0", "p-crit-1"]
    for rid in batch:
        enqueue(rr, keys, make_request(rid, priority=Priority.BATCH, sampling=small))
    for rid in critical:
        enqueue(rr, keys, make_request(rid, priority=Priority.CRITICAL, sampling=small))
    # nothing signals this one: a thread of this process
    w = ThreadWorker(tiny_model_dir, redis_server.url, "tfp", "p-1", "--max-num-seqs", "2")
    try:
        w.wait_ready(rr)
        recs = {rid: wait_terminal(rr, keys, rid) for rid in critical + batch}
        assert all(r.status == "done" for r in recs.values())
        last_critical = max(recs[rid].first_token_at or 0 for rid in critical)
        first_batch = min(recs[rid].first_token_at or time.time() for rid in batch)
        assert last_critical < first_batch
        assert record(rr, keys, "p-crit-0") is not None
    finally:
        w.close()
