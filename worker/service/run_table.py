"""The run table: per-request state of everything this worker has put into its engine.

The service's loop owns no per-request bookkeeping; it asks and changes this table, one method
per transition, and does the engine and Redis side of each itself (``feed``, ``outbox``).
Nothing here reads or writes Redis or the engine.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenfleet.shared.priority import Priority
from tokenfleet.worker.intake.jobs import Job


class InvariantViolation(RuntimeError):
    """:meth:`RunTable.check_invariants` found the table in a state it must never be in."""


class RunTable:
    """Jobs, early starts, prompts being prepared and aborted runs, by request id.

    * ``jobs`` holds exactly the requests this worker owns in Redis (record ``running`` with its
      name) and has added to its engine, except those in ``aborting`` waiting to be added again;
      a request leaves ``jobs`` only once it is finished, handed back, or found to be owned by
      another worker.
    * ``early`` holds the requests in the engine whose ``START`` has not answered (early start:
      nothing is published for them until it has).
    * ``preparing`` holds started jobs (owned in Redis, like ``jobs``) whose long prompts are
      being tokenized off the loop (``prompt_prep``): not in the engine yet.
    * ``aborting`` holds the requests aborted in the engine whose end it has not reported yet
      (their outputs are dropped), each with the job to add again once it has, or None.
    * ``cancels`` holds ids whose cancellation was asked while running, to be aborted and
      finished ``cancelled`` (ids no longer in ``jobs`` are skipped then).

    The four maps are read directly (the step's outputs are sorted against them) but changed
    only through the transitions below, and never replaced by other dicts.

    Invariants (:meth:`check_invariants` raises :class:`InvariantViolation` on each):

    1. no id is in two of ``jobs``, ``early``, ``preparing`` and ``aborting``;
    2. each job is filed under its own request id (in ``aborting``: the job to add again);
    3. an early job was never started: attempts 0, no tokens to resume, none published;
    4. each job's progress is whole: ``len(text_parts) == num_published``, and the tokens it
       resumed from are among those published.
    """

    def __init__(self) -> None:
        self.jobs: dict[str, Job] = {}
        self.early: dict[str, Job] = {}  # in the engine, START not answered yet (reader)
        self.preparing: dict[str, Job] = {}  # started, prompt being tokenized off the loop
        self.aborting: dict[str, Job | None] = {}  # aborted in the engine, end not reported yet
        self.cancels: set[str] = set()

    # -- questions ----------------------------------------------------------------------------
    def knows(self, request_id: str) -> bool:
        """Whether this table accounts for ``request_id`` (in the engine, or on its way)."""
        return (
            request_id in self.jobs
            or request_id in self.early
            or request_id in self.aborting
            or request_id in self.preparing
        )

    # -- transitions --------------------------------------------------------------------------
    def start_early(self, job: Job) -> None:
        """``job`` went into the engine before its ``START`` answered."""
        self.early[job.request_id] = job

    def take_early(self, request_id: str) -> Job | None:
        """Its ``START`` answered: the early job leaves ``early`` (None if it was not early)."""
        return self.early.pop(request_id, None)

    def run(self, job: Job) -> None:
        """``job`` is started and in the engine (added now, or early and answered ok)."""
        self.jobs[job.request_id] = job

    def prepare(self, job: Job) -> None:
        """``job`` is started and its prompt is being prepared off the loop."""
        self.preparing[job.request_id] = job

    def take_prepared(self, request_id: str) -> Job | None:
        """Its prompt is ready (or refused): the job leaves ``preparing`` (None if it had left:
        handed back meanwhile)."""
        return self.preparing.pop(request_id, None)

    def abort_early(self, request_id: str, restart: Job | None) -> None:
        """The early run of ``request_id`` was aborted in the engine; ``restart``: the job to add
        again (with its resume tokens) once the engine has reported the id finished."""
        self.early.pop(request_id, None)
        self.aborted(request_id, restart)

    def aborted(self, request_id: str, restart: Job | None = None) -> None:
        """``request_id``, in none of the other maps any more, was aborted in the engine, which
        holds it until the next step reports its end; ``restart``: the job to add again then. A
        request started again meanwhile (claimed back) waits for that end here: the engine
        refuses an id it still holds."""
        # an abort, or an end inside the step being processed, is reported exactly once
        self.aborting[request_id] = restart

    def restart_after_abort(self, job: Job) -> bool:
        """If the engine still holds an aborted run of ``job``'s id, add ``job`` again once it has
        reported its end, and say so (True); else change nothing (False)."""
        if job.request_id not in self.aborting:
            return False
        self.aborting[job.request_id] = job
        return True

    def end_reported(self, request_id: str) -> Job | None:
        """The engine reported the aborted run's end: it leaves ``aborting``; returns the job to
        add again, if any."""
        return self.aborting.pop(request_id, None)

    def remove(self, request_id: str) -> Job | None:
        """The job left this worker (finished, or lost to another worker); None if not here."""
        return self.jobs.pop(request_id, None)

    def request_cancels(self, request_ids: Iterable[str]) -> None:
        """Cancellations asked for these running ids (the publish's cancel check)."""
        self.cancels.update(request_ids)

    def take_cancels(self) -> set[str]:
        """The ids whose cancellation was asked since the last call."""
        cancels, self.cancels = self.cancels, set()
        return cancels

    def to_hand_back(self) -> list[Job]:
        """Every job to hand back on shutdown: the running ones, then those waiting to be added
        again (which stop waiting: their aborted runs' ends are still dropped), then those whose
        prompts are being prepared."""
        waiting = [job for job in self.aborting.values() if job is not None]
        for rid in self.aborting:  # in place: the maps are never replaced
            self.aborting[rid] = None
        return list(self.jobs.values()) + waiting + list(self.preparing.values())

    def handed_back(self) -> None:
        """Every running job was handed back: none is this worker's any more."""
        self.jobs.clear()
        self.preparing.clear()

    # -- invariants ---------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise :class:`InvariantViolation` naming the first invariant (class docstring) that
        does not hold. O(requests); for tests and debugging, not the step loop."""
        jobs, early, aborting = self.jobs, self.early, self.aborting
        for rid in jobs.keys() & early.keys() | jobs.keys() & aborting.keys():
            raise InvariantViolation(f"invariant 1: {rid!r} is in jobs and early or aborting")
        for rid in early.keys() & aborting.keys():
            raise InvariantViolation(f"invariant 1: {rid!r} is in early and aborting")
        for rid in self.preparing.keys() & (jobs.keys() | early.keys() | aborting.keys()):
            raise InvariantViolation(f"invariant 1: {rid!r} is preparing and in another map")
        filed = [*jobs.items(), *early.items(), *self.preparing.items()]
        filed += [(rid, job) for rid, job in aborting.items() if job is not None]
        for rid, job in filed:
            if job.request_id != rid:
                raise InvariantViolation(
                    f"invariant 2: the job of {job.request_id!r} is filed under {rid!r}"
                )
        for rid, job in early.items():
            if job.attempts or job.resume_token_ids or job.num_published:
                raise InvariantViolation(f"invariant 3: early job {rid!r} was started before")
        for rid, job in filed:
            if len(job.text_parts) != job.num_published:
                raise InvariantViolation(
                    f"invariant 4: {rid!r} has {job.num_published} tokens published but "
                    f"{len(job.text_parts)} texts"
                )
            if job.num_published < len(job.resume_token_ids):
                raise InvariantViolation(
                    f"invariant 4: {rid!r} resumed from {len(job.resume_token_ids)} tokens "
                    f"but has {job.num_published} published"
                )


def count_of(table: RunTable, priority: Priority) -> int:
    """Requests of ``priority`` the table's worker started (running, early or being prepared)."""
    return sum(
        1
        for jobs in (table.jobs, table.early, table.preparing)
        for job in jobs.values()
        if job.entry.priority is priority
    )
