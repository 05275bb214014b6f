"""Retry-After from each queue's observed drain rate.

Workers count every request they start in ``P:drained`` (``Keys.drained``: queue member ->
starts so far; the ``START`` script increments it). A :class:`DrainMeter` samples that hash once
a second and keeps the last ``window_s`` of samples, so the rate is the fleet's, seen the same
way by every gateway process. On a cluster each model's counters are in the model's lane
(``shared.keys.Keys``), read one lane after another. A full queue frees a slot each time a
worker starts one of its requests: the wait for ``n`` slots is ``n / rate``.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import redis.asyncio

from tokenfleet.shared.cancellation import cancel_checkpoint, raise_if_cancelling
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.record import as_str

MAX_RETRY_AFTER_S = 600  # advice, not a promise: past this a client should rather look again


class DrainMeter:
    """Samples the fleet's start counters; answers how long until a queue has ``n`` free slots.

    Invariant: ``_samples[member]`` holds (monotonic time, count) pairs in time order, the
    oldest at most ``window_s`` older than the newest (plus one sample before it, so a rate is
    known as soon as two samples exist).
    """

    def __init__(
        self,
        redis_client: redis.asyncio.Redis,
        keys: Keys,
        *,
        window_s: float = 30.0,
        client_for: Callable[[str], redis.asyncio.Redis] | None = None,
    ) -> None:
        self._redis = redis_client
        self._keys = keys
        # a cluster: each model's counters are in its lane (the client of a key's slot)
        self._client_for = client_for or (lambda _key: redis_client)
        self.window_s = window_s
        self._samples: dict[str, deque[tuple[float, int]]] = {}
        self._started = time.monotonic()

    async def sample(self) -> None:
        """Read every queue's counter once (on a cluster, lane by lane) and record it."""
        raw: dict[Any, Any] = {}
        if not self._keys.laned:
            raw = await self._redis.hgetall(self._keys.drained)
        else:
            for model in sorted(await self._redis.smembers(self._keys.fleet.lanes)):
                key = self._keys.for_model(as_str(model) or "").drained
                try:
                    raw.update(await self._client_for(key).hgetall(key))
                except redis.RedisError as exc:  # one lane's primary down: the others count
                    raise_if_cancelling(exc)
        now = time.monotonic()
        for member, value in raw.items():
            try:
                count = int(as_str(value) or 0)
            except ValueError:
                continue
            samples = self._samples.setdefault(str(as_str(member)), deque())
            samples.append((now, count))
            while len(samples) > 2 and samples[1][0] < now - self.window_s:
                samples.popleft()

    async def run(self, interval_s: float = 1.0) -> None:
        """Sample forever (the app's lifespan runs it as a task); Redis errors skip a sample."""
        while True:
            cancel_checkpoint()
            try:
                await self.sample()
            except redis.RedisError as exc:
                raise_if_cancelling(exc)
            await asyncio.sleep(interval_s)

    def rate(self, model: str, priority: Priority) -> float:
        """Requests started per second from this queue over the window (0.0 if unknown)."""
        samples = self._samples.get(Keys.queue_member(model, priority))
        if not samples or len(samples) < 2:
            return 0.0
        (t0, c0), (t1, c1) = samples[0], samples[-1]
        return max(0, c1 - c0) / (t1 - t0) if t1 > t0 else 0.0

    def retry_after_s(self, model: str, priority: Priority, slots: int = 1) -> int:
        """Whole seconds until ``slots`` requests of this queue will have started at the
        observed rate: at least 1; when nothing drained over the window, the time observed so
        far (the window, or less just after start), capped at ``MAX_RETRY_AFTER_S``."""
        rate = self.rate(model, priority)
        if rate > 0:
            return max(1, min(MAX_RETRY_AFTER_S, math.ceil(slots / rate)))
        observed = min(self.window_s, time.monotonic() - self._started)
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(observed)))
