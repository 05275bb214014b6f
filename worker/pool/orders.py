"""Cross-worker preemption: what a member asks the pool for, and the order a donor receives.

A member whose waiting request cannot get blocks adds a :class:`PreemptAsk` to its step; the pool
may file an order against a donor running strictly less urgent work, whose next reply carries it
once as a :class:`PreemptOrder` (docs/kv-pools.md, "Cross-worker preemption").
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenfleet.shared.errors import InvalidRequest
from tokenfleet.shared.priority import Priority


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
