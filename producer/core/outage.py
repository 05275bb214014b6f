"""How a handle rides out a Redis outage (restart, stall, lost network), for both faces.

A handle's reads (``Handle.stream()`` / ``result()`` and their async twins) treat a lost
connection (``redis.ConnectionError``, ``redis.TimeoutError``: no reply within the client's socket
timeout) as an outage: they wait with exponential backoff and full jitter (``FIRST_S`` doubling
to ``CEILING_S``, each delay drawn between half and all of it, so that many clients do not
reconnect in lockstep) and try again from the durable record and token list, which is where a
reconnected reader resumes anyway (``cursor.py``: no gap, no duplicate). The shared pub/sub
connection reconnects on its own (``subscriptions.Backoff``) and re-subscribes every channel.

The wait is bounded: by the caller's ``timeout`` (builtin ``TimeoutError``, as without an
outage) and by ``Settings.redis_retry_s`` (``RedisUnavailable``, a ``redis.ConnectionError``);
0 retries forever. A closed client is not an outage: its error is raised at once.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import redis

from tokenfleet.shared.errors import RedisUnavailable

REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError)
FIRST_S = 0.05
CEILING_S = 2.0


class OutageClock:
    """The backoff of one read through one outage.

    Invariant: ``started`` is the monotonic time of the first failure (None before it); the
    delays double from ``FIRST_S`` up to ``CEILING_S`` (before jitter) and never run past the
    caller's deadline.
    """

    def __init__(
        self,
        retry_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        jitter: Callable[[], float] = random.random,
    ) -> None:
        self.retry_s = retry_s
        self.clock = clock
        self.jitter = jitter
        self.started: float | None = None
        self.attempt = 0

    def next_wait(self, cause: BaseException, until: float | None) -> float | None:
        """The pause before the next try after ``cause``; None when the caller's ``until``
        (monotonic) has passed.

        Raises:
            RedisUnavailable: the outage has lasted ``retry_s`` (when not 0).
        """
        now = self.clock()
        if self.started is None:
            self.started = now
        elapsed = now - self.started
        if self.retry_s and elapsed >= self.retry_s:
            raise RedisUnavailable(
                f"Redis unreachable for {elapsed:.1f}s (redis_retry_s = {self.retry_s:g}): {cause}"
            ) from cause
        bound = min(CEILING_S, FIRST_S * 2 ** min(self.attempt, 30))
        self.attempt += 1
        delay = bound * (0.5 + 0.5 * self.jitter())
        if until is not None:
            remaining = until - now
            if remaining <= 0:
                return None
            delay = min(delay, remaining)
        return delay
