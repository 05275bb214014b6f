"""The chunking policy: ask ahead in whole chunks, give back surplus above a watermark."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tokenfleet.shared.errors import InvalidRequest


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
