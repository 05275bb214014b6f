"""The loop's publishing: each step's round trip sent at once, its replies applied a step later.

A step's publish (``Publisher.send``: tokens, finishes, cancel check, the KV-pool step) is
written the moment the step ends and its replies are read after the next step (one in flight,
in step order), so Redis works while the engine computes. Applying a result is the loop's
"ack" side: tokens that took effect advance their jobs, finished and lost jobs leave the
``RunTable``, cancellations asked are noted, and the pool's reply goes to the pool link.

Redis outages: a publish whose connection failed stays at the head of the queue, unapplied;
``flush`` runs it again (``PendingPublish.result``) once the loop has waited for Redis, so no
step's tokens are ever dropped while the engine keeps its state (``service/outage.py``).
``send_step`` raises a Redis error only from its first ``flush``: the loop flushes before it
builds a step's events, so once built they are always queued.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol

from tokenfleet.shared.priority import Priority
from tokenfleet.shared.schema import TerminalEvent, TerminalStatus, TokenEvent
from tokenfleet.worker.intake.jobs import CORRUPT_STATE, Job, record_published
from tokenfleet.worker.publish.publisher import Finish, PendingPublish, Publisher, StepResult
from tokenfleet.worker.service.adapter import StepEvents
from tokenfleet.worker.service.engine_port import EnginePort
from tokenfleet.worker.service.metrics import WorkerMetrics
from tokenfleet.worker.service.repair import FinishedLedger, Outcome, Repairer, Target
from tokenfleet.worker.service.run_table import RunTable

log = logging.getLogger(__name__)


class PoolSteps(Protocol):
    """What the outbox does with the engine's KV-pool link (``PoolLink``), if it has one."""

    def plan(self) -> Any:
        """The pool call to add to this step's publish (after the last reply was applied)."""

    def abandon(self) -> None:
        """The call in flight failed: forget it."""

    def after_execute(self, reply: Any) -> object:
        """Apply the pool call's reply (what it returns is not used)."""


class Outbox:
    """Sends each step's publish and applies the results, in step order.

    Invariant: ``_inflight`` holds the publishes sent whose results are not applied yet, oldest
    first: at most one between steps (every send first applies what is in flight), so a job's
    progress is current whenever a publish for it is built.
    """

    def __init__(
        self,
        publisher: Publisher,
        table: RunTable,
        engine: EnginePort,
        metrics: WorkerMetrics,
        pool: PoolSteps | None,
        *,
        worker_name: str,
        apart: bool = False,
        repairer: Repairer | None = None,
        ledger: FinishedLedger | None = None,
    ) -> None:
        self.publisher = publisher
        self.pool_apart = apart  # a cluster: the pool's slot is not the lane's (its step then
        # takes a round trip of its own, on the pool member's client)
        self.table = table
        self.engine = engine
        self.metrics = metrics
        self.pool = pool
        self.worker_name = worker_name
        self.repairer = repairer  # None: no repair (a lost or corrupt publish is final)
        self.ledger = ledger if ledger is not None else FinishedLedger(0.0)
        self._inflight: deque[PendingPublish[Job]] = deque()  # sent, replies not yet applied

    @property
    def in_flight(self) -> bool:
        """Whether a publish was sent whose result is not applied yet."""
        return bool(self._inflight)

    def send_step(self, step: StepEvents) -> int:
        """Apply the previous step's round trip, then send this step's without waiting; returns
        the number of token events sent.

        One round trip is in flight while the engine computes the next step (the tokens reach
        clients as soon as Redis runs it); its results (finishes, lost requests, cancellations)
        are applied one step late. A finish carries its job's text as of that result, plus its
        events in this round trip.
        """
        finishing = {job.request_id for job, _, _ in step.finishes}
        check = [rid for rid in self.table.jobs if rid not in finishing]
        self.flush()
        ends = [finish_of(job, event, events) for job, event, events in step.finishes]
        call = self.pool.plan() if self.pool is not None else None
        apart, call = (call, None) if self.pool_apart else (None, call)
        try:
            pending = self.publisher.send(step.tokens, ends, check, call)
        except BaseException:
            if self.pool is not None:
                self.pool.abandon()
            raise
        self._inflight.append(pending)
        if apart is not None:  # after the publish is queued: a failure here loses no event
            self._step_pool_apart(apart)
        num_new = 0
        per_priority: dict[Priority, int] = {}  # bookkeeping once the round trip is on its way
        for job, events in step.tokens:
            num_new += len(events)
            p = job.entry.priority
            per_priority[p] = per_priority.get(p, 0) + len(events)
        for p, n in per_priority.items():
            self.metrics.observe_tokens(p, n)
        return num_new

    def _step_pool_apart(self, call: Any) -> None:
        """Run the pool step ``call`` (a ``PoolCall``) alone, on its member's client."""
        assert self.pool is not None
        try:
            pipe = call.member.client.pipeline(transaction=False)
            call.queue(pipe)
            reply = pipe.execute()[0]
        except BaseException:
            self.pool.abandon()
            raise
        self.pool.after_execute(reply)

    def flush(self) -> None:
        """Read the replies of every publish in flight (waiting if need be) and apply them."""
        while self._inflight:
            try:
                result = self._inflight[0].result()
            except BaseException:  # kept: the next flush runs it again (module doc)
                if self.pool is not None:
                    self.pool.abandon()
                raise
            self._inflight.popleft()
            self._apply(result)

    def finish_now(self, job: Job, status: TerminalStatus, code: str | None, message: str) -> None:
        """Finish ``job`` synchronously (callers flush first if it may have tokens in flight)."""
        event = TerminalEvent(
            job.request_id, status, num_tokens=job.num_published, code=code, message=message
        )
        self.finish_all_now([finish_of(job, event)])

    def finish_all_now(self, finishes: list[Finish]) -> None:
        """Publish ``finishes`` synchronously, apply the result (which counts them in the
        metrics) and drop their jobs, whether the finishes took effect or not. On a Redis
        error they stay queued, like a step's publish, and are applied after the outage."""
        self._inflight.append(self.publisher.send([], finishes))
        self.flush()
        for fin in finishes:
            self.table.remove(fin.event.request_id)

    def end_cancelled(self) -> None:
        """Abort and finish ``cancelled`` every running request whose cancellation was asked."""
        if not self.table.cancels:
            return
        self.flush()  # the request's last tokens must be in its list before its terminal event
        for rid in self.table.take_cancels():
            job = self.table.jobs.get(rid)
            if job is not None:
                aborted = self.engine.abort(rid)
                self.finish_now(
                    job, TerminalStatus.CANCELLED, None, "cancelled by the client while running"
                )
                self._aborted(rid, aborted)

    def close(self) -> None:
        """Drop the publisher's connection (after the last flush)."""
        self.publisher.close()

    def repair_all(self, skip: set[str] | frozenset[str] = frozenset()) -> dict[str, Outcome]:
        """Check every request this worker runs or ended within its repair window against
        Redis and put back what a rollback took (``service/repair.py``); apply the outcomes to
        the running jobs. The caller has applied every publish it can (or none is in flight
        that Redis answered). Returns the outcomes by id (empty without a repairer)."""
        if self.repairer is None:
            return {}
        running = [
            Target(job, job.events) for rid, job in self.table.jobs.items() if rid not in skip
        ]
        ended = [t for t in self.ledger.targets() if t.request_id not in skip]
        started = time.perf_counter()
        outcomes = self.repairer.check(running + ended)
        changed = sum(o.kind != "intact" for o in outcomes.values())
        log.info(
            "worker %s: repair pass: %d running and %d ended requests checked, %d needed "
            "something, in %.1f ms",
            self.worker_name,
            len(running),
            len(ended),
            changed,
            (time.perf_counter() - started) * 1000,
        )
        for target in running:
            self._settle(target.job, outcomes[target.request_id])
        for target in ended:
            if outcomes[target.request_id].kind in ("yield", "divergent"):
                self.ledger.forget(target.request_id)  # not this worker's to put back any more
        return outcomes

    def _settle(self, job: Job, outcome: Outcome) -> None:
        """Apply a running job's repair outcome outside a publish's result."""
        if outcome.new_entry:
            job.entry.entry_id = outcome.new_entry
        if outcome.kind == "yield":
            self._drop_lost(job.request_id)
        elif outcome.kind == "divergent":
            self._end_corrupt(job.request_id, outcome.why)

    def _repair_refused(self, result: StepResult[Job]) -> None:
        """Publishes answered ``lost`` or ``corrupt`` for some running jobs: a rollback may have
        taken their state. Check them (their refused events and finishes included) and move the
        ones put back into the result's appended and finished; after a repair, check every other
        request too (a rollback takes them all)."""
        assert self.repairer is not None
        table = self.table
        suspects = [rid for rid in (*result.lost, *result.corrupt) if rid in table.jobs]
        if not suspects:
            return
        targets = []
        for rid in dict.fromkeys(suspects):
            job = table.jobs[rid]
            batch = result.refused.get(rid)
            extra = [e.encode() for e in batch[1]] if batch is not None else []
            fin = result.refused_finishes.get(rid)
            targets.append(Target(job, job.events + extra, fin, refused=True))
        outcomes = self.repairer.check(targets)
        for target in targets:
            rid, outcome = target.request_id, outcomes[target.request_id]
            if outcome.new_entry:
                target.job.entry.entry_id = outcome.new_entry
            if outcome.kind in ("repaired", "intact"):
                result.lost.discard(rid)
                result.corrupt.pop(rid, None)
                batch = result.refused.pop(rid, None)
                if batch is not None:
                    result.appended.append(batch)
                fin = result.refused_finishes.pop(rid, None)
                if fin is not None:
                    result.finished.append(fin)
            elif outcome.kind == "yield":
                result.corrupt.pop(rid, None)
                result.lost.add(rid)
            else:
                result.lost.discard(rid)
                result.corrupt[rid] = outcome.why
        if any(o.kind == "repaired" for o in outcomes.values()):
            self.repair_all(skip=set(outcomes))

    def _drop_lost(self, rid: str) -> None:
        if self.table.remove(rid) is not None:
            log.warning(
                "worker %s: %s is no longer held by this worker (taken over by another, "
                "handed back or ended); dropped here",
                self.worker_name,
                rid,
            )
            self._aborted(rid, self.engine.abort(rid))

    def _aborted(self, rid: str, unfinished: bool) -> None:
        """``rid``, out of ``jobs`` now, was aborted in the engine (``unfinished``: the engine
        still holds it). Until the engine reports its end it stays in ``aborting``, so that the
        request, claimed back meanwhile (another worker took it over while this one was starved,
        then lost it too), is added again only then and never refused as a duplicate id
        (``Feeder._own``)."""
        if unfinished and rid not in self.table.jobs:
            self.table.aborted(rid)

    def _apply(self, result: StepResult[Job]) -> None:
        if self.pool is not None and result.pool_reply is not None:
            self.pool.after_execute(result.pool_reply)
        if self.repairer is not None and (result.lost or result.corrupt):
            self._repair_refused(result)
        record_published(result.appended)
        table = self.table
        for fin in result.finished:
            ev = fin.event
            job = table.remove(ev.request_id)
            if job is not None:
                self.ledger.add(job, fin)
            self.metrics.observe_finish(
                fin.priority,
                ev.status.value,
                ev.finish_reason,
                ev.usage.get("prompt_tokens", 0),
                ev.timings,
                error=f"{ev.code}: {ev.message}" if ev.status is TerminalStatus.ERROR else "",
                tenant=fin.tenant,
                num_output_tokens=max(0, ev.num_tokens),
            )
        for rid in result.lost:
            self._drop_lost(rid)
        for rid, cause in result.corrupt.items():
            self._end_corrupt(rid, cause)
        table.request_cancels(result.cancel_requested)

    def _end_corrupt(self, rid: str, cause: str) -> None:
        """End a running request whose Redis state is poisoned: ``error`` / ``corrupt_state``
        naming the cause, entry acked (its tokens were not written)."""
        job = self.table.jobs.get(rid)
        if job is None:
            return
        log.warning(
            "worker %s: %s has inconsistent state (%s); ending it", self.worker_name, rid, cause
        )
        aborted = self.engine.abort(rid)
        self.finish_now(
            job, TerminalStatus.ERROR, CORRUPT_STATE, f"inconsistent request state: {cause}"
        )
        self._aborted(rid, aborted)


def finish_of(job: Job, event: TerminalEvent, events: Sequence[TokenEvent] = ()) -> Finish:
    """``job``'s finish with ``event``: its text so far plus ``events`` (in the same round trip)."""
    text = job.text + "".join(e.text for e in events)
    prompt = event.usage.get("prompt_tokens") if isinstance(event.usage, dict) else None
    e = job.entry
    return Finish(
        event,
        e.priority,
        e.entry_id,
        text,
        e.stream,
        e.tenant,
        prompt if isinstance(prompt, int) else e.prompt_tokens,
    )
