"""Step-exception policy: what an exception raised by ``engine.step()`` does.

It gives every request in the engine a terminal ``error`` event (code ``engine_error``), aborts
them, and the worker keeps serving. After ``MAX_CONSECUTIVE_STEP_FAILURES`` failed steps with no
token produced in between the engine is deemed broken: the worker removes its heartbeat and exits
with ``EXIT_ENGINE_BROKEN`` so that its supervisor restarts it (its requests have already ended,
so nothing is left to recover).
"""

from __future__ import annotations

import logging

from tokenfleet.shared.schema import TerminalEvent, TerminalStatus
from tokenfleet.worker.publish.publisher import Finish
from tokenfleet.worker.service.feed import Feeder
from tokenfleet.worker.service.outbox import Outbox, finish_of

log = logging.getLogger(__name__)

MAX_CONSECUTIVE_STEP_FAILURES = 3
EXIT_ENGINE_BROKEN = 3


class StepFailures:
    """Counts failed steps in a row and ends the requests of each (see the module docstring).

    Invariant: ``in_a_row`` is the number of failed steps since the last step that produced a
    token (or since the start).
    """

    def __init__(self, feed: Feeder, outbox: Outbox, *, worker_name: str) -> None:
        self.feed = feed
        self.outbox = outbox
        self.table = feed.table
        self.engine = feed.engine
        self.worker_name = worker_name
        self.in_a_row = 0

    def produced_tokens(self) -> None:
        """A step produced tokens: the engine demonstrably works again."""
        self.in_a_row = 0

    def failed(self, exc: BaseException) -> bool:
        """End the requests the failed step held; True if the engine is now deemed broken."""
        table = self.table
        affected = set(table.jobs) | set(table.early)  # what was in the engine during the step
        self.outbox.flush()
        self.feed.resolve_early(set(table.early))  # early ones become jobs or leave the engine
        self.in_a_row += 1
        self.outbox.metrics.note_error(f"engine_error: {type(exc).__name__}: {exc}")
        log.exception(
            "worker %s: engine step failed (%d in a row); ending its %d requests "
            "with error/engine_error",
            self.worker_name,
            self.in_a_row,
            len(table.jobs),
        )
        finishes: list[Finish] = []
        for job in [j for rid, j in table.jobs.items() if rid in affected]:
            try:
                self.engine.abort(job.request_id)
            except Exception:
                log.exception("worker %s: abort of %s failed", self.worker_name, job.request_id)
            message = (
                f"the engine failed while running this request "
                f"({type(exc).__name__}: {exc}); it was aborted"
            )
            finishes.append(
                finish_of(
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
        self.outbox.finish_all_now(finishes)  # counts them in the metrics
        if self.in_a_row < MAX_CONSECUTIVE_STEP_FAILURES:
            return False
        log.error(
            "worker %s: %d engine steps failed in a row; exiting with status %d for "
            "the supervisor to restart it",
            self.worker_name,
            self.in_a_row,
            EXIT_ENGINE_BROKEN,
        )
        return True
