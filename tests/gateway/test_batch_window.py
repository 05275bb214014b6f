"""The batch window W and the runner's pause after a failing driver, without Redis: the batch
queue's state comes from a stub ``queue_stats``, the clock is moved by hand."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest
import redis.asyncio

from tokenfleet.producer.gateway.batches import BatchRunner
from tokenfleet.producer.gateway.batches.driver import BatchDriver, DriveConfig
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.queue_config import OverflowPolicy, QueueStats
from tokenfleet.shared.settings import Settings


class StubQueues:
    """A client whose batch queue of model ``m`` has ``waiting`` of ``bound`` entries."""

    def __init__(self) -> None:
        self.waiting, self.bound = 0, 1000

    async def queue_stats(self) -> list[QueueStats]:
        return [
            QueueStats(
                "m",
                "batch",
                self.waiting,
                0,
                self.waiting,
                self.bound,
                OverflowPolicy.DROP_NEWEST,
                True,
            )
        ]


def _driver(queues: StubQueues, cap: int) -> BatchDriver:
    cfg = DriveConfig(
        client=cast(Any, queues),
        redis=cast(Any, None),
        keys=Keys("w"),
        token="t",
        lease_ms=1000,
        window=cap,
        adapt_s=0.0,
    )
    driver = BatchDriver(cfg, "batch_x")
    driver.model = "m"
    return driver


def test_the_window_halves_on_refusals_and_grows_back_from_one() -> None:
    queues = StubQueues()
    driver = _driver(queues, cap=64)

    async def body() -> list[int]:
        seen = [driver.window]
        for _ in range(5):  # 8 -> 4 -> 2 -> 1 -> 1 -> 1
            await driver._adapt(refused=True)
            seen.append(driver.window)
        queues.waiting = 0  # the fleet drains everything: W doubles again, up to its cap
        for _ in range(8):
            await driver._adapt()
            seen.append(driver.window)
        return seen

    assert asyncio.run(body()) == [8, 4, 2, 1, 1, 1, 2, 4, 8, 16, 32, 64, 64, 64]


def test_the_window_halves_when_the_batch_queue_passes_three_quarters_of_its_bound() -> None:
    queues = StubQueues()
    driver = _driver(queues, cap=64)

    async def body() -> list[int]:
        queues.bound, queues.waiting = 100, 80
        await driver._adapt()
        first = driver.window
        queues.waiting = 3  # neither drained (3 >= W/2 at W=4) nor over the bound: W stays
        await driver._adapt()
        return [first, driver.window]

    assert asyncio.run(body()) == [4, 4]


def test_a_failing_driver_is_taken_up_again_after_a_growing_pause(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = Settings(redis_url="redis://127.0.0.1:1", key_prefix="w")
    runner = BatchRunner(cast(Any, None), redis.asyncio.Redis(), settings, poll_s=0.5)
    now = [1000.0]
    monkeypatch.setattr("tokenfleet.producer.gateway.batches.runner.time.monotonic", lambda: now[0])

    async def failed() -> None:
        raise RuntimeError("boom")

    async def body() -> list[float]:
        pauses = []
        for _ in range(9):
            task = asyncio.create_task(failed())
            await asyncio.gather(task, return_exceptions=True)
            runner._ended("b", now[0], task)  # it failed at once
            pauses.append(runner._not_before["b"] - now[0])
        ok = asyncio.create_task(asyncio.sleep(0))
        await ok
        runner._ended("b", now[0], ok)  # a driver that ends well clears the count
        pauses.append(runner._not_before.get("b", now[0]) - now[0])
        return pauses

    assert asyncio.run(body()) == [0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 0.0]
