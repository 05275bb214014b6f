"""PoolLink against the real server: two real (tiny) engines in one process sharing one pool.

Engine A, flooded with batch requests, holds the whole pool; engine B then gets critical requests.
B files an ask, A is ordered to preempt, A's blocks reach B within a few steps, and both keep
producing tokens. Every round checks the pool's invariant (held ≤ total) and the link's (an
engine never uses more blocks than the pool credits its member).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
from fake_port import FakePort, FakeTime

from tokenfleet.shared.errors import PoolError
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.worker.engine.engine import Engine, EngineConfig
from tokenfleet.worker.engine.request import SamplingParams
from tokenfleet.worker.pipelined import ScriptPipeline
from tokenfleet.worker.pool.admin import advance_manual_clock, create_pool, pool_snapshot
from tokenfleet.worker.pool.config import PoolConfig
from tokenfleet.worker.pool.link import PoolLink, PoolPortLike
from tokenfleet.worker.pool.member import KVPoolMember

TOTAL = 24  # pool blocks of 4 tokens
BATCH = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
CRITICAL = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(tiny_llama_dir: Path) -> tuple[Engine, Engine]:
    torch.set_num_threads(1)
    config = EngineConfig(
        block_size=4, num_kv_blocks=40, max_num_seqs=8, device="cpu", max_wait_s=None, seed=0
    )
    return Engine(tiny_llama_dir, config), Engine(tiny_llama_dir, config)


def fresh(engine: Engine) -> Engine:
    """Empty queues and cache over the same loaded runner."""
    return Engine.from_runner(engine.runner, engine.tokenizer, engine.config)


@dataclass
class Worker:
    name: str
    engine: Engine
    link: PoolLink
    tokens: dict[str, list[int]] = field(default_factory=dict)
    finished: set[str] = field(default_factory=set)

    def round(self, client: redis.Redis) -> int:
        """One service iteration: before_step, step, the pool call in a one-round-trip
        pipeline, after_execute. Returns the tokens produced."""
        self.link.before_step()
        num = 0
        for out in self.engine.step():
            self.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            num += len(out.new_token_ids)
            if out.finished:
                self.finished.add(out.request_id)
        call = self.link.plan()
        pipe = ScriptPipeline(client)
        pipe.command("PING")  # stands for the step's token events
        call.queue(pipe)
        replies = pipe.execute()
        self.link.after_execute(replies[-1])
        return num


def make_worker(r: redis.Redis, keys: Keys, name: str, engine: Engine) -> Worker:
    member = KVPoolMember(client=r, keys=keys, pool="p", member=name)
    port: PoolPortLike = engine.pool_port()  # the real engine's port has the surface the link needs
    link = PoolLink(port, member)
    link.join(block_size=engine.block_manager.block_size)
    return Worker(name, engine, link)


def check_invariants(r: redis.Redis, keys: Keys, *workers: Worker) -> dict[str, int]:
    view = pool_snapshot(r, keys, "p")
    held = {m["name"]: m["held"] for m in view["members"]}
    assert sum(held.values()) <= view["total"]
    for w in workers:
        assert w.link.port.num_used_blocks <= held.get(w.name, 0), (w.name, held)
        assert w.link.limit <= held.get(w.name, 0)
    return held


def prompt(engine: Engine, i: int) -> list[int]:
    return list(engine.tokenizer.encode(f"request {i}: the fleet keeps its blocks"))


@pytest.mark.slow
def test_critical_requests_get_blocks_from_a_flooded_member(
    r: redis.Redis, keys: Keys, engines: tuple[Engine, Engine]
) -> None:
    create_pool(
        r,
        keys,
        "p",
        PoolConfig(
            total_blocks=TOTAL,
            block_size=4,
            cap_permille=1000,  # A may hold everything: B's blocks must come from preemption
            chunk_blocks=2,
            lease_ms=60_000,
            preempt_ms=60_000,
            clock="manual",
        ),
    )
    a = make_worker(r, keys, "a", fresh(engines[0]))
    b = make_worker(r, keys, "b", fresh(engines[1]))
    batch = {f"b{i}": prompt(a.engine, i) for i in range(8)}
    for rid, p in batch.items():
        a.engine.add_request(rid, p, BATCH, priority=Priority.BATCH)

    # the flood: A grows to (nearly) the whole pool; idle B keeps its lease and holds nothing
    for _ in range(40):
        a.round(r)
        b.link.idle_tick()
        held = check_invariants(r, keys, a, b)
        if held["a"] >= TOTAL - 2:
            break
    assert held["a"] >= TOTAL - 2 and held["b"] == 0
    assert a.link.port.has_work and not a.finished

    critical = {f"c{i}": prompt(b.engine, 100 + i) for i in range(2)}
    for rid, p in critical.items():
        b.engine.add_request(rid, p, CRITICAL, priority=Priority.CRITICAL)
    first_ask = first_token = done = None
    a_tokens_while_critical = 0
    a_preemptions = transferred = 0
    for rnd in range(300):
        num_b = b.round(r)
        assert b.link.last is not None
        transferred += b.link.last.transferred
        if first_ask is None and b.link.counters["asks"]:
            first_ask = rnd
        if first_token is None and num_b:
            first_token = rnd
        num_a = a.round(r)
        a_preemptions += a.engine.last_step_stats.num_preemptions
        if first_token is not None and done is None:
            a_tokens_while_critical += num_a
        check_invariants(r, keys, a, b)
        if done is None and set(critical) <= b.finished:
            done = rnd
            assert a.link.port.has_work, "the batch flood should still be running"
        if not a.link.port.has_work and not b.link.port.has_work:
            break
        if not b.link.port.has_work:
            b.link.idle_tick()

    assert first_ask == 0, "B, holding nothing, asks at its first step"
    assert a.link.counters["orders"] >= 1, "A received and executed a preemption order"
    assert a_preemptions > 0, "A preempted batch work (recompute) to give blocks back"
    assert transferred > 0, "A's released blocks were credited to B"
    # order filed at round 0 (B's call); A's reply in round 0 carries it; A preempts before its
    # round-1 step and releases in that round's call, credited to B; B's round-2 reply shows the
    # transfer, so B admits at its round-3 step at the latest. One round of slack.
    assert first_token is not None and first_token <= 4
    assert done is not None
    assert a_tokens_while_critical > 0, "A kept producing tokens while B ran critical work"
    assert set(batch) <= a.finished and set(critical) <= b.finished

    # outputs are those of an unlimited engine (greedy), preemptions notwithstanding
    a.link.leave()
    b.link.leave()
    ref = fresh(engines[0])
    for rid, p in [*batch.items(), *critical.items()]:
        params = BATCH if rid in batch else CRITICAL
        want = ref.generate([p], params)[0].token_ids
        got = a.tokens[rid] if rid in batch else b.tokens[rid]
        assert got == want, rid
    assert pool_snapshot(r, keys, "p")["held"] == 0


def fake_link(r: redis.Redis, keys: Keys, name: str, **kwargs: Any) -> tuple[PoolLink, FakePort]:
    engine = FakePort()
    link = PoolLink(engine, KVPoolMember(client=r, keys=keys, pool="p", member=name), **kwargs)
    link.join()
    return link, engine


def test_join_checks_block_size_and_starts_at_limit_zero(r: redis.Redis, keys: Keys) -> None:
    create_pool(r, keys, "p", PoolConfig(total_blocks=40, block_size=16, chunk_blocks=4))
    engine = FakePort()
    link = PoolLink(engine, KVPoolMember(client=r, keys=keys, pool="p", member="a"))
    with pytest.raises(PoolError, match="blocks of 16 tokens; this engine's are 8"):
        link.join(block_size=8)
    link.join(block_size=16)
    assert engine.limit == 0 and link.chunk == 4 and link.lease_s == 5.0
    with pytest.raises(RuntimeError, match="in flight"):
        link.plan()
        link.plan()


def test_asks_ahead_in_chunks_gives_back_when_idle_and_ticks_the_lease(
    r: redis.Redis, keys: Keys
) -> None:
    create_pool(r, keys, "p", PoolConfig(total_blocks=40, chunk_blocks=4, clock="manual"))
    clock = FakeTime()
    link, engine = fake_link(r, keys, "a", clock=clock)
    engine.has_work, engine.num_blocks_wanted = True, 5
    g = link.step_now()
    # spare 0 - 5 needed < low watermark 2: ask 7 rounded up to chunks of 4
    assert g.granted == 8 and link.held == 8 and engine.limit == 8
    engine.num_used_blocks, engine.num_blocks_wanted = 5, 0
    link.step_now()  # spare 3 within [2, 10]: nothing
    assert link.held == 8 and link.last is not None and link.last.granted == 0
    # work ends: the idle member gives everything back at once
    engine.has_work, engine.num_used_blocks = False, 0
    g = link.step_now()
    assert g.released == 8 and g.held == 0 and engine.limit == 0
    # idle ticks: one per third of the lease (5 s), none in between
    assert link.idle_tick() == pytest.approx(5 / 3)
    calls = link.counters["calls"]
    clock.now += 1.0
    assert link.idle_tick() == pytest.approx(5 / 3 - 1.0)
    assert link.counters["calls"] == calls
    clock.now += 1.0
    assert link.idle_tick() == pytest.approx(5 / 3)
    assert link.counters["calls"] == calls + 1
    assert link.status["held"] == 0 and link.status["calls"] == calls + 1


def test_a_shrinking_share_is_given_back_only_once_unused(r: redis.Redis, keys: Keys) -> None:
    create_pool(
        r, keys, "p", PoolConfig(total_blocks=20, chunk_blocks=2, cap_permille=1000, clock="manual")
    )
    a, ea = fake_link(r, keys, "a")
    ea.has_work, ea.num_blocks_wanted = True, 20
    a.step_now()
    ea.num_used_blocks, ea.num_blocks_wanted = 20, 4
    a.step_now()
    assert a.held == 20
    b, eb = fake_link(r, keys, "b")
    eb.has_work, eb.num_blocks_wanted = True, 6
    assert b.step_now().granted == 0  # nothing free; B's unmet want presses on A
    g = a.step_now()
    assert g.release_to < g.held and eb.limit == 0
    assert ea.limit == g.release_to  # the engine shrinks (by preemption) at its next step
    owed = a.owed
    a.step_now()  # the engine has not shrunk yet: nothing can go back
    assert a.owed == owed and a.held == 20
    ea.num_used_blocks = ea.limit  # it preempted
    g = a.step_now()
    assert g.released == owed  # (the reply may ask for more: B still wants)
    assert b.step_now().held >= 6


def test_a_lapsed_lease_rejoins_from_zero(r: redis.Redis, keys: Keys) -> None:
    create_pool(r, keys, "p", PoolConfig(total_blocks=20, chunk_blocks=2, clock="manual"))
    a, ea = fake_link(r, keys, "a")
    ea.has_work, ea.num_blocks_wanted = True, 6
    a.step_now()
    assert a.held == 8
    advance_manual_clock(r, keys, "p", 10_000)  # past the 5 s lease
    ea.num_used_blocks = 6
    g = a.step_now()
    assert g.rejoined and a.counters["rejoins"] == 1
    assert a.held == g.held and ea.limit == a.limit <= g.held


def test_an_order_counts_owed_blocks_and_its_release_goes_to_the_requester(
    r: redis.Redis, keys: Keys
) -> None:
    create_pool(
        r, keys, "p", PoolConfig(total_blocks=20, chunk_blocks=2, cap_permille=1000, clock="manual")
    )
    a, ea = fake_link(r, keys, "a")
    ea.has_work, ea.num_blocks_wanted = True, 20
    a.step_now()
    ea.num_used_blocks, ea.num_blocks_wanted = 20, 0
    a.step_now()
    assert a.held == 20 and a.owed == 0
    b, eb = fake_link(r, keys, "b")
    eb.has_work, eb.num_blocks_wanted = True, 3
    eb.shortfall = (Priority.BATCH, 3)  # nothing is less urgent than batch: no ask
    g = b.step_now()
    assert b.counters["asks"] == 0 and g.filed_with is None
    eb.shortfall = (Priority.CRITICAL, 3)
    g = b.step_now()
    assert b.counters["asks"] == 1 and g.filed_with == "a"
    g = a.step_now()  # the order and the shrink (B's unmet want) arrive together
    assert g.preempt is not None and g.preempt.num_blocks == 3 and g.preempt.requester == "b"
    owed = a.owed
    assert owed > 0
    a.before_step()
    # blocks already owed count toward the order: the engine frees only the rest
    assert ea.orders == [(max(0, 3 - owed), Priority.CRITICAL)]
    assert a.counters["orders"] == 1 and ea.limit == a.limit == 20 - a.owed
    ea.num_used_blocks = a.limit  # the engine preempted down to its limit
    owed = a.owed
    g = a.step_now()
    assert g.released == owed  # (the reply may ask for more: B still wants)
    g = b.step_now()
    assert g.transferred == 3 and g.held >= 3 and eb.limit == b.limit == g.held
