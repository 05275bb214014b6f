"""Handback on shutdown: requests still running when the grace period ends go back to the queue.

Each is aborted in the engine and re-queued by the ``HANDBACK`` script at the tail of its queue's
shared stream (also one that came from a routed stream: any worker may resume it), its entry
marked ``h`` (its record may hold tokens to resume from), from where any worker resumes it from
its token list; all of them in one round trip.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import redis

from tokenfleet.shared.keys import CONSUMER_GROUP, Keys
from tokenfleet.shared.scripts import registry
from tokenfleet.shared.scripts.worker import HANDBACK
from tokenfleet.worker.intake.jobs import Job
from tokenfleet.worker.service.engine_port import EnginePort

log = logging.getLogger(__name__)


def hand_back(
    client: redis.Redis, keys: Keys, engine: EnginePort, jobs: Sequence[Job], *, worker_name: str
) -> None:
    """Abort ``jobs`` in ``engine`` and re-queue each for another worker (one round trip)."""
    if not jobs:
        return
    pipe = client.pipeline(transaction=False)
    for job in jobs:
        engine.abort(job.request_id)
        e = job.entry
        registry.queue(
            client,
            pipe,
            HANDBACK,
            [
                keys.record(job.request_id),
                e.stream,
                keys.stream(job.request.model, job.request.priority),
            ],
            [
                job.request_id,
                worker_name,
                e.entry_id,
                CONSUMER_GROUP,
                e.fields.get("d") or b"",
                e.tenant,
                e.prompt_tokens,
            ],
        )
    for job, reply in zip(jobs, pipe.execute(), strict=True):
        code = registry.check_reply(HANDBACK, reply)[0]
        log.info(
            "worker %s: handed back %s at index %d (%s)",
            worker_name,
            job.request_id,
            job.num_published,
            code,
        )
