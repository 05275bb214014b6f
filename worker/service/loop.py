"""The worker's loop: timers → read → feed → step → publish → ack, until told to stop.

One iteration::

    heartbeat (every HEARTBEAT_INTERVAL_S), claim of dead workers' entries (every
    claim_interval_s), steal of aged routed work (routing_wiring); poll the intake within what
    the engine can admit now and feed the engine what it read and started (waiting on Redis
    only when the engine is idle); engine.step();
    poll the intake again (what arrived during the step; the round trip this sends has answered
    by the next iteration's poll, a publish later); read and apply the previous step's publish
    replies (the ack side), then send this step's publish (tokens, finishes, cancel check: one
    pipelined round trip) without waiting for its replies; abort what was cancelled.

The loop owns no per-request bookkeeping (``run_table``); its steps live in ``feed``, ``adapter``
and ``outbox``, the policies in ``step_failure``, ``handback`` and ``routing_wiring``.

With ``--kv-pool`` a ``PoolLink`` (docs/kv-pools.md) rides along: it applies the pool's last reply
before ``engine.step()`` (the engine's block limit, a preemption order), adds the pool step to the
same publish round trip, applies its reply with the publish's results, keeps the lease alive while
idle, and leaves the pool on shutdown.

One thread: the loop owns the engine, the run table, publishing and the intake's round trips
(``IntakeReader``: at most one read or start in flight on its own connection). Every round
trip is written without waiting and its reply is read at a later step boundary, so Redis works
while the engine computes and nothing competes with the engine for the GIL mid-step: a publisher
thread cost each first token about half a millisecond of wake-up and GIL hand-over, and an
intake thread made the step a request arrived in about 0.9 ms longer. A step's publish is
written as the step ends; its replies are read after the next step (one in flight, in order).

Redis outages (``outage.py``): a lost connection anywhere in an iteration pauses the loop (the
engine is not stepped, and keeps its state) until Redis answers again; then the heartbeat, the
consumer groups, the publishes not answered and the entries a lost round trip took are restored,
and the loop goes on where it was, with the held step's publish first. Nothing is lost because
an iteration's only Redis-independent progress, ``engine.step()``, is held in ``_held`` until
its events are in the outbox, which keeps every publish until Redis has answered it.

Shutdown (SIGTERM/SIGINT): stop reading and claiming; keep stepping and publishing for up to
``grace_s`` (a second signal ends the grace at once); hand back what is still running
(re-queued at the tail of its stream, resumed by any worker from its token list); remove the
heartbeat; return 0.
"""

from __future__ import annotations

import logging
import random
import signal
import time
from dataclasses import replace
from typing import Any

import redis

from tokenfleet.shared.errors import RedisUnavailable
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.redis_connect import redis_client
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.intake import Intake
from tokenfleet.worker.intake.claimer import Claimer
from tokenfleet.worker.intake.doorbell import wire_doorbell
from tokenfleet.worker.intake.reader import IntakeReader
from tokenfleet.worker.pool.link import pool_link
from tokenfleet.worker.publish.publisher import Publisher
from tokenfleet.worker.service.adapter import EngineAdapter, MakeParams, engine_sampling_params
from tokenfleet.worker.service.engine_port import EnginePort
from tokenfleet.worker.service.feed import PREPARED_POLL_S, Feeder
from tokenfleet.worker.service.handback import hand_back
from tokenfleet.worker.service.heartbeat import Heartbeat, tenants_running, worker_stats
from tokenfleet.worker.service.metrics import WorkerMetrics
from tokenfleet.worker.service.outage import (
    EXIT_REDIS_UNAVAILABLE,
    REDIS_DOWN,
    OutageRider,
    restore,
)
from tokenfleet.worker.service.outbox import Outbox
from tokenfleet.worker.service.repair import FinishedLedger, Repairer
from tokenfleet.worker.service.routing_wiring import wire_routing
from tokenfleet.worker.service.run_table import RunTable
from tokenfleet.worker.service.step_failure import EXIT_ENGINE_BROKEN, StepFailures
from tokenfleet.worker.worker_settings import (
    HEARTBEAT_INTERVAL_S,
    READ_BLOCK_MS,
    STARVATION_PULLS,
    WorkerSettings,
)

log = logging.getLogger(__name__)

CUT_POLL_S = 0.05  # after a step cut short for urgent work: how long to wait for it to be read


class WorkerService:
    """Runs one engine against the fleet's Redis until stopped (see the module docstring)."""

    def __init__(
        self,
        engine: EnginePort,
        settings: Settings,
        wsettings: WorkerSettings,
        *,
        client: redis.Redis | None = None,
        metrics: WorkerMetrics | None = None,
        make_params: MakeParams | None = None,
    ) -> None:
        settings = replace(settings, lane=wsettings.model_name)  # a cluster: the model's slot
        self.engine = engine
        self.settings = settings
        self.ws = wsettings
        self.client = client or redis_client(settings)
        keys = Keys.for_settings(settings)  # a cluster: the fleet's slot (registry, pools) apart
        self.fleet_client = redis_client(replace(settings, lane="")) if keys.laned else None
        self.metrics = metrics or WorkerMetrics(
            wsettings.model_name, tenant_labels=wsettings.metrics_tenants
        )
        name = wsettings.name
        self.intake = Intake(
            self.client,
            settings,
            model_name=wsettings.model_name,
            priorities=wsettings.priorities,
            worker_name=name,
            poison_limit=wsettings.poison_limit,
            starvation_pulls=STARVATION_PULLS,
        )
        self.table = RunTable()
        self.adapter = EngineAdapter(
            engine,
            make_params or engine_sampling_params,
            avg_prompt_tokens=float(wsettings.block_size),
        )
        self.pool = pool_link(engine, self.fleet_client or self.client, keys, wsettings)
        publisher = Publisher(
            self.client, settings, model_name=wsettings.model_name, worker_name=name
        )
        apart = self.fleet_client is not None  # (a pool step in a round trip of its own)
        repairer = (
            Repairer(
                self.client,
                publisher.keys,
                worker_name=name,
                ttl_s=settings.record_ttl_s,
                metrics=self.metrics,
            )
            if wsettings.repair_window_s > 0
            else None
        )
        self.outbox = Outbox(
            publisher,
            self.table,
            engine,
            self.metrics,
            self.pool,
            worker_name=name,
            apart=apart,
            repairer=repairer,
            ledger=FinishedLedger(wsettings.repair_window_s),
        )
        self.feed = Feeder(
            self.intake,
            IntakeReader(self.intake, block_ms=READ_BLOCK_MS),
            Claimer(self.client, self.intake.streams, claim_idle_s=wsettings.claim_idle_s),
            self.table,
            self.adapter,
            self.outbox,
            self.metrics,
            worker_name=name,
            slots_from_batch=wsettings.slots_from_batch,
        )
        self.failures = StepFailures(self.feed, self.outbox, worker_name=name)
        self.heartbeat = Heartbeat(
            self.client,
            settings,
            worker_name=name,
            model_name=wsettings.model_name,
            ttl_s=wsettings.heartbeat_ttl_s,
            fleet_client=self.fleet_client,
        )
        wire_routing(self.feed, self.heartbeat, engine, settings, wsettings)
        self.outage = OutageRider(
            self.client,
            worker_name=name,
            retry_s=settings.redis_retry_s,
            registry=self.metrics.registry,
            model_name=wsettings.model_name,
            probe_key=self.intake.keys.worker_probe(name),
            also=self.fleet_client if self.pool is not None else None,  # (pool calls go there)
        )
        self.doorbell = wire_doorbell(engine, self.client, self.intake.keys, wsettings)
        self._held: list[Any] | None = None  # a step's outputs not yet in the outbox
        self.stop_requested, self.exit_code = False, 0
        self._stop_at, self._hurry = 0.0, False
        self._kv_total = self._tokens_total = 0

    # -- control ------------------------------------------------------------------------------
    def request_stop(self, signum: int = 0, _frame: Any = None) -> None:
        """Begin a graceful shutdown (signal handler); a second call ends the grace period."""
        if self.stop_requested:
            log.info("worker %s: second signal: handing back at once", self.ws.name)
            self._hurry = True
            return
        log.info(
            "worker %s: stopping (signal %s): no new work, grace %.1fs",
            self.ws.name,
            signum,
            self.ws.grace_s,
        )
        self.stop_requested = True
        self._stop_at = time.monotonic()

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.request_stop)

    def run(self) -> int:
        """Serve until stopped; returns the process exit code."""
        try:
            return self._serve()
        except RedisUnavailable:  # outage.py has said why
            self.exit_code = EXIT_REDIS_UNAVAILABLE
            return self.exit_code

    def _start(self) -> int:
        """Join the fleet (groups, pool, first heartbeat, inherited entries); returns how many
        requests were found pending under this name from an earlier process."""
        while True:  # Redis may be starting too: wait for it like for any outage
            try:
                self.intake.streams.ensure_groups()
                if self.pool is not None:
                    self.pool.join(block_size=self.ws.block_size)  # limit 0 until a grant
                self._beat()  # first: from now on nobody else claims what this name holds
                inherited = self.feed.claimer.inherit()  # before the first read
                break
            except REDIS_DOWN as exc:
                self.outage.wait(exc, self._give_up)
        if inherited:
            log.warning(
                "worker %s: %d requests are pending under this name from an earlier process "
                "(crashed or killed); resuming them",
                self.ws.name,
                inherited,
            )
        log.info(
            "worker %s ready: model %s, priorities %s",
            self.ws.name,
            self.ws.model_name,
            ",".join(p.label for p in self.ws.priorities),
        )
        return inherited

    def _serve(self) -> int:
        inherited = self._start()
        now = time.monotonic()
        next_beat = now + HEARTBEAT_INTERVAL_S
        next_claim = now + (0.0 if inherited else random.uniform(0, self.ws.claim_interval_s))
        grace_deadline: float | None = None
        try:
            while True:
                try:
                    now = time.monotonic()
                    if self._held is not None:
                        self._publish_step()  # held by an outage: publish it first
                    if self.outbox.in_flight and not self.engine.has_unfinished():
                        self.outbox.flush()  # idle: apply the last results before blocking
                    if self.stop_requested and grace_deadline is None:
                        grace_deadline = now + self.ws.grace_s
                        self.feed.stop()  # started jobs run in the grace period
                    if now >= next_beat:
                        self._beat()
                        next_beat = now + HEARTBEAT_INTERVAL_S
                    if grace_deadline is None:
                        if now >= next_claim:
                            next_claim = now + self.feed.claim(self.ws.claim_interval_s)
                        timer = min(next_beat, next_claim, self.feed.steal(now))
                        idle = not self.engine.has_unfinished()
                        wait_s = timer - time.monotonic() if idle else 0.0
                        if idle and self.pool is not None:
                            wait_s = min(wait_s, self.pool.idle_tick())  # keeps the pool lease
                        self.feed.poll(max(0.0, wait_s))
                    if self.engine.has_unfinished():
                        self._step()
                        if self.exit_code:
                            break
                    elif grace_deadline is not None and not self.feed.add_prepared(PREPARED_POLL_S):
                        self.outbox.flush()  # (nothing left, not even a prompt being prepared)
                        break
                    if grace_deadline is not None and (
                        self._hurry or time.monotonic() >= grace_deadline
                    ):
                        self.hand_back_all()
                        break
                except REDIS_DOWN as exc:
                    self._ride_out(exc)
        finally:
            self._close()
        log.info("worker %s stopped (exit %d)", self.ws.name, self.exit_code)
        return self.exit_code

    # -- one engine step ----------------------------------------------------------------------
    def _step(self) -> None:
        doorbell = self.doorbell
        if doorbell is not None:
            doorbell.rang()  # a ring from before this step: the poll before it had its chance
            doorbell.arm()
        try:
            if self.pool is not None:
                self.pool.before_step()  # a preemption order from the last reply
            outputs = self.engine.step()
        except Exception as exc:
            if self.failures.failed(exc):
                self.exit_code = EXIT_ENGINE_BROKEN
            return
        if self.engine.last_step_stats.cut:  # urgent work is in Redis: read it in right now
            self.feed.poll(CUT_POLL_S)
        if any(out.new_token_ids for out in outputs):
            self.failures.produced_tokens()
        self._held = outputs
        self._publish_step()

    def _publish_step(self) -> None:
        """Publish the held step's outputs. On a Redis error they stay held until the step's
        events are in the outbox (which keeps them until Redis has answered)."""
        outputs = self._held
        assert outputs is not None
        # Read what arrived during the step now, before publishing: the round trip this sends
        # (a START, or the blocking read that follows a drained pull) has answered by the
        # loop's poll after the publish, so an arrival it finds joins the very next step
        # (polled only at the loop's top, it waited one step more).
        self.feed.poll()
        if self.table.early:
            self.feed.resolve_early({out.request_id for out in outputs})
        self.outbox.flush()  # the last Redis error possible before the events exist
        step = self.adapter.step_events(outputs, self.table)
        self._held = None
        num_new = self.outbox.send_step(step)  # queued even if Redis is away (outbox.py)
        for job in step.restarts:
            self.feed.add(job)
        self._tokens_total += num_new
        self.outbox.end_cancelled()
        stats = self.engine.last_step_stats
        self.heartbeat.note_step(stats.duration_s)
        self._kv_total = stats.num_kv_blocks_used + stats.num_kv_blocks_free or self._kv_total
        self.metrics.observe_step(
            time.time(), num_new, stats, self.engine.capacity(), self._kv_total
        )

    # -- Redis outages (outage.py) ------------------------------------------------------------
    def _ride_out(self, exc: BaseException) -> None:
        """Wait for Redis, then restore what this worker owns there; again on a new error."""
        while True:
            self.outage.wait(exc, self._give_up)
            try:
                self._restore()
                return
            except REDIS_DOWN as again:
                exc = again

    def _restore(self) -> None:
        self._beat("recovering")  # first: nobody claims this worker's requests from now on
        restore(self.intake.streams, self.pool, self.outbox, self.feed, worker_name=self.ws.name)
        self._beat()

    def _give_up(self) -> bool:
        """While waiting for Redis: a stop was asked and its grace period has passed."""
        late = self._hurry or time.monotonic() >= self._stop_at + self.ws.grace_s
        return self.stop_requested and late

    # -- shutdown and heartbeat ---------------------------------------------------------------
    def hand_back_all(self) -> None:
        """Abort every running request and re-queue it for another worker (one round trip)."""
        self.outbox.flush()
        self.feed.resolve_early(set(self.table.early))
        # started ones whose engine run was taken back, waiting to be added again, go too
        jobs = self.table.to_hand_back()
        if not jobs:
            return
        hand_back(self.client, self.intake.keys, self.engine, jobs, worker_name=self.ws.name)
        self.table.handed_back()

    def _close(self) -> None:
        """The intake's and the publisher's last round trips, then leave the pool and remove the
        heartbeat, whatever failed before."""
        if self.doorbell is not None:
            self.doorbell.close()
        self.feed.close()
        try:
            self.outbox.flush()
        except Exception:  # already failing: the heartbeat must still go
            log.exception("worker %s: publishing failed", self.ws.name)
        finally:
            self.outbox.close()
        if self.pool is not None:
            try:
                self.pool.leave()
            except redis.RedisError:
                log.exception("worker %s: could not leave its KV pool", self.ws.name)
        try:
            self.heartbeat.remove()
        except redis.RedisError:
            log.exception("worker %s: could not remove its heartbeat", self.ws.name)

    def _beat(self, redis_state: str = "ok") -> None:
        stats = worker_stats(
            self.ws,
            self.engine,
            running=len(self.table.jobs),
            kv_total=self._kv_total,
            tokens_total=self._tokens_total,
            stopping=self.stop_requested,
            metrics=self.metrics,
        )
        pool = {f"pool_{k}": v for k, v in self.pool.status.items()} if self.pool else {}
        tenants = tenants_running(job.entry.tenant for job in self.table.jobs.values())
        self.heartbeat.beat(
            {**stats, "redis_state": redis_state, **self.outage.beat_fields(), **pool, **tenants},
            serving=not self.stop_requested,  # a stopping worker takes no new work
        )
