"""The chunking policy (ask ahead in chunks, give back above a watermark): a pure function."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenfleet.shared.errors import InvalidRequest
from tokenfleet.worker.pool.chunking import BlockPlan, plan_blocks


@settings(max_examples=300, deadline=None)
@given(
    held=st.integers(0, 10_000),
    used=st.integers(0, 10_000),
    need=st.integers(0, 500),
    chunk=st.integers(1, 64),
    low=st.integers(0, 64),
    extra=st.integers(0, 128),
)
def test_spare_lands_between_the_watermarks(
    held: int, used: int, need: int, chunk: int, low: int, extra: int
) -> None:
    high = low + chunk + extra
    plan = plan_blocks(
        held=held, used=used, need=need, chunk=chunk, low_watermark=low, high_watermark=high
    )
    assert plan.want == 0 or plan.release == 0
    assert plan.want % chunk == 0
    assert 0 <= plan.release <= held
    spare = held + plan.want - plan.release - used - need
    if plan.want or plan.release:
        assert low <= spare <= high
    else:
        assert low <= held - used - need <= high
    # applying the plan and asking again changes nothing (no ping-pong)
    again = plan_blocks(
        held=held + plan.want - plan.release,
        used=used,
        need=need,
        chunk=chunk,
        low_watermark=low,
        high_watermark=high,
    )
    assert again == BlockPlan()


def test_defaults_ask_one_chunk_ahead() -> None:
    assert plan_blocks(held=0, used=0, need=1, chunk=16) == BlockPlan(want=16)
    assert plan_blocks(held=16, used=10, need=0, chunk=16) == BlockPlan(want=16)  # 6 < 8
    assert plan_blocks(held=16, used=10, need=0, chunk=16, low_watermark=4) == BlockPlan()
    assert plan_blocks(held=100, used=10, need=0, chunk=16) == BlockPlan(release=66)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"held": -1, "used": 0, "need": 0, "chunk": 4},
        {"held": 0, "used": 0, "need": 0, "chunk": 0},
        {"held": 0, "used": 0, "need": 0, "chunk": 4, "low_watermark": 2, "high_watermark": 5},
    ],
)
def test_bad_arguments(kwargs: dict[str, int]) -> None:
    with pytest.raises(InvalidRequest):
        plan_blocks(**kwargs)
