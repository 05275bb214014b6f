"""The pool scripts against the real server: one rule per test (see the property test for
random interleavings)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis
import redis.asyncio as aredis
from pool_model import expected_entitlements
from waiting import wait_for

from tokenfleet.shared.errors import InvalidRequest, PoolError
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.worker.pool.admin import advance_manual_clock, create_pool, pool_snapshot
from tokenfleet.worker.pool.config import PoolConfig
from tokenfleet.worker.pool.grant import PoolGrant
from tokenfleet.worker.pool.member import KVPoolMember
from tokenfleet.worker.pool.orders import PreemptAsk

BATCH = [0, 0]  # prefix of blocks_by_priority: nothing critical or normal


def make_pool(r: redis.Redis, keys: Keys, **overrides: object) -> str:
    config: dict[str, Any] = {"total_blocks": 100, "chunk_blocks": 4, "clock": "manual"}
    config.update(overrides)
    create_pool(r, keys, "p", PoolConfig(**config))
    return "p"


def member(r: redis.Redis, keys: Keys, name: str, weight: float = 1.0) -> KVPoolMember:
    m = KVPoolMember(client=r, keys=keys, pool="p", member=name, weight=weight)
    m.join()
    return m


def busy(m: KVPoolMember, want: int = 10_000, **kwargs: Any) -> PoolGrant:
    """A saturated member: wants everything, uses all it holds for batch work, releases what it
    is told to."""
    release = m.last.must_release if m.last else 0
    held = m.held - release
    return m.step(
        active=True,
        want_blocks=want,
        release_blocks=release,
        blocks_by_priority=[*BATCH, held],
        **kwargs,
    )


def converge(*members: KVPoolMember, rounds: int = 3) -> None:
    for _ in range(rounds):
        for m in members:
            busy(m)


def test_create_is_idempotent_and_refuses_a_different_size(r: redis.Redis, keys: Keys) -> None:
    assert create_pool(r, keys, "p", PoolConfig(total_blocks=100)) is True
    assert create_pool(r, keys, "p", PoolConfig(total_blocks=100)) is False
    with pytest.raises(PoolError, match="exists with 100 blocks"):
        create_pool(r, keys, "p", PoolConfig(total_blocks=50))
    assert r.smembers(keys.pools) == {b"p"}


def test_join_needs_a_pool_or_creates_it(r: redis.Redis, keys: Keys) -> None:
    m = KVPoolMember(client=r, keys=keys, pool="p", member="a")
    with pytest.raises(PoolError, match="does not exist"):
        m.join()
    info = m.join(create=PoolConfig(total_blocks=64, block_size=32))
    assert info["created"] == 1 and info["total_blocks"] == 64 and info["block_size"] == 32
    b = KVPoolMember(client=r, keys=keys, pool="p", member="b")
    with pytest.raises(PoolError, match="blocks of 32"):
        b.join(create=PoolConfig(total_blocks=64, block_size=16))


def test_config_and_weight_are_validated() -> None:
    with pytest.raises(InvalidRequest):
        PoolConfig(total_blocks=0)
    with pytest.raises(InvalidRequest):
        PoolConfig(total_blocks=10, cap_permille=1001)
    with pytest.raises(InvalidRequest):
        PoolConfig(total_blocks=10, clock="wall")
    with pytest.raises(InvalidRequest):
        KVPoolMember(client=None, keys=Keys(), pool="p", member="a", weight=0)
    with pytest.raises(InvalidRequest):
        KVPoolMember(client=None, keys=Keys(), pool="bad name", member="a")


def test_weighted_split_with_remainders(r: redis.Redis, keys: Keys) -> None:
    make_pool(r, keys, total_blocks=100)
    members = [member(r, keys, n, w) for n, w in (("a", 1), ("b", 1), ("c", 1), ("d", 2))]
    for m in members:
        busy(m)
    view = pool_snapshot(r, keys, "p")
    ents = {m["name"]: m["entitlement"] for m in view["members"]}
    # 100 * (1, 1, 1, 2) / 5 = 20, 20, 20, 40 exactly; with 3 equal members: 33.33 each
    assert ents == {"a": 20, "b": 20, "c": 20, "d": 40}
    busy(members[3], want=0)
    members[3].step(active=False, release_blocks=members[3].held)
    view = pool_snapshot(r, keys, "p")
    ents = {m["name"]: m["entitlement"] for m in view["members"]}
    assert ents == {"a": 34, "b": 33, "c": 33, "d": 0}  # remainder by name among equal fractions
    assert ents == expected_entitlements(view)


def test_grants_never_exceed_the_entitlement_or_the_free_blocks(r: redis.Redis, keys: Keys) -> None:
    make_pool(r, keys, total_blocks=100)
    a, b = member(r, keys, "a"), member(r, keys, "b")
    assert busy(a).held == 90  # alone: the cap (900 permille)
    g = busy(b)
    assert (g.entitlement, g.granted, g.free_blocks) == (50, 10, 0)  # only 10 were free
    g = busy(a)
    assert (g.entitlement, g.release_to, g.granted) == (50, 50, 0)  # told to give 40 back
    assert busy(a).held == 50  # releases
    assert busy(b).held == 50  # and b gets them
    assert pool_snapshot(r, keys, "p")["held"] == 100


def test_only_what_others_wait_for_is_reclaimed(r: redis.Redis, keys: Keys) -> None:
    make_pool(r, keys, total_blocks=100)
    a, b = member(r, keys, "a"), member(r, keys, "b")
    assert busy(a).held == 90
    g = b.step(active=True, want_blocks=5)  # served from the 10 free blocks
    assert (g.granted, g.entitlement) == (5, 50)
    g = busy(a)
    assert (g.entitlement, g.release_to) == (50, 90)  # above its share, but nobody waits
    g = b.step(active=True, want_blocks=20, blocks_by_priority=[0, 0, 5])
    assert g.granted == 5  # 15 short
    g = busy(a)
    assert g.release_to == 75  # gives back exactly what b waits for
    busy(a)
    assert b.step(active=True, want_blocks=15, blocks_by_priority=[0, 0, 10]).granted == 15


def test_cap_water_fills_to_the_others(r: redis.Redis, keys: Keys) -> None:
    make_pool(r, keys, total_blocks=100, cap_permille=500)
    a, b, c = member(r, keys, "a", 8), member(r, keys, "b"), member(r, keys, "c")
    for m in (a, b, c):
        busy(m)
    ents = {m["name"]: m["entitlement"] for m in pool_snapshot(r, keys, "p")["members"]}
    assert ents == {"a": 50, "b": 25, "c": 25}  # a's 80 capped at 50; b and c split the rest


def test_idle_members_donate_and_are_told_to_release(r: redis.Redis, keys: Keys) -> None:
    make_pool(r, keys, total_blocks=100)
    a, b = member(r, keys, "a"), member(r, keys, "b")
    converge(a, b)
    assert (a.held, b.held) == (50, 50)
    g = b.step(active=False, blocks_by_priority=[])
    assert (g.entitlement, g.release_to) == (0, 0)
    b.step(active=False, release_blocks=g.must_release)
    assert busy(a).held == 90


def test_lapsed_lease_returns_blocks_manual_clock(r: redis.Redis, keys: Keys) -> None:
    make_pool(r, keys, total_blocks=100, lease_ms=1000)
    a, b = member(r, keys, "a"), member(r, keys, "b")
    converge(a, b)
    advance_manual_clock(r, keys, "p", 600)
    busy(b)  # b renews; a does not
    advance_manual_clock(r, keys, "p", 600)  # a's lease (t=0 + 1000) has lapsed, b's has not
    view = pool_snapshot(r, keys, "p")
    assert [m["name"] for m in view["members"]] == ["b"]
    assert busy(b).held == 90
    counters = r.hmget(keys.pool("p"), "reclaimed_blocks", "lapsed_members")
    assert counters == [b"50", b"1"]
    g = busy(a)  # a comes back: it holds nothing from before
    assert g.rejoined and g.transferred == 0 and g.held <= g.entitlement


def test_lapsed_lease_returns_blocks_redis_clock(r: redis.Redis, keys: Keys) -> None:
    """The real clock path (Redis TIME): a 30 ms lease, then a bounded wait for it to lapse."""
    make_pool(r, keys, total_blocks=100, lease_ms=30, clock="redis")
    a, b = member(r, keys, "a"), member(r, keys, "b")
    assert busy(a).held == 90

    def reclaimed() -> bool:
        b.step(active=False)  # any call reclaims lapsed members; b renews its own lease
        return not r.hexists(keys.pool_members("p"), "a")

    wait_for(reclaimed, "a's lapsed lease to be reclaimed", timeout_s=10, poll_s=0.01)
    assert r.hget(keys.pool("p"), "reclaimed_blocks") == b"90"
    assert pool_snapshot(r, keys, "p")["held"] == 0


def test_rejoin_returns_the_previous_incarnation_blocks(r: redis.Redis, keys: Keys) -> None:
    make_pool(r, keys)
    a = member(r, keys, "a")
    busy(a)
    assert a.join()["returned_blocks"] == 90
    assert pool_snapshot(r, keys, "p")["held"] == 0


def test_leave_returns_blocks(r: redis.Redis, keys: Keys) -> None:
    make_pool(r, keys)
    a = member(r, keys, "a")
    busy(a)
    assert a.leave() == 90
    assert pool_snapshot(r, keys, "p")["members"] == []


def test_preemption_picks_least_urgent_donor_and_reserves_its_blocks(
    r: redis.Redis, keys: Keys
) -> None:
    make_pool(r, keys, total_blocks=120)
    # x runs normal work only, y batch work, z batch work but too little of it
    x, y, z, req = (member(r, keys, n) for n in ("x", "y", "z", "req"))
    x.step(active=True, want_blocks=40, blocks_by_priority=[0, 40, 0])
    y.step(active=True, want_blocks=40, blocks_by_priority=[0, 10, 30])
    z.step(active=True, want_blocks=40, blocks_by_priority=[0, 35, 5])
    g = req.step(active=True, want_blocks=8, ask=PreemptAsk(Priority.CRITICAL, 20))
    assert g.granted == 0 and g.filed_with == "y" and g.pending_with == "y"
    # the order reaches y once
    order = y.step(active=True, blocks_by_priority=[0, 10, 30]).preempt
    assert order is not None and (order.num_blocks, order.requester) == (20, "req")
    assert order.priority is Priority.CRITICAL
    assert y.step(active=True, blocks_by_priority=[0, 10, 30]).preempt is None
    # y preempts 20 blocks of batch work and releases them: all go to req, none to others
    g = y.step(active=True, release_blocks=20, want_blocks=20, blocks_by_priority=[0, 10, 10])
    assert g.released == 20 and g.granted == 0
    g = z.step(active=True, want_blocks=100, blocks_by_priority=[0, 35, 5])
    assert g.granted == 0
    g = req.step(active=True, ask=PreemptAsk(Priority.CRITICAL, 20))
    assert (g.transferred, g.held, g.loan, g.filed_with, g.pending_with) == (20, 20, 20, None, None)
    assert pool_snapshot(r, keys, "p")["preemptions"] == []


def test_no_donor_without_less_urgent_work_or_enough_blocks(r: redis.Redis, keys: Keys) -> None:
    make_pool(r, keys, total_blocks=60)
    a, b = member(r, keys, "a"), member(r, keys, "b")
    a.step(active=True, want_blocks=30, blocks_by_priority=[0, 30, 0])
    b.step(active=True, want_blocks=30, blocks_by_priority=[0, 0, 10])  # 20 spare + 10 batch
    assert a.step(active=True, ask=PreemptAsk(Priority.NORMAL, 31)).filed_with is None
    ask = PreemptAsk(Priority.NORMAL, 5)
    g = b.step(active=True, ask=ask, blocks_by_priority=[0, 0, 10])
    assert g.filed_with is None  # a runs normal work only: not strictly less urgent
    assert a.step(active=True, ask=PreemptAsk(Priority.BATCH, 5)).filed_with is None  # not strict
    assert a.step(active=True, ask=PreemptAsk(Priority.NORMAL, 30)).filed_with == "b"


def test_donor_tie_break_by_excess_then_name(r: redis.Redis, keys: Keys) -> None:
    make_pool(r, keys, total_blocks=90, cap_permille=1000)
    a, b, c = member(r, keys, "a"), member(r, keys, "b"), member(r, keys, "c")
    a.step(active=True, want_blocks=30, blocks_by_priority=[0, 0, 30])
    b.step(active=True, want_blocks=30, blocks_by_priority=[0, 0, 30])
    c.step(active=False)
    # entitlements: a 45, b 45; both 15 under: tie -> name
    assert c.step(active=True, ask=PreemptAsk(Priority.CRITICAL, 5)).filed_with == "a"
    c.leave()
    b.step(active=True, want_blocks=15, blocks_by_priority=[0, 0, 45])  # b now 45, a 30
    c = member(r, keys, "c")
    # now a 30 (ent 30), b 45 (ent 30): b is furthest above its share
    assert c.step(active=True, ask=PreemptAsk(Priority.CRITICAL, 5)).filed_with == "b"


def test_unsent_order_is_withdrawn_when_no_longer_needed(r: redis.Redis, keys: Keys) -> None:
    make_pool(r, keys, total_blocks=40)
    a, b = member(r, keys, "a"), member(r, keys, "b")
    a.step(active=True, want_blocks=36, blocks_by_priority=[0, 0, 36])
    assert b.step(active=True, ask=PreemptAsk(Priority.CRITICAL, 8)).filed_with == "a"
    assert b.step(active=True).pending_with is None
    assert pool_snapshot(r, keys, "p")["preemptions"] == []
    assert a.step(active=True, blocks_by_priority=[0, 0, 36]).preempt is None


def test_order_lapses_when_the_donor_does_not_act(r: redis.Redis, keys: Keys) -> None:
    make_pool(r, keys, total_blocks=40, preempt_ms=500)
    a, b = member(r, keys, "a"), member(r, keys, "b")
    a.step(active=True, want_blocks=36, blocks_by_priority=[0, 0, 36])
    ask = PreemptAsk(Priority.CRITICAL, 8)
    assert b.step(active=True, ask=ask).filed_with == "a"
    assert a.step(active=True, blocks_by_priority=[0, 0, 36]).preempt is not None
    advance_manual_clock(r, keys, "p", 500)
    g = b.step(active=True, ask=ask)  # the old order lapsed; a new one is filed
    assert g.filed_with == "a"
    assert pool_snapshot(r, keys, "p")["preemptions"][0]["id"] == 2


def test_loan_lasts_while_the_urgent_work_runs(r: redis.Redis, keys: Keys) -> None:
    make_pool(r, keys, total_blocks=40, cap_permille=1000)
    a, b = member(r, keys, "a"), member(r, keys, "b")
    a.step(active=True, want_blocks=40, blocks_by_priority=[0, 0, 40])
    b.step(active=True)
    ask = PreemptAsk(Priority.CRITICAL, 30)
    assert b.step(active=True, ask=ask).filed_with == "a"
    a.step(active=True, blocks_by_priority=[0, 0, 40])
    a.step(active=True, release_blocks=30, blocks_by_priority=[0, 0, 10])
    g = b.step(active=True, ask=ask)  # credited before b admitted the request: still protected
    assert (g.held, g.entitlement, g.loan, g.release_to) == (30, 20, 30, 30)
    g = b.step(active=True, blocks_by_priority=[30, 0, 0])  # running it
    assert (g.loan, g.release_to) == (30, 30)
    g = b.step(active=True, blocks_by_priority=[0, 0, 30])  # done; batch work took the blocks
    assert (g.loan, g.release_to) == (0, 30)  # a wants nothing more: b may keep them
    a.step(active=True, want_blocks=16, blocks_by_priority=[0, 0, 10])
    g = b.step(active=True, blocks_by_priority=[0, 0, 30])
    assert (g.loan, g.release_to) == (0, 20)  # a wants its share back


def test_token_budget_split_by_weight_and_demand(r: redis.Redis, keys: Keys) -> None:
    make_pool(r, keys, token_budget=1000)
    a, b, c = member(r, keys, "a"), member(r, keys, "b", 3), member(r, keys, "c")
    assert a.step(active=True, token_demand=5000).token_budget == 1000  # alone
    b.step(active=True, token_demand=5000)
    c.step(active=True, token_demand=100)
    # c asks for 100 only; a and b split the other 900 by 1:3
    shares = [m["token_budget"] for m in pool_snapshot(r, keys, "p")["members"]]
    assert shares == [225, 675, 100]
    assert a.step(active=True, token_demand=5000).token_budget == 225
    assert a.step(active=True, token_demand=0).token_budget == 0  # no demand, no tokens
    assert b.step(active=True, token_demand=5000).token_budget == 900


def test_no_token_budget_without_compute_share(r: redis.Redis, keys: Keys) -> None:
    make_pool(r, keys)
    assert member(r, keys, "a").step(active=True, token_demand=10).token_budget is None


def test_step_queued_in_a_pipeline(r: redis.Redis, keys: Keys) -> None:
    make_pool(r, keys)
    a = member(r, keys, "a")
    pipe = r.pipeline(transaction=False)
    pipe.set("tft:other", "1")
    a.queue_step(pipe, active=True, want_blocks=8)
    replies = pipe.execute()
    assert a.parse_step(replies[1]).held == 8 and a.held == 8


def test_async_client(redis_url: str, keys: Keys) -> None:
    async def run() -> tuple[int, int]:
        client = aredis.Redis.from_url(redis_url)
        try:
            await client.hset(keys.pool("p"), mapping={"x": "1"})  # not a pool: no total
            await client.delete(keys.pool("p"))
            make_pool(redis.Redis.from_url(redis_url), keys)
            m = KVPoolMember(client=client, keys=keys, pool="p", member="a")
            await m.ajoin()
            g = await m.astep(active=True, want_blocks=8)
            return g.held, await m.aleave()
        finally:
            await client.aclose()

    assert asyncio.run(run()) == (8, 8)


def test_missing_pool_is_a_pool_error(r: redis.Redis, keys: Keys) -> None:
    m = KVPoolMember(client=r, keys=keys, pool="nope", member="a")
    with pytest.raises(PoolError, match="pool nope does not exist"):
        m.step(active=True)
    with pytest.raises(PoolError):
        pool_snapshot(r, keys, "nope")
    with pytest.raises(PoolError, match="manual clock"):
        make_pool(r, keys, clock="redis")
        advance_manual_clock(r, keys, "p", 1)
