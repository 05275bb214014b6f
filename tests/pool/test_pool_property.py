"""Property test of the pool's Lua accounting against the real server.

Random interleavings of 4-6 simulated members: steps (acquire, release, go idle, report usage,
ask for preemption, execute or ignore orders), crashes, restarts, leaving, and the clock moving
past leases. The pool runs on its manual clock (``PoolConfig(clock="manual")``): the scripts read
time from the pool hash instead of Redis ``TIME``, so lease expiry is exact and every failing
example replays and shrinks deterministically (the Redis-clock path has its own test in
``test_pool_accounting.py``).

Checked after every operation: the sum of held blocks never exceeds the total (the raw members
hash, lapsed members included); entitlements equal an independent exact model (weighted split,
remainders, cap, idle members at zero); each reply's arithmetic (held = before - released +
transferred + granted; a grant stays within the entitlement); lapsed members are gone after the
next call and their blocks counted as reclaimed; a filed donor is the one the rule picks; blocks a
donor releases under an order go to the requester and to nobody else. A ``converge`` rule makes
every live member busy for a few rounds and checks each holds its entitlement within one chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson
import pytest
import redis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from pool_model import expected_donor, expected_entitlements

from tokenfleet.shared.keys import Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.worker.pool.admin import advance_manual_clock, create_pool, pool_snapshot
from tokenfleet.worker.pool.config import PoolConfig
from tokenfleet.worker.pool.grant import PoolGrant
from tokenfleet.worker.pool.member import KVPoolMember
from tokenfleet.worker.pool.orders import PreemptAsk, PreemptOrder

KEYS = Keys("tfp")
NAMES = ("m0", "m1", "m2", "m3", "m4", "m5")
LEASE_MS = 1000


@dataclass
class Sim:
    """A simulated worker: what it believes it holds and the order it has to execute."""

    client: KVPoolMember
    alive: bool = True
    order: PreemptOrder | None = None


class PoolMachine(RuleBasedStateMachine):
    client: redis.Redis  # set by the test

    def __init__(self) -> None:
        super().__init__()
        self.r = type(self).client
        self.r.flushdb()
        self.config: PoolConfig | None = None
        self.sims: dict[str, Sim] = {}

    # -- setup ------------------------------------------------------------------------------
    @precondition(lambda self: self.config is None)
    @rule(
        total=st.integers(8, 400),
        cap_permille=st.sampled_from([300, 500, 900, 1000]),
        chunk_div=st.integers(2, 16),
        weights=st.lists(st.sampled_from([0.5, 1.0, 1.0, 2.0, 3.0]), min_size=4, max_size=6),
    )
    def create(self, total: int, cap_permille: int, chunk_div: int, weights: list[float]) -> None:
        self.config = PoolConfig(
            total_blocks=total,
            cap_permille=cap_permille,
            chunk_blocks=max(1, total // chunk_div),
            lease_ms=LEASE_MS,
            preempt_ms=LEASE_MS // 2,
            clock="manual",
        )
        create_pool(self.r, KEYS, "p", self.config)
        for name, weight in zip(NAMES, weights, strict=False):
            m = KVPoolMember(client=self.r, keys=KEYS, pool="p", member=name, weight=weight)
            m.join()
            self.sims[name] = Sim(m)

    # -- helpers ----------------------------------------------------------------------------
    def raw_members(self) -> dict[str, dict[str, Any]]:
        raw: dict[bytes, bytes] = self.r.hgetall(KEYS.pool_members("p"))  # type: ignore[assignment]
        return {k.decode(): orjson.loads(v) for k, v in raw.items()}

    def counter(self, field: str) -> int:
        return int(self.r.hget(KEYS.pool("p"), field) or 0)

    def now(self) -> int:
        return self.counter("manual_now_ms")

    def check_reclaim(self, before: dict[str, dict[str, Any]], reclaimed_before: int) -> None:
        """After a mutating call: lapsed members are gone and their blocks counted."""
        now = self.now()
        lapsed = {n: s for n, s in before.items() if s["exp"] <= now}
        after = self.raw_members()
        assert all(s["exp"] > now for s in after.values())
        assert self.counter("reclaimed_blocks") - reclaimed_before == sum(
            s["held"] for s in lapsed.values()
        )

    # -- operations -------------------------------------------------------------------------
    def alive(self) -> list[str]:
        return sorted(n for n, s in self.sims.items() if s.alive)

    @precondition(lambda self: self.config is not None)
    @rule(
        data=st.data(),
        active=st.booleans(),
        want_chunks=st.integers(0, 4),
        obey=st.booleans(),
        execute=st.booleans(),
        ask=st.one_of(st.none(), st.tuples(st.sampled_from([0, 1]), st.integers(1, 60))),
    )
    def step(
        self,
        data: st.DataObject,
        active: bool,
        want_chunks: int,
        obey: bool,
        execute: bool,
        ask: tuple[int, int] | None,
    ) -> None:
        if self.alive():
            name = data.draw(st.sampled_from(self.alive()), label="member")
            self.do_step(data, name, active, want_chunks, obey, execute, ask)

    @precondition(lambda self: self.config is not None)
    @rule(
        data=st.data(),
        priority=st.sampled_from([0, 1]),
        blocks=st.integers(1, 60),
        want_chunks=st.integers(0, 2),
    )
    def ask_for_blocks(
        self, data: st.DataObject, priority: int, blocks: int, want_chunks: int
    ) -> None:
        if self.alive():
            name = data.draw(st.sampled_from(self.alive()), label="member")
            self.do_step(data, name, True, want_chunks, True, True, (priority, blocks))

    @precondition(lambda self: any(s.alive and s.order is not None for s in self.sims.values()))
    @rule(data=st.data())
    def execute_order(self, data: st.DataObject) -> None:
        names = sorted(n for n, s in self.sims.items() if s.alive and s.order is not None)
        name = data.draw(st.sampled_from(names), label="donor")
        self.do_step(data, name, True, 0, True, True, None)

    def do_step(
        self,
        data: st.DataObject,
        name: str,
        active: bool,
        want_chunks: int,
        obey: bool,
        execute: bool,
        ask: tuple[int, int] | None,
    ) -> None:
        assert self.config is not None
        sim = self.sims[name]
        m = sim.client
        known = m.held
        release = 0
        if obey and m.last is not None:
            release = m.last.must_release
        if execute and sim.order is not None:
            release = max(release, min(known, sim.order.num_blocks))
            sim.order = None
        release += data.draw(st.integers(0, max(0, known - release)), label="extra release")
        budget = known - release
        use = data.draw(
            st.lists(st.integers(0, max(0, budget)), min_size=3, max_size=3), label="use"
        )
        while sum(use) > budget:
            use[use.index(max(use))] -= 1
        preempt_ask = PreemptAsk(Priority(ask[0]), ask[1]) if ask else None

        raw_before = self.raw_members()
        view_before = pool_snapshot(self.r, KEYS, "p")
        reclaimed_before = self.counter("reclaimed_blocks")
        order_against_me = next((o for o in view_before["preemptions"] if o["donor"] == name), None)

        g = m.step(
            active=active,
            want_blocks=want_chunks * self.config.chunk_blocks,
            release_blocks=release,
            blocks_by_priority=use,
            ask=preempt_ask,
        )
        if g.preempt is not None:
            sim.order = g.preempt
        view = pool_snapshot(self.r, KEYS, "p")
        self.check_reclaim(raw_before, reclaimed_before)
        self.check_reply(name, known, release, g, view)
        if preempt_ask is not None:
            self.check_filing(name, preempt_ask, g, view)
        if order_against_me is not None and g.released > 0 and not g.rejoined:
            self.check_transfer(name, order_against_me, g, view_before, view)

    def check_reply(
        self, name: str, known: int, release: int, g: PoolGrant, view: dict[str, Any]
    ) -> None:
        assert self.config is not None
        before = 0 if g.rejoined else known + g.transferred
        assert g.released == min(release, before)
        assert g.held == before - g.released + g.granted
        assert g.granted == 0 or g.held <= g.entitlement
        if me_active := next(x for x in view["members"] if x["name"] == name)["active"]:
            # never told to go below its entitlement (plus loan)
            assert min(g.held, g.entitlement + g.loan) <= g.release_to <= g.held
            if g.release_to < g.held:  # only to cover what others are waiting for
                wanted = sum(
                    min(x["unmet_want"], max(0, x["entitlement"] - x["held"]))
                    for x in view["members"]
                    if x["active"] and x["name"] != name
                )
                assert g.held - g.release_to <= wanted - g.free_blocks
        else:
            assert g.release_to == 0
        assert g.free_blocks == self.config.total_blocks - view["held"]
        assert me_active is bool(me_active)
        me = next(x for x in view["members"] if x["name"] == name)
        assert (me["held"], me["entitlement"], me["loan"]) == (g.held, g.entitlement, g.loan)

    def check_filing(self, name: str, ask: PreemptAsk, g: PoolGrant, view: dict[str, Any]) -> None:
        short = ask.num_blocks - g.granted - g.transferred
        orders = view["preemptions"]
        if g.filed_with is not None:
            assert g.filed_with != name and short > 0
            busy = {o["donor"] for o in orders} - {g.filed_with}
            assert g.filed_with == expected_donor(view, name, int(ask.priority), short, busy)
            filed = next(o for o in orders if o["donor"] == g.filed_with)
            assert (filed["requester"], filed["blocks"]) == (name, short)
        elif short > 0 and g.pending_with is None:
            busy = {o["donor"] for o in orders}
            assert expected_donor(view, name, int(ask.priority), short, busy) is None

    def check_transfer(
        self,
        name: str,
        order: dict[str, Any],
        g: PoolGrant,
        before: dict[str, Any],
        after: dict[str, Any],
    ) -> None:
        """What a donor releases under an order goes to the requester, and to nobody else."""
        held_before = {x["name"]: x["held"] for x in before["members"]}
        held_after = {x["name"]: x["held"] for x in after["members"]}
        requester = order["requester"]
        if requester not in held_after or requester not in held_before:
            return  # it lapsed in between: the order was dropped
        credit = min(g.released, order["blocks"])
        assert held_after[requester] == held_before[requester] + credit
        for other in held_after:
            if other not in (name, requester) and other in held_before:
                assert held_after[other] == held_before[other]
        assert all(o["donor"] != name for o in after["preemptions"])

    @precondition(lambda self: self.config is not None)
    @rule(data=st.data())
    def crash(self, data: st.DataObject) -> None:
        alive = self.alive()
        if alive:
            self.sims[data.draw(st.sampled_from(alive), label="crash")].alive = False

    @precondition(lambda self: self.config is not None)
    @rule(data=st.data())
    def restart(self, data: st.DataObject) -> None:
        dead = sorted(n for n, s in self.sims.items() if not s.alive)
        if dead:
            sim = self.sims[data.draw(st.sampled_from(dead), label="restart")]
            raw_before, reclaimed = self.raw_members(), self.counter("reclaimed_blocks")
            sim.client.join()
            sim.alive, sim.order = True, None
            self.check_reclaim(raw_before, reclaimed)

    @precondition(lambda self: self.config is not None)
    @rule(data=st.data())
    def leave(self, data: st.DataObject) -> None:
        alive = self.alive()
        if alive:
            sim = self.sims[data.draw(st.sampled_from(alive), label="leave")]
            sim.client.leave()
            sim.alive, sim.order = False, None

    @precondition(lambda self: self.config is not None)
    @rule(ms=st.integers(0, 2 * LEASE_MS))
    def advance_clock(self, ms: int) -> None:
        advance_manual_clock(self.r, KEYS, "p", ms)

    @precondition(lambda self: self.config is not None)
    @rule()
    def converge(self) -> None:
        """Crashed members lapse; then every live member is saturated (wants more, batch work on
        all it holds, obeys release targets and orders): after a few rounds each holds its
        entitlement within one chunk."""
        assert self.config is not None
        alive = [s for _, s in sorted(self.sims.items()) if s.alive]
        if not alive:
            return
        # crashed members must lapse first: until then they hold what they held
        advance_manual_clock(self.r, KEYS, "p", LEASE_MS)
        for _ in range(4):
            for sim in alive:
                m = sim.client
                release = m.last.must_release if m.last is not None else 0
                if sim.order is not None:
                    release = max(release, min(m.held, sim.order.num_blocks))
                    sim.order = None
                g = m.step(
                    active=True,
                    want_blocks=self.config.total_blocks,
                    release_blocks=release,
                    blocks_by_priority=[0, 0, m.held - release],
                )
                if g.preempt is not None:
                    sim.order = g.preempt
        view = pool_snapshot(self.r, KEYS, "p")
        chunk = self.config.chunk_blocks
        for x in view["members"]:
            assert x["active"] and x["loan"] == 0
            assert x["entitlement"] - chunk <= x["held"] <= x["entitlement"], x
        held_total = sum(x["held"] for x in view["members"])
        entitled = min(self.config.total_blocks, len(alive) * view["cap"])
        assert entitled - chunk * len(alive) <= held_total <= entitled

    # -- invariants -------------------------------------------------------------------------
    @invariant()
    def held_never_exceeds_total(self) -> None:
        if self.config is not None:
            raw = self.raw_members()  # lapsed members not yet reclaimed count too
            assert sum(s["held"] for s in raw.values()) <= self.config.total_blocks

    @invariant()
    def entitlements_follow_the_rules(self) -> None:
        if self.config is None:
            return
        view = pool_snapshot(self.r, KEYS, "p")
        ents = {x["name"]: x["entitlement"] for x in view["members"]}
        assert ents == expected_entitlements(view)
        active = [x for x in view["members"] if x["active"]]
        assert all(x["entitlement"] <= view["cap"] for x in view["members"])
        assert all(x["entitlement"] == 0 for x in view["members"] if not x["active"])
        if active:  # idle shares flow to the active members, up to their caps
            total = self.config.total_blocks
            assert sum(x["entitlement"] for x in active) == min(total, len(active) * view["cap"])


@pytest.mark.real
def test_pool_accounting_under_random_interleavings(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    PoolMachine.client = client
    try:
        run_state_machine_as_test(
            PoolMachine,
            settings=settings(
                max_examples=100,
                stateful_step_count=40,
                deadline=None,
                database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
            ),
        )
    finally:
        client.close()
