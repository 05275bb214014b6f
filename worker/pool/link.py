"""One engine's link to a shared KV pool (issue 6): the per-step protocol of docs/kv-pools.md.

The link drives the engine through its one pool-facing object, ``engine.pool_port()`` (a
``tokenfleet.worker.engine.pool_port.PoolPort``). The worker service owns one :class:`PoolLink`
per engine and calls it around each step::

    link.join()                       # start-up: limit 0 until the pool grants blocks
    link.before_step()                # apply the last reply: execute a preemption order;
                                      # with a compute share, wait for this step's tokens
    outputs = engine.step()
    call = link.plan()                # what to ask, give back and report (reads the port)
    call.queue(pipe)                  # into the step's publish pipeline (any thread)
    link.after_execute(reply)         # that command's reply: the new grant and limit
    link.idle_tick()                  # when idle: keeps the lease (returns seconds to the next)
    link.leave()                      # shutdown

Accounting. ``held`` is what the pool credits this member as of its last reply, less what the
call in flight gives back; ``owed`` are blocks of it the engine may no longer use (a shrinking
share, an executed preemption order) and that the next call gives back. The engine's limit is
always ``held - owed``.

Compute share (pools with a token budget): the link reports the tokens the engine wants per round,
and before each step paces the engine to its share and caps the step's tokens
(:class:`tokenfleet.worker.pool.compute_share.ComputeShare`).

Invariants:
    * at most one pool call is in flight (``plan`` refuses a second one);
    * ``0 <= owed <= held`` and the engine's block limit is ``held - owed``;
    * a call gives back only blocks the engine does not use, so the engine's blocks in use never
      exceed what the pool credits the member (while its lease lives): grants are used only once
      their reply has arrived, and a lowered limit is enforced (by preemption) before the blocks
      go back.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

from tokenfleet.shared.errors import PoolError
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.pool.scripts import POOL_STEP, pool_keys
from tokenfleet.shared.priority import PRIORITIES, Priority
from tokenfleet.worker.engine.outputs import StepStats
from tokenfleet.worker.pipelined import ScriptPipeline
from tokenfleet.worker.pool.chunking import plan_blocks
from tokenfleet.worker.pool.compute_share import ComputeShare
from tokenfleet.worker.pool.config import PoolConfig
from tokenfleet.worker.pool.grant import PoolGrant
from tokenfleet.worker.pool.member import KVPoolMember
from tokenfleet.worker.pool.orders import PreemptAsk, PreemptOrder

LEAST_URGENT = max(PRIORITIES)  # no donor can run work less urgent than this: never asked for


class PoolPortLike(Protocol):
    """What the link needs from the engine: ``tokenfleet.worker.engine.pool_port.PoolPort``
    (``engine.pool_port()``) provides it; tests drive the link with a fake."""

    @property
    def num_kv_blocks(self) -> int: ...
    @property
    def num_used_blocks(self) -> int: ...
    @property
    def num_blocks_wanted(self) -> int: ...
    @property
    def has_work(self) -> bool: ...
    @property
    def num_tokens_wanted(self) -> int: ...
    @property
    def last_step_stats(self) -> StepStats: ...
    @property
    def token_limit(self) -> int | None: ...
    def set_token_limit(self, num_tokens: int | None) -> None: ...
    def set_kv_block_limit(self, num_blocks: int | None) -> None: ...
    def blocks_by_priority(self) -> list[int]: ...
    def kv_block_shortfall(self) -> tuple[Priority, int] | None: ...
    def preempt_for_pool(self, num_blocks: int, priority: Priority) -> int: ...


class PoolEngine(Protocol):
    """An engine a link can drive: ``tokenfleet.worker.engine.engine.Engine``."""

    def pool_port(self) -> PoolPortLike: ...


@dataclass(frozen=True, slots=True)
class PoolCall:
    """One planned pool step, ready to queue into a pipeline (from any thread).

    ``kwargs`` are :meth:`KVPoolMember.step`'s arguments, frozen when it was planned.
    """

    member: KVPoolMember
    kwargs: dict[str, Any] = field(default_factory=dict)

    def queue(self, pipe: Any) -> None:
        """Add the step to ``pipe``: a :class:`ScriptPipeline` (one round trip, as the worker's
        publisher uses) or a redis-py pipeline made from the member's client."""
        if isinstance(pipe, ScriptPipeline):
            m = self.member
            pipe.script(POOL_STEP, pool_keys(m.keys, m.pool), m.step_args(**self.kwargs))
        else:
            self.member.queue_step(pipe, **self.kwargs)


class PoolLink:
    """Keeps one engine within its share of a pool (see the module docstring).

    Keyword-only arguments: ``chunk`` (ask ahead in this many blocks; default the pool's),
    ``low_watermark`` / ``high_watermark`` (spare blocks kept, see ``plan_blocks``), ``clock``
    (monotonic seconds, for the idle lease ticks and the compute share's pace), ``sleep``
    (seconds; the compute share's waits).
    """

    def __init__(
        self,
        port: PoolPortLike,
        member: KVPoolMember,
        *,
        chunk: int | None = None,
        low_watermark: int | None = None,
        high_watermark: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if chunk is not None and chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        self.port = port  # the engine's pool-facing object
        self.member = member
        self.chunk = chunk
        self.low_watermark = low_watermark
        self.high_watermark = high_watermark
        self.clock = clock
        self.sleep = sleep
        self.compute: ComputeShare | None = None  # set at join when the pool has a token budget
        self._charged_step = 0  # the engine's last step charged to the compute share
        self.lease_s = 5.0
        self.held = 0  # blocks the pool credits us, less what the call in flight gives back
        self.owed = 0  # blocks of `held` the engine may not use; given back by the next call
        self.last: PoolGrant | None = None
        self._order: PreemptOrder | None = None  # received, to execute before the next step
        self._in_flight = False
        self._last_call = -float("inf")
        self.counters = {
            "calls": 0,
            "asks": 0,  # calls that carried a preemption ask
            "orders": 0,  # preemption orders executed
            "blocks_freed_for_orders": 0,
            "rejoins": 0,
        }

    # -- membership ---------------------------------------------------------------------------
    def join(self, *, create: PoolConfig | None = None, block_size: int | None = None) -> None:
        """Join the pool afresh (limit 0 until a grant). ``block_size``: the engine's, checked
        against the pool's (``PoolError`` if they differ)."""
        info = self.member.join(create=create)
        if block_size is not None and info["block_size"] != block_size:
            self.member.leave()
            raise PoolError(
                f"pool {self.member.pool} has blocks of {info['block_size']} tokens; this "
                f"engine's are {block_size}"
            )
        if self.chunk is None:
            self.chunk = info["chunk"]
        self.lease_s = info["lease_ms"] / 1000
        self.held = self.owed = 0
        self.last, self._order, self._in_flight = None, None, False
        self._last_call = self.clock()
        self.port.set_kv_block_limit(0)
        self.compute = None
        if info["token_budget"] > 0:
            self.compute = ComputeShare(
                token_budget=info["token_budget"],
                round_ms=info["round_ms"],
                clock=self.clock,
                sleep=self.sleep,
            )

    def leave(self) -> int:
        """Leave the pool (shutdown); the engine may use no pool blocks after. Returns the
        blocks that went back."""
        returned = self.member.leave()
        self.held = self.owed = 0
        self._order, self._in_flight = None, False
        self.port.set_kv_block_limit(0)
        self.port.set_token_limit(None)
        self.compute = None
        return returned

    # -- the per-step protocol ----------------------------------------------------------------
    @property
    def limit(self) -> int:
        """The engine's block limit: ``held - owed``."""
        return self.held - self.owed

    def before_step(self) -> None:
        """Before ``engine.step()``: execute a preemption order the last reply carried (free its
        blocks now; they go back with the next call; blocks already owed count toward it). With
        a compute share, then wait until the share allows this step and cap its tokens."""
        self._execute_order()
        if self.compute is not None and self.port.has_work:
            self.port.set_token_limit(self.compute.pace(self.port.num_tokens_wanted))

    def _execute_order(self) -> None:
        order, self._order = self._order, None
        if order is None:
            return
        freed = self.port.preempt_for_pool(max(0, order.num_blocks - self.owed), order.priority)
        self.owed += freed
        self.counters["orders"] += 1
        self.counters["blocks_freed_for_orders"] += freed
        self.port.set_kv_block_limit(self.limit)

    def plan(self) -> PoolCall:
        """After ``engine.step()``: the pool call for this step (read from the port now; queue
        it with :meth:`PoolCall.queue`, then pass its reply to :meth:`after_execute`).

        Gives back what is owed and not in use plus spare blocks above the high watermark, asks
        ahead in chunks, and asks for a donor when the head waiting request lacks blocks.
        """
        if self._in_flight:
            raise RuntimeError("a pool call is still in flight: apply its reply first")
        if self.chunk is None:
            raise RuntimeError("join the pool first")
        port = self.port
        active = port.has_work
        token_demand = 0
        if self.compute is not None:
            stats = port.last_step_stats
            if stats is not None and stats.step_index != self._charged_step:
                self._charged_step = stats.step_index
                self.compute.spent(stats.num_tokens)
            if active:
                token_demand = self.compute.demand(port.num_tokens_wanted)
        used = port.num_used_blocks
        if not active:
            self.owed = self.held  # idle: entitled to nothing, give everything back now
        give_back = min(self.owed, max(0, self.held - used))
        want = spare_release = 0
        if used <= self.limit:
            plan = plan_blocks(
                held=self.limit,
                used=used,
                need=port.num_blocks_wanted if active else 0,
                chunk=self.chunk,
                low_watermark=self.low_watermark,
                high_watermark=self.high_watermark,
            )
            want = min(plan.want, max(0, port.num_kv_blocks - self.held)) if active else 0
            spare_release = plan.release
        shortfall = port.kv_block_shortfall() if active else None
        ask = None
        if shortfall is not None and shortfall[0] < LEAST_URGENT:  # nothing is less urgent
            ask = PreemptAsk(Priority(shortfall[0]), shortfall[1])
        kwargs: dict[str, Any] = {
            "active": active,
            "want_blocks": want,
            "release_blocks": give_back + spare_release,
            "blocks_by_priority": port.blocks_by_priority(),
            "ask": ask,
            "token_demand": token_demand,
        }
        self.owed -= give_back
        self.held -= give_back + spare_release
        port.set_kv_block_limit(self.limit)
        self._in_flight = True
        self._last_call = self.clock()
        self.counters["calls"] += 1
        self.counters["asks"] += ask is not None
        return PoolCall(self.member, kwargs)

    def after_execute(self, reply: Any) -> PoolGrant:
        """The planned call's reply (raw, or as :class:`ScriptPipeline` returns it): take the
        grant, shrink to ``release_to`` if told, keep a preemption order for
        :meth:`before_step`."""
        self._in_flight = False
        g = self.member.parse_step(reply)
        self.last = g
        if g.rejoined:  # our lease lapsed: the pool reclaimed everything we held
            self.counters["rejoins"] += 1
            self.owed = 0
        self.held = g.held
        self.owed = min(self.held, max(self.owed, g.held - g.release_to))
        if g.preempt is not None:
            self._order = g.preempt
        self.port.set_kv_block_limit(self.limit)
        if self.compute is not None:
            self.compute.set_share(g.token_budget, g.active_members)
        return g

    def abandon(self) -> None:
        """The pipeline carrying the call failed: forget it. Safe either way: what it gave back
        was already taken off ``held``, and a grant it may have made is seen at the next reply."""
        self._in_flight = False

    def step_now(self) -> PoolGrant:
        """:meth:`plan`, run and :meth:`after_execute` in one synchronous round trip."""
        call = self.plan()
        try:
            pipe = ScriptPipeline(self.member.client)
            call.queue(pipe)
            reply = pipe.execute()[0]
        except BaseException:
            self.abandon()
            raise
        return self.after_execute(reply)

    def idle_tick(self) -> float:
        """Call when the engine is not stepping: makes a pool call when a third of the lease has
        passed since the last one, or when blocks are owed. Returns the seconds until the next
        tick is due (bound the idle wait by it)."""
        if self._in_flight:
            return self.lease_s / 3
        due = self._last_call + self.lease_s / 3
        if self.owed or self._order is not None or self.clock() >= due:
            self._execute_order()
            self.step_now()
            due = self._last_call + self.lease_s / 3
        return max(0.0, due - self.clock())

    # -- observability ------------------------------------------------------------------------
    @property
    def status(self) -> dict[str, Any]:
        """For heartbeats and ``tokenfleet status``: the member's budget and counters."""
        g = self.last
        return {
            "name": self.member.pool,
            "held": self.held,
            "limit": self.limit,
            "used": self.port.num_used_blocks,
            "entitlement": g.entitlement if g else 0,
            "loan": g.loan if g else 0,
            "pending_with": (g.pending_with or "") if g else "",
            **(
                {
                    "token_share": self.compute.share,
                    "token_limit": self.port.token_limit or 0,
                    "compute_wait_s": round(self.compute.waited_s, 3),
                }
                if self.compute is not None
                else {}
            ),
            **self.counters,
        }


def pool_link(engine: Any, client: Any, keys: Keys, ws: Any) -> PoolLink | None:
    """The engine's link to the shared KV pool of ``ws.kv_pool`` (``--kv-pool``), as member
    ``ws.name`` with weight ``ws.share_weight``; None without a pool. ``engine`` must be a
    ``PoolEngine`` (the real engine is)."""
    if not ws.kv_pool:
        return None
    member = KVPoolMember(
        client=client, keys=keys, pool=ws.kv_pool, member=ws.name, weight=ws.share_weight
    )
    return PoolLink(cast(PoolEngine, engine).pool_port(), member)
