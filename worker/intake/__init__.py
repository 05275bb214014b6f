"""Intake: how entries of the priority streams become requests this worker runs.

One concept per module:

* ``jobs``: :class:`Entry` (a stream entry as read), :class:`Job` (a request this worker runs),
  :class:`StartReport` (entries that ended without running);
* ``streams``: :class:`PriorityStreams`: consumer groups, the read order (anti-starvation), the
  ``PULL`` and blocking reads and their parsing;
* ``starting``: :class:`Starter`: decoding entries and running ``START`` on them (its outcomes);
* ``outcomes``: :class:`UnstartedOutcomes`: terminal events and dead letters for entries that
  never ran;
* ``reader``: :class:`IntakeReader`: the round trips the service loop drives, one in flight,
  with early start;
* ``claimer``: :class:`Claimer`: entries of dead workers, and those an earlier process of this
  worker's name left pending.

:class:`Intake` wires the first three together for one worker and one served model.
"""

from __future__ import annotations

from collections.abc import Sequence

import redis

from tokenfleet.shared.keys import Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.intake.jobs import Entry, Job, StartReport
from tokenfleet.worker.intake.outcomes import UnstartedOutcomes
from tokenfleet.worker.intake.starting import Starter
from tokenfleet.worker.intake.streams import PriorityStreams

__all__ = ["Entry", "Intake", "Job", "StartReport"]


class Intake:
    """One worker's intake for one served model: ``streams`` (reading), ``starter`` (``START``)
    and ``outcomes`` (entries that never run), sharing one client and key prefix."""

    def __init__(
        self,
        client: redis.Redis,
        settings: Settings,
        *,
        model_name: str,
        priorities: Sequence[Priority],
        worker_name: str,
        poison_limit: int,
        starvation_pulls: int,
    ) -> None:
        self.client = client
        self.keys = Keys.for_settings(settings)
        self.worker_name = worker_name
        self.streams = PriorityStreams(
            client,
            self.keys,
            model_name=model_name,
            priorities=priorities,
            worker_name=worker_name,
            starvation_pulls=starvation_pulls,
            record_ttl_s=settings.record_ttl_s,
        )
        self.outcomes = UnstartedOutcomes(
            client, settings, model_name=model_name, worker_name=worker_name
        )
        self.starter = Starter(
            client, settings, self.streams, self.outcomes, poison_limit=poison_limit
        )
