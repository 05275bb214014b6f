"""The suite's one wait: poll a condition until it holds, fail with what was awaited
(:func:`wait_for`; :func:`wait_for_async` where the condition is awaited in an event loop).

No test sleeps and hopes: each waits on a state, and the deadline is a failure guard only
(generous, so a loaded machine is slow, never wrong).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

DEADLINE_S = 120.0  # failure guard only: every wait polls for a state


def wait_for(
    check: Callable[[], Any], what: str, timeout_s: float = DEADLINE_S, poll_s: float = 0.02
) -> Any:
    """Call ``check`` every ``poll_s`` until it returns something truthy, and return that.
    ``AssertionError`` naming ``what`` once ``timeout_s`` has passed (``check`` is always called
    at least once, and once more at the deadline); an exception ``check`` raises goes through."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(poll_s)


async def wait_for_async(
    check: Callable[[], Awaitable[Any]],
    what: str,
    timeout_s: float = DEADLINE_S,
    poll_s: float = 0.02,
) -> Any:
    """:func:`wait_for` inside an event loop: ``check`` is awaited, and the pause between polls
    lets the loop's other tasks run."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(poll_s)
