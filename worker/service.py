"""The worker's loop: timers → intake → engine step → intake → publish → cancellations, until told
to stop.

One iteration::

    heartbeat (every heartbeat_interval_s) and claim of dead workers' entries (every
    claim_interval_s); poll the intake within what the engine can admit now and add what it
    read and started (waiting on Redis only when the engine is idle); engine.step(); poll the
    intake again (what arrived during the step; the round trip this sends has answered by the
    next iteration's poll, a publish later); read and apply the previous step's publish
    replies, then send this step's publish (tokens, finishes, cancel check: one pipelined round
    trip) without waiting for its replies; abort what was cancelled.

With ``--kv-pool`` a ``PoolLink`` (docs/kv_pools.md) rides along: it applies the pool's last reply
before ``engine.step()`` (the engine's block limit, a preemption order), adds the pool step to the
same publish round trip, applies its reply with the publish's results, keeps the lease alive while
idle, and leaves the pool on shutdown.

One thread: the loop owns the engine, ``jobs``, publishing and the intake's round trips
(``reader.IntakeReader``: at most one read or start in flight on its own connection). Every round
trip is written without waiting and its reply is read at a later step boundary, so Redis works
while the engine computes and nothing competes with the engine for the GIL mid-step: a publisher
thread cost each first token about half a millisecond of wake-up and GIL hand-over, and an
intake thread made the step a request arrived in about 0.9 ms longer. A step's publish is
written the moment the step ends and its replies are read after the next step (one in flight,
in step order).

Step-exception policy: an exception raised by ``engine.step()`` gives every request in the
engine a terminal ``error`` event (code ``engine_error``), aborts them, and the worker keeps
serving. After ``MAX_CONSECUTIVE_STEP_FAILURES`` failed steps with no token produced in between
the engine is deemed broken: the worker removes its heartbeat and exits with
``EXIT_ENGINE_BROKEN`` so that its supervisor restarts it (its requests have already ended,
so nothing is left to recover).

Shutdown (SIGTERM/SIGINT): stop reading and claiming; keep stepping and publishing for up to
``grace_s`` (a second signal ends the grace at once); hand back what is still running
(re-queued at the tail of its stream, resumed by any worker from its token list); remove the
heartbeat; return 0.

Early start (``reader``): a new request goes into the engine as soon as it is read, while its
``START`` is on the wire, so that it joins the step that begins meanwhile; nothing is published
for it until ``START`` has answered. Answered ok, it becomes a job; refused (cancelled, expired,
...), it is aborted in the engine and its outputs are dropped; answered ok with tokens to resume
from (a handback from an older worker that did not mark its entry), it is aborted and added
again, with its tokens, once the engine has reported the abort. A step whose outputs include an
early request waits for that answer first (it left before the step began).

Invariant: ``jobs`` holds exactly the requests this worker owns in Redis (record ``running``
with its name) and has added to its engine, except those in ``_aborting`` waiting to be added
again; a request leaves ``jobs`` only once it is finished, handed back, or found to be owned by
another worker. ``_early`` holds the requests in the engine whose ``START`` has not answered;
``_aborting`` those aborted in the engine whose end it has not reported yet (their outputs are
dropped), no id being in two of the three.
"""

from __future__ import annotations

import logging
import math
import random
import signal
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol, cast

import redis

from tokenfleet.shared.errors import InvalidRequest
from tokenfleet.shared.keys import CONSUMER_GROUP, Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.schema import GenerationRequest, TerminalEvent, TerminalStatus, TokenEvent
from tokenfleet.shared.scripts import registry
from tokenfleet.shared.scripts.worker import HANDBACK
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.heartbeat import Heartbeat
from tokenfleet.worker.intake import Entry, Intake, Job, StartReport
from tokenfleet.worker.intake.claimer import Claimer
from tokenfleet.worker.intake.jobs import record_published
from tokenfleet.worker.intake.reader import Delivery, IntakeReader
from tokenfleet.worker.kv_pool import KVPoolMember
from tokenfleet.worker.metrics import WorkerMetrics
from tokenfleet.worker.pool_link import PoolEngine, PoolLink
from tokenfleet.worker.publish.publisher import Finish, PendingPublish, Publisher, StepResult
from tokenfleet.worker.worker_settings import WorkerSettings

log = logging.getLogger(__name__)

MAX_CONSECUTIVE_STEP_FAILURES = 3
INHERIT_RETRY_S = 0.1  # inherited entries waiting for engine room: how often to look again
EXIT_ENGINE_BROKEN = 3


class EngineLike(Protocol):
    """What the service needs from ``tokenfleet.worker.engine.engine.Engine``."""

    tokenizer: Any

    def add_request(
        self,
        request_id: str,
        prompt: Any,
        params: Any,
        *,
        priority: Any,
        arrival_time: float | None,
        resume_output_ids: Sequence[int] = (),
    ) -> Any: ...
    def abort(self, request_id: str) -> bool: ...
    def step(self) -> list[Any]: ...
    def has_unfinished(self) -> bool: ...
    def capacity(self) -> Any: ...


class WorkerService:
    """Runs one engine against the fleet's Redis until stopped (see the module docstring)."""

    def __init__(
        self,
        engine: EngineLike,
        settings: Settings,
        wsettings: WorkerSettings,
        *,
        client: redis.Redis | None = None,
        metrics: WorkerMetrics | None = None,
        make_params: Any = None,
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.ws = wsettings
        self.client = client or redis.Redis.from_url(settings.redis_url)
        self.metrics = metrics or WorkerMetrics(wsettings.model_name)
        self.make_params = make_params or engine_sampling_params
        name = wsettings.name
        self.intake = Intake(
            self.client,
            settings,
            model_name=wsettings.model_name,
            priorities=wsettings.priorities,
            worker_name=name,
            poison_limit=wsettings.poison_limit,
            starvation_pulls=wsettings.starvation_pulls,
        )
        self.publisher = Publisher(
            self.client, settings, model_name=wsettings.model_name, worker_name=name
        )
        self.heartbeat = Heartbeat(
            self.client, settings, worker_name=name, ttl_s=wsettings.heartbeat_ttl_s
        )
        self.claimer = Claimer(
            self.client, self.intake.streams, claim_idle_s=wsettings.claim_idle_s
        )
        self.reader = IntakeReader(self.intake, block_ms=wsettings.block_ms)
        self.jobs: dict[str, Job] = {}
        self._early: dict[str, Job] = {}  # in the engine, START not answered yet (reader)
        self._aborting: dict[str, Job | None] = {}  # aborted in the engine, end not reported yet
        self.pool: PoolLink | None = None  # the engine's link to a shared KV pool
        if wsettings.kv_pool:
            member = KVPoolMember(
                client=self.client,
                keys=Keys(settings.key_prefix),
                pool=wsettings.kv_pool,
                member=name,
                weight=wsettings.share_weight,
            )
            self.pool = PoolLink(cast(PoolEngine, engine), member)
        self._inflight: deque[PendingPublish[Job]] = deque()  # sent, replies not yet applied
        self._cancels: set[str] = set()
        self.stop_requested = False
        self._hurry = False
        self.exit_code = 0
        self._failures = 0
        self._avg_prompt_tokens = float(wsettings.block_size)
        self._kv_total = 0
        self._tokens_total = 0

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

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)

    def run(self) -> int:
        """Serve until stopped; returns the process exit code."""
        self.intake.streams.ensure_groups()
        if self.pool is not None:
            self.pool.join(block_size=self.ws.block_size)  # limit 0 until the first grant
        self._beat()  # first: from now on nobody else claims what this name holds
        inherited = self.claimer.inherit()  # before the first read: an earlier process's
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
        now = time.monotonic()
        next_beat = now + self.ws.heartbeat_interval_s
        next_claim = now + (0.0 if inherited else random.uniform(0, self.ws.claim_interval_s))
        grace_deadline: float | None = None
        try:
            while True:
                now = time.monotonic()
                if self._inflight and not self.engine.has_unfinished():
                    self.flush()  # idle: apply the last results before blocking on Redis
                if self.stop_requested and grace_deadline is None:
                    grace_deadline = now + self.ws.grace_s
                    self._deliver(self.reader.stop())  # started jobs run in the grace period
                if now >= next_beat:
                    self._beat()
                    next_beat = now + self.ws.heartbeat_interval_s
                if grace_deadline is None:
                    if now >= next_claim:
                        budget = self._budget() - self.reader.held
                        self._admit(self.claimer.claim(budget), claimed=True)
                        pause = self.ws.claim_interval_s
                        if self.claimer.inheriting:  # left for want of room: again soon
                            pause = 0.0 if budget > 0 else min(pause, INHERIT_RETRY_S)
                        next_claim = now + pause
                    idle = not self.engine.has_unfinished()
                    wait_s = min(next_beat, next_claim) - time.monotonic() if idle else 0.0
                    if idle and self.pool is not None:
                        wait_s = min(wait_s, self.pool.idle_tick())  # keeps the pool lease
                    self._deliver(self.reader.poll(self._read_budget(), max(0.0, wait_s)))
                if self.engine.has_unfinished():
                    self._step()
                    if self.exit_code:
                        break
                elif grace_deadline is not None:
                    self.flush()
                    break
                if grace_deadline is not None and (
                    self._hurry or time.monotonic() >= grace_deadline
                ):
                    self.hand_back_all()
                    break
        finally:
            try:
                leftover = self.reader.stop()  # started, never added: claimable once we are gone
                if leftover.jobs:
                    log.warning(
                        "worker %s: %d started requests left for recovery",
                        self.ws.name,
                        len(leftover.jobs),
                    )
            except Exception:  # already failing: the heartbeat must still go
                log.exception("worker %s: the intake's last round trip failed", self.ws.name)
            finally:
                self.reader.close()
            try:
                self.flush()
            except Exception:  # already failing: the heartbeat must still go
                log.exception("worker %s: publishing failed", self.ws.name)
            finally:
                self.publisher.close()
            if self.pool is not None:
                try:
                    self.pool.leave()
                except redis.RedisError:
                    log.exception("worker %s: could not leave its KV pool", self.ws.name)
            try:
                self.heartbeat.remove()
            except redis.RedisError:
                log.exception("worker %s: could not remove its heartbeat", self.ws.name)
        log.info("worker %s stopped (exit %d)", self.ws.name, self.exit_code)
        return self.exit_code

    # -- intake -------------------------------------------------------------------------------
    def _budget(self) -> int:
        """How many new requests the engine can admit now (slots and an estimate of KV)."""
        cap = self.engine.capacity()
        if cap.num_waiting > 0:
            return 0
        block_size = max(1, getattr(cap, "block_size", self.ws.block_size))
        per_request = max(1, math.ceil((self._avg_prompt_tokens + 1) / block_size))
        by_kv = cap.free_kv_blocks // per_request
        if by_kv == 0 and cap.num_running == 0:
            by_kv = 1  # an idle engine always takes one: it refuses what can never fit
        return max(0, min(cap.free_seq_slots, by_kv))

    def _read_budget(self) -> int:
        """How many new entries the intake may read: none while requests inherited from an
        earlier process of this name wait for room (they are older, and go first)."""
        return 0 if self.claimer.inheriting else self._budget()

    def _deliver(self, delivery: Delivery) -> None:
        """Take in what the intake read and started: early jobs go into the engine at once, started
        jobs become ours, and early jobs whose ``START`` did not answer ok leave the engine."""
        for report in delivery.reports:
            self._count(report)
        resolved_now = set(delivery.resolved)
        for job in delivery.early:
            if job.request_id not in resolved_now:  # else its START answer is right here
                self._add_early(job)
        for job in delivery.jobs:
            self._own(job)
        for rid in delivery.resolved:
            if rid in self._early:  # START refused it (cancelled, expired, ...): never publish
                self._drop_early(rid, None)

    def _admit(self, entries: list[Entry], claimed: bool = False) -> None:
        if not entries:
            return
        jobs, report = self.intake.starter.start(entries)
        self._count(report)
        for job in jobs:
            if claimed:
                self.metrics.observe_outcome(job.entry.priority, "claimed")
                log.info(
                    "worker %s: resumed %s at index %d (attempt %d)",
                    self.ws.name,
                    job.request_id,
                    job.num_published,
                    job.attempts,
                )
            self._own(job)

    def _own(self, job: Job) -> None:
        """A started job (``START`` answered ok): make it ours, in the engine."""
        rid = job.request_id
        early = self._early.pop(rid, None)
        if early is not None:
            if early.entry.key == job.entry.key and not job.resume_token_ids:
                self.jobs[rid] = job  # already in the engine, from its first token
                return
            self._drop_early(rid, job)  # it has tokens to resume from: start it over
            return
        if rid in self._aborting:  # the engine still holds an aborted run of the same id
            self._aborting[rid] = job
            return
        self._add(job)

    def _add_early(self, job: Job) -> None:
        """Put a request into the engine before its ``START`` has answered (``reader``)."""
        rid = job.request_id
        if rid in self.jobs or rid in self._early or rid in self._aborting:
            return  # the started job will sort it out
        deadline = job.request.deadline
        if deadline is not None and deadline <= time.time():
            return  # START will refuse it as expired: spare the engine its prefill
        try:
            self._engine_add(job)
        except (ValueError, TypeError):
            return  # refused: _add reports it once the request is started
        self._early[rid] = job

    def _drop_early(self, rid: str, restart: Job | None) -> None:
        """Take an early request out of the engine; ``restart``: add it again (with its resume
        tokens) once the engine has reported the id finished."""
        self._early.pop(rid, None)
        self.engine.abort(rid)
        # an abort, or an end inside the step being processed, is reported exactly once
        self._aborting[rid] = restart

    def _resolve_early(self, rids: set[str]) -> None:
        """Wait until every id in ``rids`` that is still early has its ``START`` answer (it is
        on the wire since before the step that produced its tokens: normally here already)."""
        while any(rid in self._early for rid in rids):
            delivery = self.reader.resolve()
            if not delivery:  # no START in flight: these cannot be answered any more
                for rid in [r for r in rids if r in self._early]:
                    self._drop_early(rid, None)
                return
            self._deliver(delivery)

    def _count(self, report: StartReport) -> None:
        for kind, prios in (
            ("expired", report.expired),
            ("dead_letter", report.dead_lettered),
            ("worker_lost", report.poisoned),
        ):
            for p in prios:
                self.metrics.observe_outcome(p, kind)

    def _engine_add(self, job: Job) -> None:
        """``engine.add_request`` for ``job`` (raises what it raises)."""
        req = job.request
        prompt = self._prompt(req)
        self.engine.add_request(
            req.request_id,
            prompt,
            self.make_params(req),
            priority=req.priority,
            arrival_time=req.enqueued_at or time.time(),
            resume_output_ids=job.resume_token_ids,
        )
        self._avg_prompt_tokens += 0.1 * (len(prompt) - self._avg_prompt_tokens)

    def _add(self, job: Job) -> None:
        rid = job.request_id
        if rid in self.jobs:  # delivered twice to this worker (cannot happen by protocol)
            return
        try:
            self._engine_add(job)
        except (ValueError, TypeError) as exc:
            code = getattr(exc, "code", "invalid_request")
            self._finish_now(
                job,
                TerminalStatus.ERROR,
                code if isinstance(code, str) else "invalid_request",
                f"the engine refused the request: {exc}",
            )
            return
        self.jobs[rid] = job

    def _prompt(self, req: GenerationRequest) -> str | list[int]:
        if req.prompt_token_ids is not None:
            return list(req.prompt_token_ids)
        if req.messages is not None:
            tok = self.engine.tokenizer
            if not getattr(tok, "chat_template", None):
                raise InvalidRequest("this model's tokenizer has no chat template; send a prompt")
            try:
                text = tok.apply_chat_template(
                    list(req.messages), tokenize=False, add_generation_prompt=True
                )
            except Exception as exc:  # jinja2's TemplateError, or what the template raises
                raise InvalidRequest(
                    f"the model's chat template refused these messages: {exc}"
                ) from exc
            return list(tok(text, add_special_tokens=False)["input_ids"])
        return req.prompt or ""

    # -- stepping and publishing --------------------------------------------------------------
    def _step(self) -> None:
        try:
            if self.pool is not None:
                self.pool.before_step()  # a preemption order from the last reply
            outputs = self.engine.step()
        except Exception as exc:
            self._step_failed(exc)
            return
        if any(out.new_token_ids for out in outputs):
            self._failures = 0  # the engine demonstrably works again
        # Read what arrived during the step now, before publishing: the round trip this sends
        # (a START, or the blocking read that follows a drained pull) has answered by the
        # loop's poll after the publish, so an arrival it finds joins the very next step
        # (polled only at the loop's top, it waited one step more).
        self._deliver(self.reader.poll(self._read_budget()))
        if self._early:
            self._resolve_early({out.request_id for out in outputs})
        firsts: list[tuple[Job, list[TokenEvent]]] = []  # requests' first tokens (TTFT)
        tokens: list[tuple[Job, list[TokenEvent]]] = []
        finishes: list[tuple[Job, TerminalEvent, list[TokenEvent]]] = []
        restarts: list[Job] = []
        for out in outputs:
            if out.request_id in self._aborting:  # a run we took back: nothing is published
                if out.finished:
                    restart = self._aborting.pop(out.request_id)
                    if restart is not None:
                        restarts.append(restart)
                continue
            job = self.jobs.get(out.request_id)
            if job is None:
                continue
            events = [
                TokenEvent(job.request_id, out.first_index + i, tid, text)
                for i, (tid, text) in enumerate(zip(out.new_token_ids, out.new_texts, strict=True))
            ]
            if events:
                (firsts if events[0].index == 0 else tokens).append((job, events))
            if out.finished:
                finishes.append((job, self._terminal(job, out, len(events)), events))
        finishing = {job.request_id for job, _, _ in finishes}
        check = [rid for rid in self.jobs if rid not in finishing]
        # first tokens lead the pipeline: Redis runs (and PUBLISHes) them before the others
        tokens = firsts + tokens
        self._publish_async(tokens, finishes, check)
        num_new = 0
        per_priority: dict[Priority, int] = {}  # bookkeeping once the round trip is on its way
        for job, events in tokens:
            num_new += len(events)
            p = job.entry.priority
            per_priority[p] = per_priority.get(p, 0) + len(events)
        for p, n in per_priority.items():
            self.metrics.observe_tokens(p, n)
        self._tokens_total += num_new
        for job in restarts:
            self._add(job)
        self._cancel_requested()
        stats = getattr(self.engine, "last_step_stats", None)
        if stats is not None:
            total = getattr(stats, "num_kv_blocks_used", 0) + getattr(
                stats, "num_kv_blocks_free", 0
            )
            self._kv_total = total or self._kv_total
        self.metrics.observe_step(
            time.time(), num_new, stats, self.engine.capacity(), self._kv_total
        )

    # -- publishing, overlapped with the next step -------------------------------------------
    def _publish_async(
        self,
        tokens: list[tuple[Job, list[TokenEvent]]],
        finishes: list[tuple[Job, TerminalEvent, list[TokenEvent]]],
        check: list[str],
    ) -> None:
        """Apply the previous step's round trip, then send this step's without waiting.

        One round trip is in flight while the engine computes the next step (the tokens reach
        clients as soon as Redis runs it); its results (finishes, lost requests, cancellations)
        are applied one step late. A finish carries its job's text as of that result, plus its
        events in this round trip.
        """
        self.flush()
        ends = [_finish(job, event, events) for job, event, events in finishes]
        call = self.pool.plan() if self.pool is not None else None
        try:
            pending = self.publisher.send(tokens, ends, check, call)
        except BaseException:
            if self.pool is not None:
                self.pool.abandon()
            raise
        self._inflight.append(pending)

    def flush(self) -> None:
        """Read the replies of every publish in flight (waiting if need be) and apply them."""
        while self._inflight:
            try:
                result = self._inflight.popleft().result()
            except BaseException:
                if self.pool is not None:
                    self.pool.abandon()
                raise
            self._apply(result)

    def _apply(self, result: StepResult[Job]) -> None:
        if self.pool is not None and result.pool_reply is not None:
            self.pool.after_execute(result.pool_reply)
        record_published(result.appended)
        for fin in result.finished:
            ev = fin.event
            self.jobs.pop(ev.request_id, None)
            self.metrics.observe_finish(
                fin.priority,
                ev.status.value,
                ev.finish_reason,
                ev.usage.get("prompt_tokens", 0),
                ev.timings,
            )
        for rid in result.lost:
            if self.jobs.pop(rid, None) is not None:
                log.warning(
                    "worker %s: %s is now held by another worker; dropped here", self.ws.name, rid
                )
                self.engine.abort(rid)
        self._cancels.update(result.cancel_requested)

    def _cancel_requested(self) -> None:
        """Abort and finish ``cancelled`` every running request whose cancellation was asked."""
        if not self._cancels:
            return
        self.flush()  # the request's last tokens must be in its list before its terminal event
        cancels, self._cancels = self._cancels, set()
        for rid in cancels:
            job = self.jobs.get(rid)
            if job is not None:
                self.engine.abort(rid)
                self._finish_now(
                    job, TerminalStatus.CANCELLED, None, "cancelled by the client while running"
                )

    def _terminal(self, job: Job, out: Any, num_new: int) -> TerminalEvent:
        reason = getattr(out.finish_reason, "value", out.finish_reason)
        usage = {"prompt_tokens": out.num_prompt_tokens, "completion_tokens": out.num_output_tokens}
        num_tokens = out.first_index + num_new  # == every token published, resumed ones included
        if reason in ("stop", "length"):
            return TerminalEvent(
                job.request_id,
                TerminalStatus.DONE,
                num_tokens=num_tokens,
                finish_reason=reason,
                usage=usage,
                timings=timings_dict(out.timings),
            )
        code = out.error_code or ("aborted" if reason == "abort" else "engine_error")
        message = out.error_message or f"the engine ended the request ({reason})"
        return TerminalEvent(
            job.request_id,
            TerminalStatus.ERROR,
            num_tokens=num_tokens,
            code=code,
            message=message,
            usage=usage,
            timings=timings_dict(out.timings),
        )

    def _finish_now(self, job: Job, status: TerminalStatus, code: str | None, message: str) -> None:
        """Finish ``job`` synchronously (callers flush first if it may have tokens in flight)."""
        event = TerminalEvent(
            job.request_id, status, num_tokens=job.num_published, code=code, message=message
        )
        result: StepResult[Job] = self.publisher.publish([], [_finish(job, event)])
        self.jobs.pop(job.request_id, None)
        if result.finished:
            self.metrics.observe_finish(job.entry.priority, status.value, None, 0, {})

    def _step_failed(self, exc: BaseException) -> None:
        affected = set(self.jobs) | set(self._early)  # what was in the engine during the step
        self.flush()
        self._resolve_early(set(self._early))  # early ones become jobs or leave the engine
        self._failures += 1
        log.exception(
            "worker %s: engine step failed (%d in a row); ending its %d requests "
            "with error/engine_error",
            self.ws.name,
            self._failures,
            len(self.jobs),
        )
        finishes = []
        for job in [j for rid, j in self.jobs.items() if rid in affected]:
            try:
                self.engine.abort(job.request_id)
            except Exception:
                log.exception("worker %s: abort of %s failed", self.ws.name, job.request_id)
            message = (
                f"the engine failed while running this request "
                f"({type(exc).__name__}: {exc}); it was aborted"
            )
            finishes.append(
                _finish(
                    job,
                    TerminalEvent(
                        job.request_id,
                        TerminalStatus.ERROR,
                        num_tokens=job.num_published,
                        code="engine_error",
                        message=message[:2000],
                    ),
                )
            )
        self._apply(self.publisher.publish([], finishes))  # counts them in the metrics
        for fin in finishes:
            self.jobs.pop(fin.event.request_id, None)
        if self._failures >= MAX_CONSECUTIVE_STEP_FAILURES:
            log.error(
                "worker %s: %d engine steps failed in a row; exiting with status %d for "
                "the supervisor to restart it",
                self.ws.name,
                self._failures,
                EXIT_ENGINE_BROKEN,
            )
            self.exit_code = EXIT_ENGINE_BROKEN

    # -- shutdown and heartbeat ---------------------------------------------------------------
    def hand_back_all(self) -> None:
        """Abort every running request and re-queue it for another worker (one round trip)."""
        self.flush()
        self._resolve_early(set(self._early))
        # started ones whose engine run was taken back, waiting to be added again
        waiting = [job for job in self._aborting.values() if job is not None]
        self._aborting = dict.fromkeys(self._aborting)
        jobs = list(self.jobs.values()) + waiting
        if not jobs:
            return
        pipe = self.client.pipeline(transaction=False)
        for job in jobs:
            self.engine.abort(job.request_id)
            e = job.entry
            registry.queue(
                self.client,
                pipe,
                HANDBACK,
                [self.intake.keys.record(job.request_id), e.stream],
                [
                    job.request_id,
                    self.ws.name,
                    e.entry_id,
                    CONSUMER_GROUP,
                    e.fields.get("d") or b"",
                ],
            )
        for job, reply in zip(jobs, pipe.execute(), strict=True):
            code = registry.check_reply(HANDBACK, reply)[0]
            log.info(
                "worker %s: handed back %s at index %d (%s)",
                self.ws.name,
                job.request_id,
                job.num_published,
                code,
            )
        self.jobs.clear()

    def _beat(self) -> None:
        cap = self.engine.capacity()
        used = getattr(getattr(self.engine, "last_step_stats", None), "num_kv_blocks_used", 0)
        self.heartbeat.beat(
            {
                "model": self.ws.model_name,
                "priorities": ",".join(p.label for p in self.ws.priorities),
                "running": len(self.jobs),
                "waiting": cap.num_waiting,
                "kv_blocks_used": used,
                # before the first step the engine's free blocks are its total
                "kv_blocks_total": self._kv_total or used + getattr(cap, "free_kv_blocks", 0),
                "tokens_total": self._tokens_total,
                "stopping": int(self.stop_requested),
                **({f"pool_{k}": v for k, v in self.pool.status.items()} if self.pool else {}),
            }
        )


def _finish(job: Job, event: TerminalEvent, events: Sequence[TokenEvent] = ()) -> Finish:
    """``job``'s finish with ``event``: its text so far plus ``events`` (in the same round trip)."""
    text = job.text + "".join(e.text for e in events)
    return Finish(event, job.entry.priority, job.entry.entry_id, text)


def timings_dict(timings: Any) -> dict[str, float]:
    """The engine's ``RequestTimings`` as the terminal event's ``timings`` (known values only)."""
    if timings is None:
        return {}
    out: dict[str, float] = {}
    for name in ("queue_s", "ttft_s", "tpot_s", "e2e_s"):
        value = getattr(timings, name, None)
        if value is not None:
            out[name] = round(float(value), 6)
    return out


def engine_sampling_params(req: GenerationRequest) -> Any:
    """The engine's ``SamplingParams`` for a wire request."""
    from tokenfleet.worker.engine.request import SamplingParams

    s = req.sampling
    return SamplingParams(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        seed=s.seed,
        max_tokens=s.max_tokens,
        stop=s.stop,
        stop_token_ids=s.stop_token_ids,
        ignore_eos=s.ignore_eos,
    )
