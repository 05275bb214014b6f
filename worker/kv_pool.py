"""A worker's client for a shared KV pool (issue 6): one script call per engine step.

The worker service owns one :class:`KVPoolMember`. Every step it calls :meth:`KVPoolMember.step`
(or queues :meth:`KVPoolMember.queue_step` into its publishing pipeline and parses the reply with
:meth:`KVPoolMember.parse_step`); that call is also the member's heartbeat. The reply, a
:class:`PoolGrant`, is the engine's budget: ``held`` blocks, to shrink to ``release_to``, and
possibly a :class:`PreemptOrder` to execute before the next step. :func:`plan_blocks` is the
chunking policy: ask ahead in whole chunks, give back surplus above a watermark.

The accounting rules live in :mod:`tokenfleet.shared.scripts.pool`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from tokenfleet.shared.errors import InvalidRequest
from tokenfleet.shared.keys import Keys, check_name
from tokenfleet.shared.priority import PRIORITIES, Priority
from tokenfleet.shared.scripts import registry
from tokenfleet.shared.scripts.pool import (
    POOL_ADVANCE_CLOCK,
    POOL_CREATE,
    POOL_INSPECT,
    POOL_JOIN,
    POOL_LEAVE,
    POOL_STEP,
    PoolConfig,
    pool_keys,
    weight_milli,
)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass(frozen=True, slots=True)
class PreemptAsk:
    """A waiting request that cannot get blocks: ask the pool for a donor.

    Attributes:
        priority: the request's priority; only strictly less urgent work is preempted for it.
        num_blocks: blocks it needs beyond the member's spare blocks before this step.
    """

    priority: Priority
    num_blocks: int

    def __post_init__(self) -> None:
        if not isinstance(self.num_blocks, int) or self.num_blocks <= 0:
            raise InvalidRequest(f"num_blocks must be a positive integer, got {self.num_blocks!r}")


@dataclass(frozen=True, slots=True)
class PreemptOrder:
    """Sent once to a donor: free ``num_blocks`` and release them at the next step.

    Attributes:
        order_id: the pool's sequence number of the order.
        num_blocks: blocks to give up: spare blocks first, then by preempting (recompute) running
            requests strictly less urgent than ``priority``, least urgent and latest first.
        priority: the requester's priority.
        requester: the member the released blocks are credited to.
    """

    order_id: int
    num_blocks: int
    priority: Priority
    requester: str


@dataclass(frozen=True, slots=True)
class PoolGrant:
    """The pool's answer to one step. Every count is in KV blocks.

    Attributes:
        held: blocks the member holds after this call: the engine's KV budget.
        granted: blocks added by this call's acquire.
        transferred: blocks credited by donors (cross-worker preemption) since the last call.
        released: blocks this call accepted back (at most what was held).
        entitlement: the member's weighted share among active members, capped.
        release_to: shrink to this many blocks (preempting if needed) and release the rest at
            the next step; equals ``held`` when nothing must go back.
        loan: blocks held above the entitlement thanks to preemption, kept while the urgent work
            they were taken for runs.
        total_blocks: the pool's total.
        free_blocks: blocks nobody holds after this call.
        active_members: members with running or waiting work.
        token_budget: this member's share of the pool's tokens per round; None when the pool has
            no compute share.
        preempt: an order to execute (None when there is none).
        filed_with: the donor this call filed a preemption against, else None.
        pending_with: the donor of this member's outstanding preemption, else None.
        rejoined: the pool did not know the member (its lease had lapsed): it starts from zero.
        now_ms: the pool's clock at the call.
    """

    held: int = 0
    granted: int = 0
    transferred: int = 0
    released: int = 0
    entitlement: int = 0
    release_to: int = 0
    loan: int = 0
    total_blocks: int = 0
    free_blocks: int = 0
    active_members: int = 0
    token_budget: int | None = None
    preempt: PreemptOrder | None = None
    filed_with: str | None = None
    pending_with: str | None = None
    rejoined: bool = False
    now_ms: int = 0

    @property
    def must_release(self) -> int:
        """Blocks to give back at the next step because the share shrank."""
        return self.held - self.release_to

    @classmethod
    def from_reply(cls, values: Sequence[Any]) -> PoolGrant:
        """Parse a checked :data:`POOL_STEP` reply (status code first)."""
        v = list(values)
        order = None
        if int(v[12]):
            order = PreemptOrder(
                order_id=int(v[12]),
                num_blocks=int(v[13]),
                priority=Priority(int(v[14])),
                requester=_text(v[15]),
            )
        return cls(
            held=int(v[1]),
            granted=int(v[2]),
            transferred=int(v[3]),
            released=int(v[4]),
            entitlement=int(v[5]),
            release_to=int(v[6]),
            loan=int(v[7]),
            total_blocks=int(v[8]),
            free_blocks=int(v[9]),
            active_members=int(v[10]),
            token_budget=None if v[11] is None else int(v[11]),
            preempt=order,
            filed_with=_text(v[16]) or None,
            pending_with=_text(v[17]) or None,
            rejoined=bool(int(v[18])),
            now_ms=int(v[19]),
        )


@dataclass(frozen=True, slots=True)
class BlockPlan:
    """What to ask for and give back at this step. At most one of the two is non-zero."""

    want: int = 0  # blocks to acquire (a whole number of chunks)
    release: int = 0  # blocks to give back


def plan_blocks(
    *,
    held: int,
    used: int,
    need: int,
    chunk: int,
    low_watermark: int | None = None,
    high_watermark: int | None = None,
) -> BlockPlan:
    """Chunking policy: keep the spare blocks (``held - used - need``) within the watermarks.

    Below ``low_watermark`` (default ``chunk // 2``) ask for whole chunks until the spare reaches
    it; above ``high_watermark`` (default ``low + 2 * chunk``) give back down to the middle of the
    two. With the whole request granted, the spare ends in ``[low, high]``; since
    ``high >= low + chunk`` a step never asks and gives back in turn (no ping-pong).

    Args:
        held: blocks the member holds.
        used: blocks the engine uses now.
        need: more blocks the engine needs this step (growth of running sequences, admissions).
        chunk: ask in multiples of this many blocks (the pool's ``chunk``).
    """
    for label, value in (("held", held), ("used", used), ("need", need)):
        if value < 0:
            raise InvalidRequest(f"{label} must be >= 0, got {value}")
    if chunk <= 0:
        raise InvalidRequest(f"chunk must be positive, got {chunk}")
    low = chunk // 2 if low_watermark is None else low_watermark
    high = low + 2 * chunk if high_watermark is None else high_watermark
    if low < 0 or high < low + chunk:
        raise InvalidRequest(
            f"watermarks must satisfy 0 <= low and low + chunk <= high, got {low}, {high}"
        )
    spare = held - used - need
    if spare < low:
        return BlockPlan(want=math.ceil((low - spare) / chunk) * chunk)
    if spare > high:
        return BlockPlan(release=min(held, spare - (low + high) // 2))
    return BlockPlan()


class KVPoolMember:
    """One worker's membership in a shared KV pool.

    Keyword-only arguments: ``client`` (sync or asyncio redis client; the matching call methods
    apply), ``keys``, ``pool`` name, ``member`` name (the worker's name), ``weight`` (share
    weight, 0.001 to 100).

    Invariant: ``held`` is the last ``held`` the pool reported, a lower bound of what the pool
    credits this member (donors' transfers only add between calls, and only a lapsed lease takes
    away, which the next reply reports). The engine must never use more than ``held`` blocks.
    """

    def __init__(
        self, *, client: Any, keys: Keys, pool: str, member: str, weight: float = 1.0
    ) -> None:
        check_name("pool", pool)
        check_name("worker", member)
        self.client = client
        self.keys = keys
        self.pool = pool
        self.member = member
        self.weight_milli = weight_milli(weight)
        self.held = 0
        self.last: PoolGrant | None = None
        self._keys = pool_keys(keys, pool)

    # -- membership ---------------------------------------------------------------------------
    def _join_args(self, create: PoolConfig | None) -> list[str]:
        settings = create.args(self.pool) if create else ["0"] * 7 + ["", "", "0"]
        return [self.member, str(self.weight_milli), *settings]

    def join(self, *, create: PoolConfig | None = None) -> dict[str, int]:
        """Join afresh (creating the pool from ``create`` if it does not exist); returns the
        pool's settings. Raises ``PoolError`` if the pool is missing (and no ``create``) or
        differs from ``create`` in size or block size."""
        reply = registry.call(self.client, POOL_JOIN, self._keys, self._join_args(create))
        return self._joined(reply)

    async def ajoin(self, *, create: PoolConfig | None = None) -> dict[str, int]:
        """:meth:`join` on an asyncio client."""
        reply = await registry.acall(self.client, POOL_JOIN, self._keys, self._join_args(create))
        return self._joined(reply)

    def _joined(self, reply: list[Any]) -> dict[str, int]:
        self.held, self.last = 0, None
        names = ("created", "total_blocks", "block_size", "cap", "chunk", "lease_ms")
        info = {name: int(value) for name, value in zip(names, reply[1:], strict=False)}
        info["token_budget"] = int(reply[7])
        info["returned_blocks"] = int(reply[8])
        info["round_ms"] = int(reply[9])
        return info

    def leave(self) -> int:
        """Leave the pool; returns the blocks that went back."""
        self.held, self.last = 0, None
        return int(registry.call(self.client, POOL_LEAVE, self._keys, [self.member])[1])

    async def aleave(self) -> int:
        """:meth:`leave` on an asyncio client."""
        self.held, self.last = 0, None
        reply = await registry.acall(self.client, POOL_LEAVE, self._keys, [self.member])
        return int(reply[1])

    # -- the per-step call --------------------------------------------------------------------
    def step_args(
        self,
        *,
        active: bool,
        want_blocks: int = 0,
        release_blocks: int = 0,
        blocks_by_priority: Sequence[int] = (),
        ask: PreemptAsk | None = None,
        token_demand: int = 0,
    ) -> list[str]:
        """``ARGV`` of :data:`POOL_STEP`; see :meth:`step` for the arguments."""
        for label, value in (
            ("want_blocks", want_blocks),
            ("release_blocks", release_blocks),
            ("token_demand", token_demand),
        ):
            if not isinstance(value, int) or value < 0:
                raise InvalidRequest(f"{label} must be a non-negative integer, got {value!r}")
        use = [int(b) for b in blocks_by_priority]
        if len(use) > len(PRIORITIES) or any(b < 0 for b in use):
            raise InvalidRequest(f"blocks_by_priority must be up to 3 counts >= 0, got {use}")
        use += [0] * (len(PRIORITIES) - len(use))
        ask_p, ask_n = ("", "0") if ask is None else (str(int(ask.priority)), str(ask.num_blocks))
        return [
            self.member,
            str(self.weight_milli),
            "1" if active else "0",
            str(want_blocks),
            str(release_blocks),
            ask_p,
            ask_n,
            str(token_demand),
            *(str(b) for b in use),
        ]

    def step(self, **kwargs: Any) -> PoolGrant:
        """Acquire, release and heartbeat in one round trip.

        Keyword arguments: ``active`` (running or waiting work), ``want_blocks``,
        ``release_blocks``, ``blocks_by_priority`` (blocks used by running requests per
        priority, most urgent first), ``ask`` (a :class:`PreemptAsk` for the most urgent waiting
        request that cannot get blocks), ``token_demand`` (tokens wanted per round).
        """
        reply = registry.call(self.client, POOL_STEP, self._keys, self.step_args(**kwargs))
        return self._parsed(reply)

    step_request = step

    async def astep(self, **kwargs: Any) -> PoolGrant:
        """:meth:`step` on an asyncio client."""
        reply = await registry.acall(self.client, POOL_STEP, self._keys, self.step_args(**kwargs))
        return self._parsed(reply)

    def queue_step(self, pipeline: Any, **kwargs: Any) -> None:
        """Queue :meth:`step` into ``pipeline`` (made from ``client``); after it executes, pass
        that command's raw reply to :meth:`parse_step`."""
        registry.queue(self.client, pipeline, POOL_STEP, self._keys, self.step_args(**kwargs))

    def parse_step(self, raw_reply: Any) -> PoolGrant:
        """The :class:`PoolGrant` of a queued step's raw reply (raises the mapped error)."""
        return self._parsed(registry.check_reply(POOL_STEP, raw_reply))

    def release(self, num_blocks: int, **kwargs: Any) -> PoolGrant:
        """Give back ``num_blocks`` now (a step that acquires nothing)."""
        kwargs.setdefault("active", True)
        return self.step(release_blocks=num_blocks, **kwargs)

    def _parsed(self, reply: list[Any]) -> PoolGrant:
        grant = PoolGrant.from_reply(reply)
        self.held = grant.held
        self.last = grant
        return grant


# -- pool administration ----------------------------------------------------------------------
def create_pool(client: Any, keys: Keys, name: str, config: PoolConfig) -> bool:
    """Create the pool unless it exists with the same size; returns True if it was created.
    Raises ``PoolError`` if it exists with another total or block size."""
    reply = registry.call(client, POOL_CREATE, pool_keys(keys, name), config.args(name))
    return bool(int(reply[1]))


def advance_manual_clock(client: Any, keys: Keys, name: str, ms: int) -> int:
    """Move a manual-clock pool's clock forward by ``ms``; returns the new time (ms)."""
    if not isinstance(ms, int) or ms < 0:
        raise InvalidRequest(f"ms must be a non-negative integer, got {ms!r}")
    return int(registry.call(client, POOL_ADVANCE_CLOCK, pool_keys(keys, name), [str(ms)])[1])


def pool_names(client: Any, keys: Keys) -> list[str]:
    """Names of every pool created under this prefix, sorted."""
    return sorted(_text(n) for n in client.smembers(keys.pools))


def pool_snapshot(client: Any, keys: Keys, name: str) -> dict[str, Any]:
    """The pool as its next call will see it: settings, members (weight, held, entitlement,
    active, loan, token share, lease left) and pending preemptions. Read-only.

    Raises ``PoolError`` if the pool does not exist.
    """
    reply = registry.call(client, POOL_INSPECT, pool_keys(keys, name), [])
    view: dict[str, Any] = orjson.loads(reply[1])
    view["name"] = name
    # cjson writes an empty Lua table as {}: normalise the lists.
    for field in ("members", "preemptions"):
        if not isinstance(view.get(field), list):
            view[field] = []
    for member in view["members"]:
        member["weight"] = member.pop("weight_milli") / 1000
        member["active"] = bool(member["active"])
        if not isinstance(member["blocks_by_priority"], list):
            member["blocks_by_priority"] = []
    for order in view["preemptions"]:
        order["delivered"] = bool(order["delivered"])
    view["members"].sort(key=lambda m: m["name"])
    view["preemptions"].sort(key=lambda o: o["id"])
    view["free"] = view["total"] - view["held"]
    return view
