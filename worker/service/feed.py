"""Feeding the engine from the intake between steps: what it can admit, early starts, started
jobs and claimed entries.

Early start (``reader``): a new request goes into the engine as soon as it is read, while its
``START`` is on the wire, so that it joins the step that begins meanwhile; nothing is published
for it until ``START`` has answered. Answered ok, it becomes a job; refused (cancelled, expired,
...), it is aborted in the engine and its outputs are dropped; answered ok with tokens to resume
from (a handback from an older worker that did not mark its entry), it is aborted and added
again, with its tokens, once the engine has reported the abort. A step whose outputs include an
early request waits for that answer first (it left before the step began).

Long prompts (``prompt_prep``): a prompt whose length alone proves it cannot fit is refused
(``error``/``prompt_too_long``) without tokenizing it; one over ``INLINE_PROMPT_CHARS`` is not
started early but tokenized on a thread once started (``preparing`` in the table), and added to
the engine by the first poll after its tokens are ready, so the loop keeps stepping meanwhile.

Routing (docs/routing.md): ``steal`` takes aged routed work of other workers (``stealer``)
within the engine's room; every job owned is counted by how it came (hit, miss, steal,
overflow). What the prefix cache holds reaches the routing from the engine itself
(``prefix_set``). An overflow worker (``overflow``) reads nothing but what its stealer takes.

The state of each request lives in the ``RunTable``; the :class:`Feeder` does the engine side of
each transition (add, abort) together with the table's.
"""

from __future__ import annotations

import logging
import math
import time

from tokenfleet.shared.priority import BACKGROUND
from tokenfleet.shared.schema import TerminalStatus
from tokenfleet.worker.intake import Intake
from tokenfleet.worker.intake.claimer import Claimer
from tokenfleet.worker.intake.jobs import Entry, Job, StartReport
from tokenfleet.worker.intake.reader import Delivery, IntakeReader
from tokenfleet.worker.intake.stealer import STEAL_INTERVAL_S, Stealer, route_kind
from tokenfleet.worker.service.adapter import EngineAdapter
from tokenfleet.worker.service.engine_port import EnginePort
from tokenfleet.worker.service.metrics import WorkerMetrics
from tokenfleet.worker.service.outbox import Outbox
from tokenfleet.worker.service.prompt_prep import Prepared, PromptPrep, PromptTooLong
from tokenfleet.worker.service.run_table import RunTable, count_of

log = logging.getLogger(__name__)

INHERIT_RETRY_S = 0.1  # inherited entries waiting for engine room: how often to look again
PREPARED_POLL_S = 0.002  # prompts being prepared: the longest an idle poll sleeps on Redis


class Feeder:
    """Moves requests from the intake (``reader``, ``claimer``) into the engine and the table."""

    def __init__(
        self,
        intake: Intake,
        reader: IntakeReader,
        claimer: Claimer,
        table: RunTable,
        adapter: EngineAdapter,
        outbox: Outbox,
        metrics: WorkerMetrics,
        *,
        worker_name: str,
        prep: PromptPrep | None = None,
        slots_from_batch: int | None = None,
    ) -> None:
        self.intake = intake
        self.reader = reader
        self.claimer = claimer
        self.table = table
        self.adapter = adapter
        self.engine: EnginePort = adapter.engine
        self.outbox = outbox
        self.metrics = metrics
        self.worker_name = worker_name
        self.slots_from_batch = slots_from_batch  # WorkerSettings.slots_from_batch
        self.prep = prep or PromptPrep(
            self.engine.tokenizer, self.engine.max_model_len, adapter.chat_text
        )
        self.stealer: Stealer | None = None  # set by the service (routing_wiring)
        self.overflow = False

    # -- how much ------------------------------------------------------------------------------
    def budget(self) -> int:
        """How many new requests the engine can admit now (slots and an estimate of KV)."""
        cap = self.engine.capacity()
        if cap.num_waiting > 0:
            return 0
        block_size = max(1, cap.block_size)
        per_request = max(1, math.ceil((self.adapter.avg_prompt_tokens + 1) / block_size))
        by_kv = cap.free_kv_blocks // per_request
        if by_kv == 0 and cap.num_running == 0:
            by_kv = 1  # an idle engine always takes one: it refuses what can never fit
        # prompts being prepared take their slots before the engine knows them
        return max(0, min(cap.free_seq_slots, by_kv) - len(self.table.preparing))

    def read_budget(self) -> int:
        """How many new entries the intake may read: none while requests inherited from an
        earlier process of this name wait for room (they are older, and go first). With
        ``slots_from_batch`` (a worker serving ``batch`` and a more urgent level), ``batch``
        is capped at the free room, and more urgent levels may take up to that many more, one
        per running batch request: the engine preempts batch work for them (``preemption``)."""
        budget = self.budget()
        extra = self.slots_from_batch
        if extra is not None:
            self.intake.streams.caps[BACKGROUND] = max(0, budget - self.reader.held)
            budget += min(extra, count_of(self.table, BACKGROUND))
        return 0 if self.claimer.inheriting or self.overflow else budget

    # -- the intake's round trips --------------------------------------------------------------
    def poll(self, timeout_s: float = 0.0) -> None:
        """Take in what the reader has (waiting up to ``timeout_s``); leave its next round trip
        in flight within the read budget); add the prompts prepared meanwhile."""
        if self.table.preparing:  # their tokens are what the loop waits for, too
            timeout_s = min(timeout_s, PREPARED_POLL_S)
        self.deliver(self.reader.poll(self.read_budget(), timeout_s))
        self.add_prepared()

    def add_prepared(self, timeout_s: float = 0.0) -> bool:
        """Add to the engine the jobs whose prompts are prepared (waiting up to ``timeout_s`` for
        one); refused ones end ``error``. Whether any job is still on its way into the engine
        (being prepared) or went into it now."""
        if not self.table.preparing:
            return False
        ready = self.prep.finished(timeout_s)
        for prepared in ready:
            self._add_prepared(prepared)
        return bool(ready) or bool(self.table.preparing)

    def claim(self, interval_s: float) -> float:
        """Claim what dead workers left (inherited entries first) within the engine's room and
        start it, and this worker's own orphans (``claimer``); returns the seconds until the
        next claim round."""
        # The publishes in flight answer first. One for a request another worker took over
        # (this one looked dead, starved past its heartbeat TTL) answers ``lost`` while that
        # worker holds it, and the run here is aborted; were the request claimed back first,
        # its START would make this worker the holder again and the publish's check (and
        # repair) would take the new start's state for the old run's. The request, claimed back
        # now, then replaces the aborted run (``_own``) or, if no publish told yet, the running
        # one (``add``).
        self.outbox.flush()
        budget = self.budget() - self.reader.held
        known = None if self.reader.starting else self.known_entries(early=True)
        self.admit(self.claimer.claim(budget, known), claimed=True)
        pause = interval_s
        if self.claimer.inheriting:  # left for want of room: again soon
            pause = 0.0 if budget > 0 else min(pause, INHERIT_RETRY_S)
        return pause

    def steal(self, now: float) -> float:
        """Every ``STEAL_INTERVAL_S``: take aged routed work of other workers (an overflow
        worker: any aged work of its model) within the engine's room, and start it
        (``stealer``). Returns the monotonic time of the next round."""
        if self.stealer is None or self.claimer.inheriting or now < self.stealer.next_at:
            return self.stealer.next_at if self.stealer is not None else math.inf
        self.stealer.next_at = now + STEAL_INTERVAL_S
        budget = self.budget() - self.reader.held
        if budget > 0:
            self.admit(self.stealer.steal(budget))
        return self.stealer.next_at

    def stop(self) -> None:
        """Stop reading; what the reader had read and now started runs in the grace period."""
        self.deliver(self.reader.stop())

    def close(self) -> None:
        """The reader's last round trip answered (what it started and nobody added is left for
        recovery: claimable once this worker's heartbeat is gone) and its connection closed."""
        try:
            leftover = self.reader.stop()  # started, never added: claimable once we are gone
            if leftover.jobs:
                log.warning(
                    "worker %s: %d started requests left for recovery",
                    self.worker_name,
                    len(leftover.jobs),
                )
        except Exception:  # already failing: the heartbeat must still go
            log.exception("worker %s: the intake's last round trip failed", self.worker_name)
        finally:
            self.reader.close()
            self.prep.close()

    # -- after a Redis outage (service/outage.py) -----------------------------------------------
    def known_entries(self, *, early: bool) -> set[tuple[str, str]]:
        """(stream, entry id) of every request this worker runs or will add again, and, if
        ``early``, of those it put into its engine before their ``START`` answered."""
        table = self.table
        keys = {job.entry.key for job in table.jobs.values()}
        keys |= {job.entry.key for job in table.aborting.values() if job is not None}
        if early:
            keys |= {job.entry.key for job in table.early.values()}
        return keys

    def reconcile(self) -> int:
        """After an outage: forget the reader's round trip in flight, start again every entry
        pending under this worker's name that it does not run (what a lost round trip read or
        started; early jobs among them become jobs or leave the engine), and take the early jobs
        left without an entry (ended meanwhile, or lost with Redis's data) out of the engine.
        Returns how many entries were started again."""
        self.reader.reset()
        entries = self.claimer.orphans(self.known_entries(early=False))
        self.admit(entries)
        for rid in list(self.table.early):
            self._drop_early(rid, None)
        return len(entries)

    # -- into the engine -----------------------------------------------------------------------
    def deliver(self, delivery: Delivery) -> None:
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
        early = self.table.early
        for rid in delivery.resolved:
            if rid in early:  # START refused it (cancelled, expired, ...): never publish
                self._drop_early(rid, None)

    def admit(self, entries: list[Entry], claimed: bool = False) -> None:
        """Start ``entries`` (one round trip, waited for) and take in the jobs."""
        if not entries:
            return
        jobs, report = self.intake.starter.start(entries)
        self._count(report)
        for job in jobs:
            if claimed:
                self.metrics.observe_outcome(job.entry.priority, "claimed")
                log.info(
                    "worker %s: resumed %s at index %d (attempt %d)",
                    self.worker_name,
                    job.request_id,
                    job.num_published,
                    job.attempts,
                )
            self._own(job)

    def resolve_early(self, rids: set[str]) -> None:
        """Wait until every id in ``rids`` that is still early has its ``START`` answer (it is
        on the wire since before the step that produced its tokens: normally here already)."""
        early = self.table.early
        while any(rid in early for rid in rids):
            delivery = self.reader.resolve()
            if not delivery:  # no START in flight: these cannot be answered any more
                for rid in [r for r in rids if r in early]:
                    self._drop_early(rid, None)
                return
            self.deliver(delivery)

    def add(self, job: Job) -> None:
        """Add a started job to the engine and the table; one the engine refuses ends ``error``
        at once."""
        table = self.table
        if job.request_id in table.preparing:  # started again while its prompt is prepared:
            table.prepare(job)  # the newer start (its attempt, its resume tokens) replaces it
            return
        if job.request_id in table.jobs:  # claimed back while it runs, nothing published since
            # (``claim``): the newer start rules; its run replaces the old one, from the tokens
            # Redis holds, once the engine has reported the old one's end
            table.remove(job.request_id)
            if self.engine.abort(job.request_id):
                table.aborted(job.request_id, job)
                return
        try:
            self.prep.check(job.request)  # refused on its length alone: never tokenized
            if self.prep.off_loop(job.request):
                self.prep.submit(job)
                table.prepare(job)
                return
            self.adapter.add(job)
        except (ValueError, TypeError) as exc:
            self._refuse(job, exc)
            return
        table.run(job)

    def _add_prepared(self, prepared: Prepared) -> None:
        """A prompt prepared off the loop: its job goes into the engine, or ends ``error``."""
        job = self.table.take_prepared(prepared.job.request_id)
        if job is None:  # handed back while its prompt was prepared
            return
        try:
            if prepared.error is not None:
                raise prepared.error
            self.adapter.add(job, prepared.token_ids)
        except (ValueError, TypeError) as exc:
            self._refuse(job, exc)
            return
        self.table.run(job)

    def _refuse(self, job: Job, exc: ValueError | TypeError) -> None:
        """End ``job`` ``error`` at once: its prompt cannot fit, or the engine refused it."""
        code = getattr(exc, "code", "invalid_request")
        message = (
            str(exc) if isinstance(exc, PromptTooLong) else f"the engine refused the request: {exc}"
        )
        self.outbox.finish_now(
            job,
            TerminalStatus.ERROR,
            code if isinstance(code, str) else "invalid_request",
            message,
        )

    def _own(self, job: Job) -> None:
        """A started job (``START`` answered ok): make it ours, in the engine."""
        self._note_route(job)
        table = self.table
        early = table.take_early(job.request_id)
        if early is not None:
            if early.entry.key == job.entry.key and not job.resume_token_ids:
                table.run(job)  # already in the engine, from its first token
                return
            self._drop_early(job.request_id, job)  # it has tokens to resume from: start it over
            return
        if table.restart_after_abort(job):  # the engine still holds an aborted run of the id
            return
        self.add(job)

    def _note_route(self, job: Job) -> None:
        """Count how ``job`` came here."""
        self.metrics.observe_route(route_kind(job.entry, self.intake.streams))

    def _add_early(self, job: Job) -> None:
        """Put a request into the engine before its ``START`` has answered (``reader``)."""
        if self.table.knows(job.request_id):
            return  # the started job will sort it out
        deadline = job.request.deadline
        if deadline is not None and deadline <= time.time():
            return  # START will refuse it as expired: spare the engine its prefill
        try:
            self.prep.check(job.request)
            if self.prep.off_loop(job.request):
                return  # prepared off the loop once started (add)
            self.adapter.add(job)
        except (ValueError, TypeError):
            return  # refused: add() reports it once the request is started
        self.table.start_early(job)

    def _drop_early(self, rid: str, restart: Job | None) -> None:
        """Take an early request out of the engine; ``restart``: add it again (with its resume
        tokens) once the engine has reported the id finished."""
        self.engine.abort(rid)
        self.table.abort_early(rid, restart)

    def _count(self, report: StartReport) -> None:
        for kind, prios in (
            ("expired", report.expired),
            ("dead_letter", report.dead_lettered),
            ("worker_lost", report.poisoned),
            ("corrupt_state", report.corrupt),
        ):
            for p in prios:
                self.metrics.observe_outcome(p, kind)
