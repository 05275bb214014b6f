"""Issue 6's end-to-end test: two real ``tokenfleet worker`` processes in one KV pool.

Worker A (serves batch) is flooded and holds the whole pool; worker B (serves critical) is idle.
Critical requests then go to B: B has no blocks, asks the pool, A is ordered to preempt and
releases, and the critical requests finish while the batch flood is still running; A's batch
requests keep producing tokens and all complete. No timing thresholds: "promptly" means before
the flood ends.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import waiting
from child_process import ChildProcess, tokenfleet_args

from tokenfleet.shared.keys import Keys
from tokenfleet.shared.record import RequestRecord
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.pool.admin import create_pool, pool_snapshot
from tokenfleet.worker.pool.config import PoolConfig

PREFIX = "tfpool"
DEADLINE_S = 240.0  # failure guard only: every wait below polls for a state
wait_for = functools.partial(waiting.wait_for, timeout_s=DEADLINE_S, poll_s=0.05)


class Worker(ChildProcess):
    def __init__(self, model_dir: Path, redis_url: str, name: str, log_dir: Path, *extra: str):
        self.name = name
        env = {"REDIS_URL": redis_url, "TOKENFLEET_KEY_PREFIX": PREFIX}
        args = tokenfleet_args("worker", "--model", str(model_dir))
        args += ["--name", name, "--threads", "1", "--block-size", "4", "--kv-blocks", "64"]
        args += ["--kv-pool", "p", "--max-num-seqs", "8", *extra]
        super().__init__(args, log_dir / f"{name}.log", env)

    def alive(self) -> bool:
        self.check_alive(f"worker {self.name}")
        return True

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.wait(60)
        finally:
            self.close()


@pytest.fixture
def workers(
    tiny_llama_dir: Path, redis_url: str, r: redis.Redis, tmp_path: Path
) -> Iterator[tuple[Worker, Worker]]:
    keys = Keys(PREFIX)
    # cap 1000: A alone may hold everything. chunk 8: A gives spare back only above 20 blocks
    # (plan_blocks' high watermark), so while flooded it keeps all 24 and B's blocks can only
    # come from A (no free blocks).
    config = PoolConfig(
        total_blocks=24, block_size=4, cap_permille=1000, chunk_blocks=8, lease_ms=5000
    )
    create_pool(r, keys, "p", config)
    a = Worker(tiny_llama_dir, redis_url, "wa", tmp_path, "--priorities", "batch")
    b = Worker(tiny_llama_dir, redis_url, "wb", tmp_path, "--priorities", "critical")
    try:
        for w in (a, b):
            wait_for(lambda: w.alive() and r.exists(keys.worker(w.name)), f"{w.name} ready")  # noqa: B023
        yield a, b
    finally:
        for w in (a, b):
            if w.proc.poll() is None:
                w.proc.kill()
                w.proc.wait(10)
            w.log.close()  # (stop() closes it too; a failed test never reached it)


def record(r: redis.Redis, rid: str) -> RequestRecord | None:
    return RequestRecord.from_hash(rid, r.hgetall(Keys(PREFIX).record(rid)))


def num_tokens(r: redis.Redis, rid: str) -> int:
    rec = record(r, rid)
    return 0 if rec is None else rec.num_tokens


def held(r: redis.Redis) -> dict[str, int]:
    return {m["name"]: m["held"] for m in pool_snapshot(r, Keys(PREFIX), "p")["members"]}


def test_worker_settings_take_the_pool_from_flags_or_environment() -> None:
    from tokenfleet.shared.errors import SettingsError
    from tokenfleet.worker.worker_settings import WorkerSettings

    env = {"TOKENFLEET_KV_POOL": "gpu0", "TOKENFLEET_SHARE_WEIGHT": "2.5"}
    ws = WorkerSettings.from_env(env, model="m")
    assert (ws.kv_pool, ws.share_weight) == ("gpu0", 2.5)
    ws = WorkerSettings.from_env(env, model="m", kv_pool="other", share_weight=0.5)
    assert (ws.kv_pool, ws.share_weight) == ("other", 0.5)
    assert WorkerSettings.from_env({}, model="m").kv_pool is None
    with pytest.raises(SettingsError, match="share weight"):
        WorkerSettings.from_env({"TOKENFLEET_SHARE_WEIGHT": "0"}, model="m")
    with pytest.raises(SettingsError):
        WorkerSettings.from_env({"TOKENFLEET_KV_POOL": "a:b"}, model="m")


@pytest.mark.slow
@pytest.mark.parametrize("routed", [False, True], ids=["shared", "routed"])
def test_critical_requests_run_on_blocks_preempted_from_a_flooded_worker(
    workers: tuple[Worker, Worker],
    redis_url: str,
    r: redis.Redis,
    tiny_llama_dir: Path,
    routed: bool,
) -> None:
    """``routed``: every request carries a session, so it goes through a worker's routed
    stream (docs/routing.md), pinned to its session's worker or stolen from it; the pool's
    promise is the same."""
    import torch

    from tokenfleet.producer import Client
    from tokenfleet.worker.engine.engine import Engine
    from tokenfleet.worker.engine.request import SamplingParams

    a, b = workers
    keys = Keys(PREFIX)
    settings = Settings(redis_url=redis_url, key_prefix=PREFIX)
    batch_prompts = {f"batch-{i}": f"Batch job {i}: summarise the queue" for i in range(12)}
    critical_prompts = {f"crit-{i}": f"Urgent {i}: page the operator" for i in range(2)}
    with Client.from_url(redis_url, settings=settings) as client:

        def session(name: str) -> dict[str, Any]:
            return {"metadata": {"session": name}} if routed else {}

        batch = {
            rid: client.submit(
                p,
                request_id=rid,
                priority="batch",
                max_tokens=40,
                temperature=0.0,
                **session("flood"),
            )
            for rid, p in batch_prompts.items()
        }

        # the flood: A holds the whole pool, B (idle) nothing
        wait_for(lambda: held(r) == {"wa": 24, "wb": 0}, "A to hold the whole pool")
        orders_before = int(r.hget(keys.pool("p"), "order_seq") or 0)
        tokens_before = sum(num_tokens(r, rid) for rid in batch)

        critical = {
            rid: client.submit(
                p,
                request_id=rid,
                priority="critical",
                max_tokens=8,
                temperature=0.0,
                **session("page"),
            )
            for rid, p in critical_prompts.items()
        }

        def critical_done() -> bool:
            snap = pool_snapshot(r, keys, "p")
            assert snap["held"] <= snap["total"]
            return all((rec := record(r, rid)) and rec.status.is_terminal for rid in critical)

        wait_for(critical_done, "the critical requests")
        crit_results = {rid: h.result(timeout=DEADLINE_S) for rid, h in critical.items()}

        # promptly: the flood is still running when the critical requests are done
        states = [record(r, rid) for rid in batch]
        assert any(s is not None and not s.status.is_terminal for s in states), "flood ended"
        tokens_after = sum(num_tokens(r, rid) for rid in batch)
        assert tokens_after > tokens_before, "A kept producing batch tokens meanwhile"
        assert int(r.hget(keys.pool("p"), "order_seq") or 0) > orders_before, "no order filed"
        # the order reached A with the same reply as its shrink, so it was executed (heartbeat)
        wait_for(lambda: int(r.hget(keys.worker("wa"), "pool_orders") or 0) >= 1, "A's order")

        batch_results = {rid: h.result(timeout=DEADLINE_S) for rid, h in batch.items()}
    assert a.alive() and b.alive()
    for rid in [*batch, *critical]:  # where each went, and why (the record says)
        rec = record(r, rid)
        assert rec is not None
        if routed:  # its session's worker, or stolen by the one serving its priority
            assert rec.route == "session" and rec.taken in ("", "stolen_by:wa", "stolen_by:wb")
            assert rec.routed_to == ("wa" if rid in batch else "wb"), rec
        else:
            assert rec.route == "shared", rec
    snap = pool_snapshot(r, keys, "p")
    assert snap["held"] <= snap["total"]

    # the outputs are an unlimited engine's (greedy), preemptions notwithstanding
    torch.set_num_threads(1)
    ref = Engine(tiny_llama_dir, device="cpu", block_size=4, num_kv_blocks=64)
    for rid, res in crit_results.items():
        want = ref.generate([critical_prompts[rid]], SamplingParams(temperature=0, max_tokens=8))
        assert res.token_ids == want[0].token_ids, rid
    for rid, res in batch_results.items():
        params = SamplingParams(temperature=0, max_tokens=40)
        want = ref.generate([batch_prompts[rid]], params)
        assert res.token_ids == want[0].token_ids, rid

    # graceful stop: both leave the pool, their blocks go back
    assert a.stop() == 0 and b.stop() == 0
    assert pool_snapshot(r, keys, "p")["members"] == []


@pytest.mark.slow
def test_a_worker_paces_itself_to_its_compute_share(
    tiny_llama_dir: Path, redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    """A real worker in a pool with a token budget far below what it could compute: it waits
    for its share (the heartbeat shows the wait), never computes faster than the budget allows,
    and its results are an unpaced engine's."""
    from tokenfleet.producer import Client

    keys = Keys(PREFIX)
    # 4 tokens a round, 40 tokens/s: the tiny model alone does thousands, and even starved (three
    # pytest workers on two cores) a decode step of its four requests takes well under a round
    budget, round_s = 4, 0.1
    config = PoolConfig(
        total_blocks=64, block_size=4, chunk_blocks=8, token_budget=budget, round_ms=100
    )
    create_pool(r, keys, "p", config)
    worker = Worker(tiny_llama_dir, redis_url, "wc", tmp_path)
    try:
        wait_for(lambda: worker.alive() and r.exists(keys.worker("wc")), "the worker")
        settings = Settings(redis_url=redis_url, key_prefix=PREFIX)
        prompts = {f"paced-{i}": f"{i} paced request for the shared device" for i in range(4)}
        with Client.from_url(redis_url, settings=settings) as client:
            handles = {
                rid: client.submit(p, request_id=rid, max_tokens=60, temperature=0.0)
                for rid, p in prompts.items()
            }
            results = {rid: h.result(timeout=DEADLINE_S) for rid, h in handles.items()}
        records = [record(r, rid) for rid in prompts]
        assert all(rec is not None and rec.status.value == "done" for rec in records)
        started = min(rec.started_at or 0.0 for rec in records if rec)
        finished = max(rec.finished_at or 0.0 for rec in records if rec)
        computed = sum(len(res.token_ids) for res in results.values())  # at least these
        # the bucket: one round's share at start, then the share per round
        assert computed <= budget * ((finished - started) / round_s + 1) + budget
        wait_for(
            lambda: float(r.hget(keys.worker("wc"), "pool_compute_wait_s") or 0) > 0,
            "the heartbeat to show time spent waiting for the share",
        )
        assert int(r.hget(keys.worker("wc"), "pool_token_share") or 0) in (0, budget)
        assert worker.alive()
    finally:
        assert worker.stop() == 0

    import torch

    from tokenfleet.worker.engine.engine import Engine
    from tokenfleet.worker.engine.request import SamplingParams

    torch.set_num_threads(1)
    ref = Engine(tiny_llama_dir, device="cpu", block_size=4, num_kv_blocks=64)
    for rid, res in results.items():
        want = ref.generate([prompts[rid]], SamplingParams(temperature=0, max_tokens=60))
        assert res.token_ids == want[0].token_ids, rid
