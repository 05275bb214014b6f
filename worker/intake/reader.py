"""The intake's round trips, driven by the service loop between engine steps (no thread).

Every loop iteration calls :meth:`IntakeReader.poll` with what its engine can admit now (the
*budget*). The reader keeps at most one round trip in flight, on a connection of its own:

* a **read**: ``XREADGROUP ... BLOCK`` on every stream when the last read found them empty (it
  answers at the first arrival, one entry per stream that has one), else the ``PULL`` script
  (most urgent first, up to the budget);
* a **start**: ``START`` for the entries just read plus a ``PULL`` of what else the budget takes,
  in one pipeline (``Starter.send_start``); when that pull comes back short the streams were
  empty, so the next read is a blocking one.

``poll`` reads a reply only once it has arrived (an idle loop passes a timeout and sleeps on the
socket), hands over what it produced and sends the next round trip. A request that arrives
during an engine step is read when the step ends and goes into the engine before the next one;
its ``START`` travels during that step. Nothing runs concurrently with the engine: an intake
*thread* made the step an arrival landed in about 0.9 ms longer (the GIL changing hands in the
middle of the step, measured in issue 5's notes), and every new request paid that in TTFT.

A blocking read is armed only while the engine has room (and leaves out the levels capped at 0,
``PriorityStreams.caps``; once such a level may be read again it is cancelled and sent anew):
when the budget drops to zero it is cancelled (``CLIENT UNBLOCK`` from another connection,
which makes it answer at once), so a full worker leaves arrivals in Redis for others.
Exception: one blocking read reads up to one entry per stream, so it can exceed a budget (or a
cap) smaller than the number of streams; every entry read is started and handed over (none is
left unstarted in this worker's pending list).

Early start: a new request (not handed back, so nothing to resume) is handed over as an
``early`` job as soon as it is read, before its ``START`` has answered, and ``resolved`` once
it has (as a job too if it answered ok). The loop may put an early job into its engine at once
but publishes nothing for it until it is resolved, and takes it out again if it did not become a
job. Handed-back entries (``h`` field) wait for ``START``, which returns their tokens.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import redis

from tokenfleet.worker.intake import Intake
from tokenfleet.worker.intake.jobs import Entry, Job, StartReport
from tokenfleet.worker.intake.starting import PendingStart
from tokenfleet.worker.intake.streams import PendingRead
from tokenfleet.worker.pipelined import dedicated_connection

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
    """Reads and starts entries with round trips the loop drives (see the module docstring).

    Invariant: at most one of ``_read`` / ``_start`` is in flight, on ``_conn``.
    """

    _unblock_refused = False  # CLIENT UNBLOCK answered an error once: never sent again

    def __init__(self, intake: Intake, *, block_ms: int) -> None:
        self.intake = intake
        self.block_ms = block_ms
        self._conn: Any = None
        self._conn_id: int | None = None  # CLIENT ID of _conn, for CLIENT UNBLOCK
        self._read: PendingRead | None = None
        self._start: PendingStart | None = None
        self._drained = False  # the last read found nothing waiting: block next time
        self._stopped = False

    @property
    def held(self) -> int:
        """Entries read and being started that are not in the engine yet."""
        return self._start.num_held if self._start is not None else 0

    def poll(self, budget: int, timeout_s: float = 0.0) -> Delivery:
        """Take in the replies that have arrived (waiting up to ``timeout_s`` for the first),
        hand over what they produced, and leave the next round trip in flight within
        ``budget`` (what the engine can admit now, early jobs handed over before included)."""
        out = Delivery()
        room = budget - self.held
        deadline = time.monotonic() + timeout_s
        while True:
            if self._read is None and self._start is None:
                if not self._stopped and room > 0:
                    self._send_read(room)
            elif self._read is not None and self._read.blocking and room <= 0:
                self._unblock()  # no room: leave arrivals to other workers
            elif self._read is not None and self._read.blocking and self._read.narrowed():
                self._unblock()  # a level it leaves out may be read now: read again
            pending = self._read or self._start
            if pending is None or out:
                return out
            if not pending.ready(max(0.0, deadline - time.monotonic())):
                return out
            room -= self._advance(out, room)

    def resolve(self) -> Delivery:
        """Wait for the ``START`` in flight, if any, and hand over what it produced (the loop
        needs an early job's answer before it publishes the job's tokens)."""
        out = Delivery()
        if self._start is not None:
            self._advance(out, 0)
        return out

    def stop(self) -> Delivery:
        """Stop reading: cancel a blocking read, finish what is in flight (entries already read
        are started: they are this worker's now) and hand it over. Idempotent."""
        self._stopped = True
        out = Delivery()
        if self._read is not None and self._read.blocking:
            self._unblock()
        while self._read is not None or self._start is not None:
            self._advance(out, 0)
        return out

    @property
    def starting(self) -> bool:
        """A ``START`` is in flight (entries read are not in the engine's table yet)."""
        return self._start is not None

    def reset(self) -> None:
        """Forget the round trip in flight after a lost connection (its reply will never come)
        and drop the connection; the next poll opens a new one. Whatever that round trip read
        or started is pending under this worker's name, where the loop's recovery finds it
        (``Feeder.reconcile``)."""
        self._read = self._start = None
        self._drained = False
        self.close()

    def close(self) -> None:
        """Drop the connection (after :meth:`stop`)."""
        if self._conn is not None:
            self._conn.disconnect()
            self._conn = self._conn_id = None

    # -- internals ----------------------------------------------------------------------------
    def _connection(self) -> Any:
        if self._conn is None:
            conn = dedicated_connection(self.intake.client)
            conn.send_command("CLIENT", "ID")
            self._conn_id = int(conn.read_response())
            self._conn = conn
        return self._conn

    def _send_read(self, room: int) -> None:
        block_ms = self.block_ms if self._drained else None
        self._read = self.intake.streams.send_read(
            room, block_ms=block_ms, connection=self._connection()
        )

    def _unblock(self) -> None:
        """Make the blocking read in flight answer now (with what it has read, if anything).

        A Redis user without ``CLIENT UNBLOCK`` (docs/security.md, "Redis ACL roles") is said
        once; from then on this reader leaves each blocking read to end at its own ``block_ms``
        timeout."""
        if self._conn_id is not None and not self._unblock_refused:
            try:
                self.intake.client.client_unblock(self._conn_id)
            except redis.ResponseError as exc:  # NOPERM: an ACL user without the command
                self._unblock_refused = True
                log.warning(
                    "CLIENT UNBLOCK refused (%s); from now on a blocking read ends at its "
                    "%d ms timeout (grant +client|unblock: docs/security.md, 'Redis ACL roles')",
                    exc,
                    self.block_ms,
                )
        assert self._read is not None
        self._read.blocking = False  # unblocked once; its reply comes back at once

    def _advance(self, out: Delivery, room: int) -> int:
        """Read the reply in flight into ``out`` and send what follows (a start for what was
        read, within ``room``). Returns how many entries were read."""
        if self._read is not None:
            read, self._read = self._read, None
            entries = read.receive()
            # a blocking read that timed out empty is followed by one PULL, which admits what
            # waits in tenant queues (docs/fairness.md) should no wake-up entry have come
            self._drained = not entries and read.kind == "pull"
            if entries:
                self._send_start(out, entries, room - len(entries))
            return len(entries)
        start, self._start = self._start, None
        assert start is not None
        jobs, report, pulled = start.receive()
        out.jobs.extend(jobs)
        out.reports.append(report)
        out.resolved.extend(start.early_ids)
        budget = start.pull_budget
        self._drained = budget > 0 and len(pulled) < budget
        if pulled:
            self._send_start(out, pulled, room - len(pulled))
        return len(pulled)

    def _send_start(self, out: Delivery, entries: list[Entry], room: int) -> None:
        starter = self.intake.starter
        early = starter.early_jobs(entries)
        out.early.extend(early)
        budget = 0 if self._stopped else max(0, room)
        self._start = starter.send_start(entries, early, budget, connection=self._connection())
