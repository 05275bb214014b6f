"""``BatchRunner``: drives every active batch, one lease per batch, any number of runners.

Every ``poll_s`` a runner reads ``P:batches:active`` and, for each batch it does not drive yet,
tries to take the batch's lease (``SET NX PX``; its own token). While it drives (see
``driver``) it renews the lease every third of its lifetime; a runner that dies stops renewing,
the lease lapses after ``lease_ms``, and the next runner to look takes the batch over and
re-attaches its lines by request id. Two runners overlapping (a paused one whose lease lapsed)
is harmless: the ledger script writes each line once.

Run one in a process of its own with ``python -m tokenfleet.producer.gateway.batches.runner``
(``REDIS_URL`` or ``--redis-url``, and ``TOKENFLEET_KEY_PREFIX``, as for every tokenfleet process).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import os
import time

import redis
import redis.asyncio

from tokenfleet.producer.async_client import AsyncClient
from tokenfleet.producer.gateway.batches.driver import BatchDriver, DriveConfig
from tokenfleet.producer.gateway.batches.scripts import LEASE
from tokenfleet.producer.gateway.batches.store import BatchStore
from tokenfleet.producer.gateway.settings import (
    DEFAULT_BATCH_LEASE_MS,
    DEFAULT_BATCH_WINDOW,
    MIN_BATCH_LEASE_MS,
    BatchRunnerSettings,
)
from tokenfleet.shared.cancellation import cancel_checkpoint, raise_if_cancelling
from tokenfleet.shared.errors import SettingsError, TokenfleetError
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.record import as_str
from tokenfleet.shared.redis_connect import async_redis_client
from tokenfleet.shared.redis_flags import add_redis_flags, settings_from_flags
from tokenfleet.shared.scripts.registry import acall
from tokenfleet.shared.settings import Settings
from tokenfleet.shared.settings_flags import add_flags, flag_values

log = logging.getLogger(__name__)
DEFAULT_LEASE_MS = DEFAULT_BATCH_LEASE_MS
DEFAULT_WINDOW = DEFAULT_BATCH_WINDOW
_MAX_PAUSE_S = 30.0  # the longest pause before a failing batch is driven again
_FAILURE_RESET_S = 30.0  # a driver that ran this long before failing starts the count afresh


class BatchRunner:
    """Drives the fleet's active batches (see the module docstring)."""

    def __init__(
        self,
        client: AsyncClient,
        redis: redis.asyncio.Redis,
        settings: Settings,
        *,
        window: int = DEFAULT_WINDOW,
        lease_ms: int = DEFAULT_LEASE_MS,
        poll_s: float = 0.5,
        default_max_tokens: int = 256,
        store: BatchStore | None = None,
        only: frozenset[str] | None = None,
    ) -> None:
        """``store``: validates batches whose creating gateway died mid-validation (with its
        line limits); default: a store with the default limits. ``only``: drive just these
        batches (a ``wait()`` drives its own batch, not every batch of the fleet)."""
        if window < 1 or lease_ms < MIN_BATCH_LEASE_MS:
            raise ValueError(f"window must be >= 1 and lease_ms >= {MIN_BATCH_LEASE_MS}")
        store = store or BatchStore(
            redis, settings, default_max_tokens=default_max_tokens, lease_ms=lease_ms
        )
        self.cfg = DriveConfig(
            client=client,
            redis=redis,
            keys=Keys.for_settings(settings),
            token=os.urandom(12).hex(),
            lease_ms=lease_ms,
            window=window,
            default_max_tokens=default_max_tokens,
            validate=store.validate,
        )
        self.poll_s = poll_s
        self.only = only
        self.drivers: dict[str, BatchDriver] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        # a driver that failed is taken up again after a pause that doubles with each failure in
        # a row (0.5 s, 1 s, ... 30 s): a batch that fails the same way is not retried in a hot loop
        self._failures: dict[str, int] = {}
        self._not_before: dict[str, float] = {}

    async def run(self) -> None:
        """Look for batches every ``poll_s``, forever (cancel the task to stop)."""
        try:
            while True:
                cancel_checkpoint()
                try:
                    await self.tick()
                except (redis.RedisError, TokenfleetError) as exc:
                    raise_if_cancelling(exc)
                    log.warning("batch runner: %s; trying again", exc)
                await asyncio.sleep(self.poll_s)
        finally:
            await self.aclose()

    async def tick(self) -> None:
        """Take the lease of every active batch nobody drives, and start driving it."""
        k, r = self.cfg.keys, self.cfg.redis
        now = time.monotonic()
        for raw in await r.smembers(k.batches_active):
            bid = as_str(raw) or ""
            if bid in self._tasks or (self.only is not None and bid not in self.only):
                continue
            if now < self._not_before.get(bid, 0.0):
                continue
            lease = k.batch_lease(bid)
            took = await r.set(lease, self.cfg.token, nx=True, px=self.cfg.lease_ms)
            if not took:  # ours still (a driver of ours that stopped on an error)?
                took = (await acall(r, LEASE, [lease], [self.cfg.token, self.cfg.lease_ms]))[
                    0
                ] == "ok"
            if took:
                driver = BatchDriver(self.cfg, bid)
                task = asyncio.get_running_loop().create_task(driver.run())
                self.drivers[bid], self._tasks[bid] = driver, task
                task.add_done_callback(functools.partial(self._ended, bid, now))

    def _ended(self, bid: str, started: float, task: asyncio.Task[None]) -> None:
        self._tasks.pop(bid, None)
        if task.cancelled() or task.exception() is None:
            self._failures.pop(bid, None)
            self._not_before.pop(bid, None)
            return
        ran_s = time.monotonic() - started
        failures = 1 if ran_s > _FAILURE_RESET_S else self._failures.get(bid, 0) + 1
        pause = 0.0 if failures == 1 else min(_MAX_PAUSE_S, self.poll_s * 2 ** (failures - 2))
        self._failures[bid], self._not_before[bid] = failures, time.monotonic() + pause
        log.warning(
            "batch %s: driver stopped: %r (taken up again in %.1f s)", bid, task.exception(), pause
        )

    async def aclose(self) -> None:
        """Stop driving (the leases lapse; the requests go on for whoever drives next)."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


async def _main(own: BatchRunnerSettings, settings: Settings) -> None:
    async with AsyncClient.from_url(settings=settings) as client:
        r = async_redis_client(settings)
        try:
            runner = BatchRunner(client, r, settings, window=own.window, lease_ms=own.lease_ms)
            await runner.run()
        finally:
            await r.aclose()


def main(argv: list[str] | None = None) -> None:
    """``python -m tokenfleet.producer.gateway.batches.runner [--window N] [--lease-ms MS]``
    and the Redis connection flags; bad settings exit 1 with one line naming them."""
    parser = argparse.ArgumentParser(
        prog="python -m tokenfleet.producer.gateway.batches.runner",
        description="Drive the fleet's Batch API batches.",
    )
    add_flags(parser, BatchRunnerSettings)
    add_redis_flags(parser)
    args = parser.parse_args(argv)
    try:
        own = BatchRunnerSettings(**flag_values(args, BatchRunnerSettings))
        settings = settings_from_flags(args)
    except SettingsError as exc:
        parser.exit(1, f"{parser.prog}: {exc}\n")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_main(own, settings))


if __name__ == "__main__":
    main()
