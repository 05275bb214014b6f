"""``LiveFeed``: one reading of the fleet per period for every console open on this process.

While at least one console listens, a single task takes a snapshot every ``refresh_s`` and
hands the same one to every listener, so the Redis reads per period do not grow with the number
of open consoles; with none open, nothing is read at all (the console costs nothing closed).
Each snapshot also feeds the queues' depth history (the sparklines): ``(time, waiting)`` per
queue, kept ``HISTORY_S`` seconds, in this process only (a console opened on another gateway
starts its own).

Invariants: at most one reading task runs; it stops within one period of the last listener
leaving; a failed reading (Redis away) is handed out as an error and retried next period, so
the page says why it stopped moving instead of freezing.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import redis

log = logging.getLogger(__name__)

HISTORY_S = 600.0  # the sparklines' span


@dataclass(frozen=True, slots=True)
class Reading:
    """One period's outcome: the snapshot, or why there is none (``error``)."""

    number: int
    snapshot: dict[str, Any] | None
    error: str = ""


class LiveFeed:
    """Shares periodic snapshots between listeners (module docstring)."""

    def __init__(self, take: Callable[[], Awaitable[dict[str, Any]]], refresh_s: float) -> None:
        self._take = take
        self.refresh_s = refresh_s
        self._listeners = 0
        self._latest: Reading | None = None
        self._changed = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None
        self.history: dict[str, deque[tuple[float, int]]] = {}

    @property
    def listeners(self) -> int:
        """Consoles listening now."""
        return self._listeners

    async def listen(self) -> AsyncIterator[Reading]:
        """Each new reading, the latest one first if there is one, until the caller stops."""
        self._listeners += 1
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())
        try:
            seen = -1
            while True:
                async with self._changed:
                    await self._changed.wait_for(functools.partial(self._newer_than, seen))
                    reading = self._latest
                if reading is None:  # (wait_for returned: it is set)
                    continue
                seen = reading.number
                yield reading
        finally:
            self._listeners -= 1

    def _newer_than(self, seen: int) -> bool:
        return self._latest is not None and self._latest.number != seen

    async def _run(self) -> None:
        number = 0
        while self._listeners > 0:
            number += 1
            try:
                reading = Reading(number, await self._take())
                self._remember(reading.snapshot)
            except (redis.RedisError, OSError) as exc:
                reading = Reading(number, None, f"waiting for Redis: {exc}")
            except Exception as exc:  # the page says so; the next period tries again
                log.exception("console: reading the fleet failed")
                reading = Reading(number, None, f"{type(exc).__name__}: {exc}")
            async with self._changed:
                self._latest = reading
                self._changed.notify_all()
            await asyncio.sleep(self.refresh_s)
        self._task = None

    def _remember(self, snapshot: dict[str, Any] | None) -> None:
        """Add each queue's waiting count to its history; forget what is older than
        ``HISTORY_S``."""
        if snapshot is None:
            return
        status = snapshot["status"]
        at = float(status["at"])
        for q in status["queues"]:
            name = f"{q['model']}|{q['priority']}"
            points = self.history.setdefault(name, deque())
            points.append((at, int(q["waiting"])))
            while points and points[0][0] < at - HISTORY_S:
                points.popleft()

    def series(self) -> dict[str, list[list[float]]]:
        """The history as uPlot data per queue: ``[[times...], [waiting...]]``."""
        return {
            name: [[t for t, _ in points], [float(n) for _, n in points]]
            for name, points in self.history.items()
        }

    async def close(self) -> None:
        """Stop the reading task (the app's shutdown)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
