"""A pool's settings and limits: what ``tokenfleet pool create`` (or a first member) writes.

The limits keep every product in the scripts below 2**53, so Lua's doubles compute floors and
remainders exactly. ``lua/prelude.lua`` mirrors ``DEFAULT_ROUND_MS`` and ``MAX_MEMBERS`` (a test
checks that they agree).
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenfleet.shared.errors import InvalidRequest

MAX_TOTAL_BLOCKS = 100_000_000
MAX_MEMBERS = 256
MAX_WEIGHT = 100.0
DEFAULT_ROUND_MS = 100  # a compute share's period when the pool was created without one
CLOCKS = ("redis", "manual")


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """A pool's settings, validated; what ``tokenfleet pool create`` (or a first member) writes.

    Attributes:
        total_blocks: the pool's size in KV blocks of ``block_size`` tokens.
        block_size: tokens per KV block; every member must use the same.
        cap_permille: no member is entitled to more than this share of the total (thousandths).
        chunk_blocks: the step in which members ask ahead and the fairness tolerance.
        lease_ms: a member's holding lapses this long after its last call.
        preempt_ms: a preemption order lapses if the donor has not released within this time.
        token_budget: tokens per round split between members by weight (0: no compute share):
            what the shared device computes in ``round_ms``.
        round_ms: the compute share's period: a member computes at most its share of
            ``token_budget`` per ``round_ms`` of wall time.
        clock: ``redis`` (server ``TIME``) or ``manual`` (advanced only by
            ``POOL_ADVANCE_CLOCK`` of :mod:`tokenfleet.shared.pool.scripts`; for deterministic
            tests and simulations).
    """

    total_blocks: int
    block_size: int = 16
    cap_permille: int = 900
    chunk_blocks: int = 16
    lease_ms: int = 5_000
    preempt_ms: int = 2_000
    token_budget: int = 0
    clock: str = "redis"
    round_ms: int = DEFAULT_ROUND_MS

    def __post_init__(self) -> None:
        _check_int("total_blocks", self.total_blocks, 1, MAX_TOTAL_BLOCKS)
        _check_int("block_size", self.block_size, 1, 1 << 16)
        _check_int("cap_permille", self.cap_permille, 1, 1000)
        _check_int("chunk_blocks", self.chunk_blocks, 1, self.total_blocks)
        _check_int("lease_ms", self.lease_ms, 1, 86_400_000)
        _check_int("preempt_ms", self.preempt_ms, 1, 86_400_000)
        _check_int("token_budget", self.token_budget, 0, 1 << 30)
        _check_int("round_ms", self.round_ms, 1, 60_000)
        if self.clock not in CLOCKS:
            raise InvalidRequest(f"clock must be one of {', '.join(CLOCKS)}, got {self.clock!r}")

    def args(self, name: str) -> list[str]:
        """The ten settings arguments of ``POOL_CREATE`` (``ARGV[1..10]``;
        :mod:`tokenfleet.shared.pool.scripts`)."""
        return [
            str(self.total_blocks),
            str(self.block_size),
            str(self.cap_permille),
            str(self.chunk_blocks),
            str(self.lease_ms),
            str(self.preempt_ms),
            str(self.token_budget),
            self.clock,
            name,
            str(self.round_ms),
        ]


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise InvalidRequest(f"{name} must be an integer in [{low}, {high}], got {value!r}")


def weight_milli(weight: float) -> int:
    """A share weight in thousandths, as the scripts store it; ``InvalidRequest`` if out of
    range (0.001 to 100)."""
    if isinstance(weight, bool) or not isinstance(weight, int | float):
        raise InvalidRequest(f"share weight must be a number, got {weight!r}")
    milli = round(weight * 1000)
    if not 1 <= milli <= round(MAX_WEIGHT * 1000):
        raise InvalidRequest(f"share weight must be between 0.001 and {MAX_WEIGHT:g}, got {weight}")
    return milli
