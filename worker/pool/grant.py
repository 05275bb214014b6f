"""The pool's answer to one step: :class:`PoolGrant`, parsed from the ``pool_step`` reply."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenfleet.shared.priority import Priority
from tokenfleet.worker.pool.orders import PreemptOrder


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


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
        """Parse a checked ``POOL_STEP`` reply (:mod:`tokenfleet.shared.pool.scripts`; status
        code first)."""
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
