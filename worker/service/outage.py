"""Riding out a Redis outage: the worker waits for Redis, restores what it owns there, goes on.

Redis can restart (crash, upgrade, failover), stall (a fork on a big instance, a paused VM,
SIGSTOP) or become unreachable. None of these is a reason for a worker to exit: its model is
loaded, its engine holds requests part way through, and Redis (with AOF) still has every token
it acknowledged. So a lost connection anywhere in the loop (``redis.ConnectionError`` or
``redis.TimeoutError``: no reply within ``Settings.redis_socket_timeout_s``) is an outage to
ride out:

1. **Pause.** The loop stops stepping the engine: a step's tokens can only reach clients through
   Redis, so computing more would only pile up work that must be replayed. The engine keeps its
   state (running requests, KV cache); nothing is aborted.
2. **Wait** (:class:`OutageRider`): every pooled connection is dropped, then ``PING`` is retried
   (after a refused or unconfirmed write — ``ReplicationLagged``: ``min-replicas-to-write`` or
   ``WAIT`` — a write probe too: ``SET`` of the worker's probe key with a 1 s TTL, then the
   ``WAIT`` the client asks for, so a primary that answers PING but refuses writes or cannot
   replicate keeps the worker waiting rather than spinning through restores; the write must
   change something: from Redis 7.2 a ``WAIT`` after a write that replicated nothing is
   confirmed at once) with exponential backoff and full jitter
   (``BACKOFF_FIRST_S`` doubling to ``BACKOFF_CEILING_S``, each delay drawn between half and all
   of it, so that a fleet does not reconnect in lockstep), for at most
   ``Settings.redis_retry_s`` (0: forever); then the worker exits with status
   ``EXIT_REDIS_UNAVAILABLE`` for its supervisor. A stop asked meanwhile ends the wait after the
   grace period. Logs say when the outage began, every
   ``REPORT_EVERY_S`` that it goes on, and when Redis is back; the metric
   ``tokenfleet:redis_connected`` is 0 for as long as the worker waits ("waiting for Redis"),
   and ``tokenfleet:redis_outages_total`` / ``tokenfleet:redis_outage_seconds_total`` count them.
3. **Restore** (``WorkerService._restore``), in this order: the heartbeat first (from then on
   nobody claims this worker's requests), with ``redis_state`` = ``recovering``; the consumer
   groups (``XGROUP CREATE ... MKSTREAM``, ``BUSYGROUP`` ignored: a Redis that lost its data lost
   them too) and the queue index; then the repair of what a rollback took (``repair.py``); then
   every publish whose replies did not come is sent again
   (``publish/publisher.py``: each part of it is idempotent for the same worker, so it does not
   matter whether Redis ran the first one), and the results applied: requests another worker
   took over meanwhile (the heartbeat lapsed during a long outage), or whose record Redis lost,
   answer ``lost`` and are dropped here; last, the intake forgets the round trip it had in
   flight and every entry pending under this worker's name that it does not run is started
   again (``Feeder.reconcile``: it resolves early starts whose ``START`` answer was lost;
   ``START`` resumes a request from its token list, or ends one that ended meanwhile). A Redis
   error during the restore goes back to 2. Then stepping resumes, beginning with the step whose
   publish was held, if any.

What Redis forgot (a failover, a restart from an older snapshot or without AOF) the worker puts
back before it sends anything again (``service/repair.py``, ``Outbox.repair_all``): the requests
it runs and those it ended within ``repair_window_s``. A KV pool lost with Redis's data must be
created again by an operator; a member whose lease lapsed is re-registered by its next pool step.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import redis
from prometheus_client import CollectorRegistry, Counter, Gauge

from tokenfleet.shared import replica_wait
from tokenfleet.shared.errors import RedisUnavailable

if TYPE_CHECKING:
    from tokenfleet.worker.intake.streams import PriorityStreams
    from tokenfleet.worker.service.feed import Feeder
    from tokenfleet.worker.service.outbox import Outbox, PoolSteps

log = logging.getLogger(__name__)

REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError)  # what starts an outage
EXIT_REDIS_UNAVAILABLE = 5  # the worker gave up waiting for Redis (Settings.redis_retry_s)
BACKOFF_FIRST_S = 0.05
BACKOFF_CEILING_S = 2.0
REPORT_EVERY_S = 10.0


class OutageRider:
    """Waits for an unreachable Redis with bounded, jittered backoff; logs and counts outages.

    Invariant: ``connected`` is False exactly while :meth:`wait` runs (the gauge follows it);
    ``outages`` and ``waited_s`` only grow.
    """

    def __init__(
        self,
        client: redis.Redis,
        *,
        worker_name: str,
        retry_s: float,
        registry: CollectorRegistry,
        model_name: str,
        probe_key: str = "",
        also: redis.Redis | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        jitter: Callable[[], float] = random.random,
    ) -> None:
        self.client = client
        self.also = also  # a cluster: the fleet's slot, when the worker needs it (a KV pool)
        self.probe_key = probe_key  # written (SET, 1 s TTL) to test that writes go through
        self.worker_name = worker_name
        self.retry_s = retry_s  # 0: forever
        self.clock = clock
        self.sleep = sleep
        self.jitter = jitter
        self.connected = True
        self.outages = 0
        self.waited_s = 0.0
        self._connected = Gauge(
            "tokenfleet:redis_connected",
            "1 while the worker reaches Redis; 0 while it waits for Redis (an outage).",
            ["model_name"],
            registry=registry,
        ).labels(model_name)
        self._connected.set(1)
        self._outages = Counter(
            "tokenfleet:redis_outages",
            "Redis outages this worker rode out (or gave up on).",
            ["model_name"],
            registry=registry,
        ).labels(model_name)
        self._outage_seconds = Counter(
            "tokenfleet:redis_outage_seconds",
            "Seconds spent waiting for Redis.",
            ["model_name"],
            registry=registry,
        ).labels(model_name)

    def beat_fields(self) -> dict[str, int | float]:
        """What the heartbeat says of the outages ridden out: how many, and seconds waited."""
        return {"redis_outages": self.outages, "redis_outage_s": round(self.waited_s, 1)}

    def delay(self, attempt: int) -> float:
        """The pause before retry ``attempt`` (0, 1, ...): full jitter over a doubling bound."""
        bound = min(BACKOFF_CEILING_S, BACKOFF_FIRST_S * 2 ** min(attempt, 30))
        return bound * (0.5 + 0.5 * self.jitter())

    def _probe(self, writes: bool) -> None:
        """``PING``; with ``writes`` (this outage met a write refused or not replicated:
        ``ReplicationLagged``), a write and the client's ``WAIT`` too. Raises a ``REDIS_DOWN``
        error while Redis is not back (``also``: that one must answer too)."""
        self.client.ping()
        if self.also is not None:
            self.also.ping()
        if not (writes and self.probe_key):
            return
        wait = replica_wait.wait_of(self.client)
        pipe = self.client.pipeline(transaction=False)
        pipe.set(self.probe_key, 1, px=1000)  # NOREPLICAS (ReplicationLagged) if refused
        if wait is not None:
            pipe.execute_command("WAIT", wait.num_replicas, wait.timeout_ms)
        replies = pipe.execute()
        if wait is not None:
            replica_wait.check(wait, replies[-1])

    def wait(self, cause: BaseException, give_up: Callable[[], bool] = lambda: False) -> float:
        """Block until Redis answers ``PING`` again (and, after a refused or unconfirmed
        write, takes and replicates a write: :meth:`_probe`); returns the seconds waited.

        Raises:
            RedisUnavailable: ``retry_s`` passed (when not 0), or ``give_up()`` said so.
        """
        start = self.clock()
        self.connected = False
        self.outages += 1
        self._connected.set(0)
        self._outages.inc()
        limit = f"for up to {self.retry_s:g}s" if self.retry_s else "until it answers"
        log.warning(
            "worker %s: lost Redis (%s: %s); engine paused, retrying %s",
            self.worker_name,
            type(cause).__name__,
            cause,
            limit,
        )
        attempt = 0
        writes = False
        next_report = start + REPORT_EVERY_S
        try:
            while True:
                self.client.connection_pool.disconnect()  # every pooled socket is suspect
                if self.also is not None:
                    self.also.connection_pool.disconnect()
                writes = writes or isinstance(cause, replica_wait.ReplicationLagged)
                try:
                    self._probe(writes)
                    break
                except REDIS_DOWN as exc:
                    cause = exc
                now = self.clock()
                if (self.retry_s and now - start >= self.retry_s) or give_up():
                    log.error(
                        "worker %s: Redis unreachable for %.1fs (%s); giving up",
                        self.worker_name,
                        now - start,
                        cause,
                    )
                    raise RedisUnavailable(
                        f"Redis unreachable for {now - start:.1f}s: {cause}"
                    ) from cause
                if now >= next_report:
                    log.warning(
                        "worker %s: still waiting for Redis (%.0fs): %s",
                        self.worker_name,
                        now - start,
                        cause,
                    )
                    next_report = now + REPORT_EVERY_S
                self.sleep(self.delay(attempt))
                attempt += 1
        finally:
            waited = self.clock() - start
            self.waited_s += waited
            self._outage_seconds.inc(waited)
        self.connected = True
        self._connected.set(1)
        log.warning(
            "worker %s: Redis answers again after %.1fs; restoring groups, heartbeat and publishes",
            self.worker_name,
            waited,
        )
        return waited


def restore(
    streams: PriorityStreams,
    pool: PoolSteps | None,
    outbox: Outbox,
    feed: Feeder,
    *,
    worker_name: str,
) -> None:
    """Step 3 of the module docstring after the heartbeat (the caller beats before and after):
    consumer groups, publishes not answered, the intake's lost round trip and orphans."""
    streams.ensure_groups()
    if pool is not None:
        pool.abandon()  # a pool call is never sent again (publisher.py)
    outbox.repair_all()  # first: what a rollback took, put back (repair.py), so that
    outbox.flush()  # every publish not answered, sent again, finds its list where it left it
    outbox.close()  # the next step's publish opens a fresh connection (the old one may be dead)
    restarted = feed.reconcile()
    log.warning(
        "worker %s: restored after the Redis outage: %d requests running, %d entries started again",
        worker_name,
        len(outbox.table.jobs),
        restarted,
    )
