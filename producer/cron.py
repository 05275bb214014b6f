"""Run an rq cron config with rq's JSON serializer, on rq's Redis in the settings' Redis mode.

rq 3.0's ``CronJob.enqueue`` builds its ``Queue`` without a serializer, so ``rq cron`` pickles
every job it enqueues whatever ``-S`` says, and the worker would have to unpickle them. This
module runs the same config files (``rq.cron.register(...)`` calls) through a ``CronScheduler``
whose enqueue uses ``JSONSerializer``::

    python -m tokenfleet.producer.cron examples/cron_config.py --url redis://redis:6379/0

Pair it with ``rq worker -S json QUEUE``.

rq's Redis (where the queues live; the cron process talks to nothing else) is ``--url``, else
``RQ_REDIS_URL``, else ``REDIS_URL``, reached in the Redis mode of the settings
(``TOKENFLEET_REDIS_MODE`` or ``--redis-mode``, with ``--sentinels`` / ``--sentinel-service``):

- ``standalone``: the server the URL names.
- ``sentinel``: the primary the sentinels name (``shared.redis_connect.redis_client``); the URL
  gives only the db, credentials and TLS, as for every tokenfleet process.
- ``cluster``: refused at start. rq talks to one server and its transactions span keys in many
  hash slots, so its queues need a standalone or Sentinel Redis; run the cron process (and
  ``rq worker``) on one with ``--redis-mode standalone --url ...``, while the jobs reach the
  fleet on the cluster through the rq worker's own settings (``producer.jobs``).
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

from tokenfleet.producer.cron_settings import CronSettings
from tokenfleet.shared.errors import SettingsError
from tokenfleet.shared.redis_connect import redis_client
from tokenfleet.shared.redis_flags import add_redis_flags, settings_from_flags
from tokenfleet.shared.settings import Settings
from tokenfleet.shared.settings_flags import add_flags, flag_values

PROG = "python -m tokenfleet.producer.cron"
CLUSTER_REFUSED = (
    "rq needs a standalone or Sentinel Redis for its queues, not a Redis Cluster "
    "(TOKENFLEET_REDIS_MODE / --redis-mode is cluster): point the cron process and rq worker at "
    "one with --redis-mode standalone --url redis://RQ-REDIS:6379/0 (or RQ_REDIS_URL); the jobs "
    "still reach the fleet on the cluster through the rq worker's own TOKENFLEET_REDIS_MODE and "
    "REDIS_URL"
)


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


def build_parser() -> argparse.ArgumentParser:
    """The command's flags: the config, then the flags generated from ``CronSettings`` (rq's
    Redis: ``--url``, alias ``--redis-url``; the log level) and the connection's Redis-mode flags
    (``shared.redis_flags``; its own ``--redis-url`` is rq's here)."""
    parser = argparse.ArgumentParser(prog=PROG)
    parser.add_argument("config", help="cron config file or module (rq.cron.register calls)")
    add_flags(parser, CronSettings)
    add_redis_flags(parser, exclude=("redis_url",))
    return parser


def cron_settings(args: argparse.Namespace) -> CronSettings:
    """The cron process's own settings: the environment with the flags in ``args`` on top."""
    return CronSettings.from_env(**flag_values(args, CronSettings))


def rq_settings(args: argparse.Namespace) -> Settings:
    """The settings of rq's Redis: the environment with the flags on top, the URL being
    ``--url``, else ``RQ_REDIS_URL``, else ``REDIS_URL``.

    Raises:
        SettingsError: a bad environment variable or flag value.
    """
    return settings_from_flags(args, redis_url=cron_settings(args).rq_redis_url or None)


def rq_connection(settings: Settings) -> Redis:
    """A sync client on rq's Redis in the settings' mode (module docstring).

    Raises:
        SettingsError: cluster mode (rq's queues need a standalone or Sentinel Redis).
    """
    if settings.redis_mode == "cluster":
        raise SettingsError(CLUSTER_REFUSED)
    return redis_client(settings)


def build_scheduler(argv: Sequence[str] | None = None) -> JsonCronScheduler:
    """Parse ``argv``, connect to rq's Redis and load the config; the scheduler is not started.

    Raises:
        SettingsError: bad settings, or cluster mode.
    """
    args = build_parser().parse_args(argv)
    connection = rq_connection(rq_settings(args))
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # like `rq cron --path .`: relative configs import
    level = cron_settings(args).logging_level.upper()
    scheduler = JsonCronScheduler(connection=connection, logging_level=level)
    scheduler.load_config_from_file(args.config)
    return scheduler


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tokenfleet.producer.cron CONFIG [--url URL] [--redis-mode MODE ...]``;
    exits 2 with a one-line message on bad settings (cluster mode included)."""
    try:
        scheduler = build_scheduler(argv)
    except SettingsError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    scheduler.start()
    return 0


if __name__ == "__main__":
    logging.basicConfig()
    sys.exit(main())
