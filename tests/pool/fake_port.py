"""Stand-ins for what ``PoolLink`` drives: the engine's pool port (``PoolPortLike``, answers
settable) and a monotonic clock that only ``sleep`` and the test move."""

from __future__ import annotations

from tokenfleet.shared.priority import Priority
from tokenfleet.worker.engine.outputs import StepStats


class FakePort:
    """Just the PoolPortLike surface, with settable answers."""

    def __init__(self) -> None:
        self.num_kv_blocks = 100
        self.num_used_blocks = 0
        self.num_blocks_wanted = 0
        self.has_work = False
        self.limit: int | None = None
        self.shortfall: tuple[Priority, int] | None = None
        self.orders: list[tuple[int, Priority]] = []
        self.num_tokens_wanted = 0
        self.last_step_stats = StepStats()
        self.token_limit: int | None = None

    def set_token_limit(self, num_tokens: int | None) -> None:
        self.token_limit = num_tokens

    def set_kv_block_limit(self, num_blocks: int | None) -> None:
        self.limit = num_blocks

    def blocks_by_priority(self) -> list[int]:
        return [0, 0, self.num_used_blocks]

    def kv_block_shortfall(self) -> tuple[Priority, int] | None:
        return self.shortfall

    def preempt_for_pool(self, num_blocks: int, priority: Priority) -> int:
        self.orders.append((num_blocks, priority))
        return num_blocks


class FakeTime:
    """A monotonic clock that only ``sleep`` (and the test) moves."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.slept.append(seconds)
        self.now += seconds
