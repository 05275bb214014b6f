"""The intake thread: reads and starts entries in the background, within an allowance.

The service loop computes, after every engine step, how many new requests its engine could
admit and grants that as the reader's *allowance*. The reader pulls at most that many entries
(``Intake.pull``, most urgent first); when none is waiting it blocks in Redis
(``Intake.wait``, ``XREADGROUP ... BLOCK``), so an arriving request is read the moment it is
added, with no round trip on the loop's side and no polling. Read entries are started in Redis
and handed to the loop as :class:`Job` objects, which it adds to the engine before its next
step. The ``START`` round trip also pulls what else the allowance takes
(``Intake.start_and_pull``); when that pull comes back short, the streams were empty, so the
next read blocks at once instead of pulling first: a lone arrival costs two round trips (the
wait's reply, then ``START``), not three.

Early start: a new request (not handed back, so nothing to resume) is handed over *before* its
``START`` round trip, as an ``early`` job, and ``resolved`` once ``START`` has answered (as a
job if it answered ok). The loop may put an early job into its engine at once but publishes
nothing for it until it is resolved, and takes it out again if it did not become a job; a
request thus joins the step that begins while its ``START`` is on the wire instead of the next.

Invariant (under ``_lock``): ``_allowance + _reading + len(_ready)`` never exceeds the last
budget the loop granted, except that one blocking wait reads up to one entry per stream even
when the allowance is smaller (every entry read is started and handed over: none is left
unstarted in this worker's pending list); the loop grants ``budget - _reading - len(_ready)``.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from tokenfleet.worker.intake import Entry, Intake, Job, StartReport

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Delivery:
    """What the reader hands over: started jobs and the outcomes of entries that did not run."""

    jobs: list[Job] = field(default_factory=list)  # START answered ok: the loop owns them
    reports: list[StartReport] = field(default_factory=list)
    early: list[Job] = field(default_factory=list)  # decoded, START on the wire (module doc)
    resolved: list[str] = field(default_factory=list)  # ids of early jobs whose START answered

    def __bool__(self) -> bool:
        return bool(self.jobs or self.reports or self.early or self.resolved)


class IntakeReader:
    """Runs ``Intake`` reads on a thread of its own (see the module docstring)."""

    def __init__(self, intake: Intake, *, block_ms: int, busy_block_ms: int = 100) -> None:
        self.intake = intake
        self.block_ms = block_ms
        self.busy_block_ms = busy_block_ms
        self._lock = threading.Condition()
        self._allowance = 0  # entries the reader may still read
        self._reading = 0  # entries reserved by the read in progress
        self._ready = Delivery()
        self._idle = True  # the engine runs nothing: block longer
        self._stop = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="intake", daemon=True)

    def start(self) -> IntakeReader:
        self._thread.start()
        return self

    def grant(self, budget: int, *, idle: bool) -> None:
        """Allow reads up to ``budget`` admissions, minus what is being read or waiting."""
        with self._lock:
            self._allowance = max(0, budget - self._reading - len(self._ready.jobs))
            self._idle = idle
            if self._allowance:
                self._lock.notify_all()

    @property
    def alive(self) -> bool:
        """The thread runs (started, not stopped, not failed)."""
        return self._thread.is_alive()

    def pending(self) -> int:
        """Jobs started and not yet taken (they will need engine room). A read in progress is
        not counted: it is usually a blocking wait for entries that may never come, and claims
        of dead workers' requests must not starve behind it."""
        with self._lock:
            return len(self._ready.jobs)

    def take(self, timeout_s: float = 0.0) -> Delivery:
        """What the reader has started since the last call; waits up to ``timeout_s`` for some."""
        with self._lock:
            if not self._ready and timeout_s > 0:
                self._lock.wait(timeout_s)
            out, self._ready = self._ready, Delivery()
            if self.error is not None:
                raise self.error
            return out

    def stop(self) -> Delivery:
        """Stop reading, wait for the read in progress, and return what is left to take."""
        with self._lock:
            self._stop = True
            self._allowance = 0
            self._lock.notify_all()
        self._thread.join()
        with self._lock:
            out, self._ready = self._ready, Delivery()
            return out

    def _start(self, entries: list[Entry], left: int) -> tuple[list[Entry], bool, int]:
        """Hand ``entries`` over (early first), start them and, in the same round trip, pull
        up to ``left`` more. Returns (entries pulled, whether that pull left none waiting,
        allowance left)."""
        early = self.intake.early_jobs(entries)
        if early:
            with self._lock:
                self._ready.early.extend(early)
                self._lock.notify_all()
        budget = 0 if self._stop else max(0, left)
        jobs, report, pulled = self.intake.start_and_pull(entries, early, budget)
        with self._lock:
            self._reading = max(0, self._reading - len(entries))
            self._ready.jobs.extend(jobs)
            self._ready.reports.append(report)
            self._ready.resolved.extend(j.request_id for j in early)
            self._lock.notify_all()
        return pulled, budget > 0 and len(pulled) < budget, left - len(pulled)

    def _run(self) -> None:
        drained = False  # the last read left no entry waiting: block next time, don't pull
        try:
            while True:
                with self._lock:
                    while not self._stop and self._allowance <= 0:
                        self._lock.wait()
                    if self._stop:
                        return
                    n, self._reading, self._allowance = self._allowance, self._allowance, 0
                    block_ms = self.block_ms if self._idle else self.busy_block_ms
                entries = [] if drained else self.intake.pull(n)
                if not entries:
                    # woken by the first arrival: start it at once; the START round trip pulls
                    # what else the allowance takes. A wait reads at most one entry per stream,
                    # so it can exceed a small allowance by a stream or two; those must be
                    # started too (they are in this worker's pending list now).
                    entries = self.intake.wait(block_ms)
                    drained = not entries  # the wait timed out: nothing new on any stream
                left = n - len(entries)
                while entries:
                    entries, drained, left = self._start(entries, left)
                with self._lock:
                    self._reading = 0
                    # what was not read frees its share of the allowance
                    self._allowance += max(0, left) if not self._stop else 0
        except BaseException as exc:  # surfaced to the loop by take()
            log.exception("intake thread failed")
            with self._lock:
                self.error = exc
                self._lock.notify_all()
