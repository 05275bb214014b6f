"""A worker's client for a shared KV pool (issue 6): one script call per engine step.

The worker service owns one :class:`KVPoolMember`. Every step it calls :meth:`KVPoolMember.step`
(or queues :meth:`KVPoolMember.queue_step` into its publishing pipeline and parses the reply with
:meth:`KVPoolMember.parse_step`); that call is also the member's heartbeat. The reply, a
:class:`~tokenfleet.worker.pool.grant.PoolGrant`, is the engine's budget: ``held`` blocks, to
shrink to ``release_to``, and possibly a preemption order to execute before the next step.
:func:`~tokenfleet.worker.pool.chunking.plan_blocks` is the chunking policy.

The accounting rules live in :mod:`tokenfleet.shared.pool.scripts`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenfleet.shared.errors import InvalidRequest
from tokenfleet.shared.keys import Keys, check_name
from tokenfleet.shared.pool.scripts import POOL_JOIN, POOL_LEAVE, POOL_STEP, pool_keys
from tokenfleet.shared.priority import PRIORITIES
from tokenfleet.shared.scripts import registry
from tokenfleet.worker.pool.config import PoolConfig, weight_milli
from tokenfleet.worker.pool.grant import PoolGrant
from tokenfleet.worker.pool.orders import PreemptAsk


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
