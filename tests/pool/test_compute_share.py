"""Compute share (issue 6, item 5): a member computes at most its weighted share of the pool's
tokens per round.

Unit tests drive :class:`ComputeShare` with a fake clock whose ``sleep`` advances it. The
end-to-end test runs two real (tiny) engines behind ``PoolLink`` on one simulated device: a shared
fake clock that every step advances by its tokens at the device's rate (the pool's budget per
round), and that a member's pacing wait advances too. Weights 1 and 3 must split the computed
tokens 1 : 3; without a token budget the same flood splits them evenly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis
import torch
from fake_port import FakePort, FakeTime

from tokenfleet.shared.keys import Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.worker.engine.engine import Engine, EngineConfig
from tokenfleet.worker.engine.request import SamplingParams
from tokenfleet.worker.pool.admin import create_pool, pool_snapshot
from tokenfleet.worker.pool.compute_share import ComputeShare
from tokenfleet.worker.pool.config import PoolConfig
from tokenfleet.worker.pool.link import PoolLink
from tokenfleet.worker.pool.member import KVPoolMember


def share(budget: int = 100, round_ms: int = 100) -> tuple[ComputeShare, FakeTime]:
    t = FakeTime()
    return ComputeShare(token_budget=budget, round_ms=round_ms, clock=t, sleep=t.sleep), t


def test_a_full_bucket_lets_a_step_run_at_once_and_caps_it() -> None:
    cs, t = share()
    cs.set_share(40, active_members=2)
    assert cs.capacity == 40 and cs.level == 40
    assert cs.pace(10) == 40  # no wait; the cap is what the bucket holds
    assert cs.pace(500) == 40  # a step never takes more than one round's share
    assert t.slept == []


def test_an_empty_bucket_waits_for_exactly_the_tokens_wanted() -> None:
    cs, t = share()
    cs.set_share(40, active_members=2)  # 40 tokens per 100 ms: 2.5 ms per token
    cs.spent(40)
    assert cs.pace(10) == 10
    assert t.slept == [pytest.approx(0.025)]
    cs.spent(10)
    assert cs.pace(1000) == 40  # wants more than a round: waits for one whole round's share
    assert t.slept[-1] == pytest.approx(0.1)


def test_over_time_a_member_computes_its_share_per_round() -> None:
    cs, t = share(budget=1000)
    cs.set_share(250, active_members=2)
    start, done = t.now, 0
    for _ in range(400):
        cap = cs.pace(64)
        assert 1 <= cap <= 250
        step = min(cap, 64)
        cs.spent(step)
        done += step
        t.now += 0.002  # the step's own time also refills the bucket
    rounds = (t.now - start) / 0.1
    # at most one burst (the initial full bucket) above the rate; never below it while busy
    assert 250 * rounds <= done + 64 <= 250 * rounds + 250 + 64


def test_a_zero_share_paces_as_one_more_equal_member_and_always_progresses() -> None:
    cs, t = share(budget=90)
    cs.set_share(0, active_members=2)  # asked for nothing last round, has work now
    assert cs.capacity == 30
    cs.set_share(None, active_members=0)
    assert cs.capacity == 90
    assert cs.level == 30  # a grown share does not fill the bucket at once
    cs.spent(500)  # far more than it held: debt
    assert cs.pace(1) == 1  # waits until the debt is repaid, then progresses
    assert sum(t.slept) == pytest.approx((500 - 30 + 1) * 0.1 / 90)


def test_demand_is_the_whole_budget_with_work_and_none_without() -> None:
    cs, _ = share(budget=1000, round_ms=100)
    assert cs.demand(0) == 0
    assert cs.demand(1) == cs.demand(5000) == 1000


def test_link_reports_demand_and_caps_the_engine_by_its_share(r: redis.Redis, keys: Keys) -> None:
    create_pool(r, keys, "p", PoolConfig(total_blocks=40, chunk_blocks=4, token_budget=120))
    t = FakeTime()
    engines: dict[str, FakePort] = {}
    links: dict[str, PoolLink] = {}
    for name, weight in (("a", 1.0), ("b", 2.0)):
        engine = engines[name] = FakePort()
        member = KVPoolMember(client=r, keys=keys, pool="p", member=name, weight=weight)
        links[name] = PoolLink(engine, member, clock=t, sleep=t.sleep)
        links[name].join()
        assert links[name].compute is not None
        engine.has_work, engine.num_tokens_wanted = True, 500
    for _ in range(2):  # first calls report demand; second replies carry the split
        for name in ("a", "b"):
            links[name].before_step()
            links[name].step_now()
    view = {m["name"]: m for m in pool_snapshot(r, keys, "p")["members"]}
    assert view["a"]["token_demand"] == 120 and view["b"]["token_demand"] == 120
    assert (view["a"]["token_budget"], view["b"]["token_budget"]) == (40, 80)
    links["a"].before_step()
    links["b"].before_step()
    assert (engines["a"].token_limit, engines["b"].token_limit) == (40, 80)
    assert links["b"].status["token_share"] == 80
    # a member without work gives its share to the other
    engines["a"].has_work = False
    links["a"].step_now()
    assert links["b"].step_now().token_budget == 120
    links["a"].leave()
    assert engines["a"].token_limit is None


def test_no_token_budget_no_pacing(r: redis.Redis, keys: Keys) -> None:
    create_pool(r, keys, "p", PoolConfig(total_blocks=40, chunk_blocks=4))
    t = FakeTime()
    engine = FakePort()
    link = PoolLink(engine, KVPoolMember(client=r, keys=keys, pool="p", member="a"), clock=t)
    link.join()
    engine.has_work, engine.num_tokens_wanted = True, 500
    link.before_step()
    assert link.compute is None and engine.token_limit is None
    assert link.step_now().token_budget is None


# -- two real engines on one simulated device ----------------------------------------------------

BUDGET, ROUND_MS = 48, 100  # the simulated device computes 48 tokens per 100 ms
LONG = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)


@pytest.fixture(scope="module")
def engine_pair(tiny_llama_dir: Path) -> tuple[Engine, Engine]:
    torch.set_num_threads(1)
    config = EngineConfig(
        block_size=4,
        num_kv_blocks=180,
        max_num_seqs=16,
        max_num_batched_tokens=64,
        device="cpu",
        max_wait_s=None,
        seed=0,
    )
    return Engine(tiny_llama_dir, config), Engine(tiny_llama_dir, config)


def co_located_run(
    r: redis.Redis, keys: Keys, engines: tuple[Engine, Engine], token_budget: int
) -> dict[str, int]:
    """Both members flooded, each on its own timeline (a process), sharing one serial device
    that computes BUDGET tokens per round: the member whose next step is due first runs it, no
    earlier than the device is free, and its clock moves to the step's end. Pacing waits move
    only the waiting member's clock (the other may use the device meanwhile). Returns the tokens
    each computed while both had work."""
    create_pool(
        r,
        keys,
        "p",
        PoolConfig(
            total_blocks=720,  # blocks for all: only compute is shared
            block_size=4,
            cap_permille=1000,
            chunk_blocks=8,
            lease_ms=600_000,
            token_budget=token_budget,
            round_ms=ROUND_MS,
            clock="manual",
        ),
    )
    members: list[tuple[str, Engine, PoolLink, FakeTime]] = []
    for (name, weight), loaded in zip((("light", 1.0), ("heavy", 3.0)), engines, strict=True):
        t = FakeTime()
        engine = Engine.from_runner(loaded.runner, loaded.tokenizer, loaded.config)
        member = KVPoolMember(client=r, keys=keys, pool="p", member=name, weight=weight)
        link = PoolLink(engine.pool_port(), member, clock=t, sleep=t.sleep)
        link.join(block_size=4)
        for i in range(32):
            text = f"{name} request {i}: tokens for the shared device"
            engine.add_request(f"{name}{i}", text, LONG, priority=Priority.BATCH)
        members.append((name, engine, link, t))
    computed = {name: 0 for name, *_ in members}
    device_free = 0.0
    for _ in range(10_000):
        if not all(link.port.has_work for _, _, link, _ in members):
            break
        name, engine, link, t = min(members, key=lambda m: m[3].now)
        before = t.now
        link.before_step()
        if t.now > before:
            continue  # it waited for its share: the device serves whoever is due first
        t.now = max(t.now, device_free)
        engine.step()
        stats: Any = engine.last_step_stats
        computed[name] += stats.num_tokens
        t.now += stats.num_tokens * (ROUND_MS / 1000) / BUDGET  # the device's time
        device_free = t.now
        link.step_now()
    for _, _, link, _ in members:
        link.leave()
    return computed


@pytest.mark.slow
def test_co_located_members_split_compute_by_weight(
    r: redis.Redis, keys: Keys, engine_pair: tuple[Engine, Engine]
) -> None:
    shared = co_located_run(r, keys, engine_pair, token_budget=BUDGET)
    assert shared["light"] > 0
    ratio = shared["heavy"] / shared["light"]
    assert 2.7 <= ratio <= 3.3, shared  # weights 1 : 3

    r.flushdb()
    unshared = co_located_run(r, keys, engine_pair, token_budget=0)
    ratio = unshared["heavy"] / unshared["light"]
    assert 0.85 <= ratio <= 1.18, unshared  # without a budget: each step as big as it likes
