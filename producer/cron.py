"""Run an rq cron config with rq's JSON serializer.

rq 3.0's ``CronJob.enqueue`` builds its ``Queue`` without a serializer, so ``rq cron`` pickles
every job it enqueues whatever ``-S`` says, and the worker would have to unpickle them. This
module runs the same config files (``rq.cron.register(...)`` calls) through a ``CronScheduler``
whose enqueue uses ``JSONSerializer``::

    python -m tokenfleet.producer.cron examples/cron_config.py --url redis://redis:6379/0

Pair it with ``rq worker -S json QUEUE``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from redis import Redis
from rq import Queue
from rq.cron import CronJob, CronScheduler
from rq.job import Job
from rq.serializers import JSONSerializer
from rq.utils import now


def enqueue_json(cron_job: CronJob, connection: Redis) -> Job:
    """Enqueue one firing of ``cron_job`` with the JSON serializer."""
    if cron_job.func is None:
        raise ValueError(f"cron job {cron_job.name} has no function to enqueue")
    queue = Queue(cron_job.queue_name, connection=connection, serializer=JSONSerializer)
    return queue.enqueue(
        cron_job.func, args=cron_job.args, kwargs=cron_job.kwargs, **cron_job.job_options
    )


class JsonCronScheduler(CronScheduler):
    """A ``CronScheduler`` whose firings are enqueued with ``JSONSerializer``."""

    def enqueue_jobs(self) -> list[CronJob]:
        """Enqueue every job that is due (same contract as ``CronScheduler.enqueue_jobs``)."""
        enqueue_time = now()
        enqueued = []
        for cron_job in self.get_jobs():
            if cron_job.should_run():
                enqueue_json(cron_job, self.connection)
                cron_job.set_enqueue_time(enqueue_time)
                enqueued.append(cron_job)
        return enqueued


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tokenfleet.producer.cron CONFIG [--url URL] [--logging-level LEVEL]``."""
    parser = argparse.ArgumentParser(prog="python -m tokenfleet.producer.cron")
    parser.add_argument("config", help="cron config file or module (rq.cron.register calls)")
    parser.add_argument(
        "--url",
        default=os.environ.get("RQ_REDIS_URL")
        or os.environ.get("REDIS_URL", "redis://localhost:6379/0"),
        help="Redis URL of the rq queues",
    )
    parser.add_argument("--logging-level", default="INFO")
    args = parser.parse_args(argv)
    sys.path.insert(0, os.getcwd())  # like `rq cron --path .`: relative configs import
    scheduler = JsonCronScheduler(
        connection=Redis.from_url(args.url), logging_level=args.logging_level.upper()
    )
    scheduler.load_config_from_file(args.config)
    scheduler.start()
    return 0


if __name__ == "__main__":
    logging.basicConfig()
    sys.exit(main())
