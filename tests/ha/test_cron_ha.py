"""The cron runner and rq's jobs in the HA modes, against the session's real Sentinel setup and
Redis Cluster. Sentinel: the cron process reaches rq's queues on the primary the sentinels name
(its ``--redis-url`` names a port where nothing listens), an rq worker on the same connection
runs the job, and the job reaches the fleet through the sentinels too. Cluster: the cron process
refuses the cluster for rq; run on a standalone Redis for rq instead, its job reaches the fleet
on the cluster through the rq worker's own settings (the environment)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis
from ha_helpers import NOWHERE_URL, cluster_settings, ha_settings, seed_url, sentinel_flags
from rq import Queue, SimpleWorker
from rq.job import Job
from rq.serializers import JSONSerializer

from tokenfleet.producer import Client, cron
from tokenfleet.shared.redis_connect import redis_client
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.devtools.testing.local_cluster import LocalCluster
from tokenfleet.worker.devtools.testing.local_sentinel import LocalSentinel

CRON_CONFIG = str(Path(__file__).resolve().parents[2] / "examples" / "cron_config.py")
CRON_QUEUE = "tokenfleet-cron"  # the config's queue; its job asks for priority batch


def _fill_batch_queue(settings: Settings) -> None:
    """A bound of 0 on the fleet's batch queue: the config's job (``on_overload="skip"``) then
    comes back ``skipped`` from the fleet at once, which shows which Redis it reached."""
    with Client.from_url(settings=settings) as client:
        client.set_queue_config("batch", max_waiting=0, policy="block")


def _run_cron_job(connection: redis.Redis) -> dict[str, Any]:
    """Run the one job the cron enqueued on ``connection`` in an rq worker there; its value."""
    queue = Queue(CRON_QUEUE, connection=connection, serializer=JSONSerializer)
    [job] = queue.get_jobs()
    assert job.func_name == "tokenfleet.producer.jobs.generate"
    SimpleWorker([queue], connection=connection, serializer=JSONSerializer).work(burst=True)
    job = Job.fetch(job.id, connection=connection, serializer=JSONSerializer)
    value = job.return_value()
    assert isinstance(value, dict), (job.get_status(), job.latest_result())
    return value


def _delete(r: redis.Redis, pattern: str) -> None:
    for key in list(r.scan_iter(match=pattern)):
        r.delete(key)


def test_cron_in_sentinel_mode_enqueues_on_the_primary_and_the_job_reaches_the_fleet(
    sentinel_setup: LocalSentinel, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefix = "hacron"
    monkeypatch.delenv("RQ_REDIS_URL", raising=False)
    for var, setting in sentinel_setup.settings_env().items():  # the rq worker's job reads these
        monkeypatch.setenv(var, setting)
    monkeypatch.setenv("REDIS_URL", NOWHERE_URL)
    monkeypatch.setenv("TOKENFLEET_KEY_PREFIX", prefix)
    settings = ha_settings(sentinel_setup, prefix)
    _fill_batch_queue(settings)
    scheduler = cron.build_scheduler([CRON_CONFIG, *sentinel_flags(sentinel_setup)])
    primary = redis.Redis(port=sentinel_setup.primary_port())
    try:
        assert [j.name for j in scheduler.enqueue_jobs()] == ["hourly-summary"]
        on_primary = Queue(CRON_QUEUE, connection=primary, serializer=JSONSerializer)
        assert len(on_primary.get_jobs()) == 1  # where the sentinels said, not NOWHERE_URL
        value = _run_cron_job(scheduler.connection)
        assert value["status"] == "skipped" and "is full" in value["reason"], value
    finally:
        scheduler.connection.close()
        _delete(primary, "rq:*")
        _delete(primary, f"{prefix}:*")
        primary.close()


def test_rq_on_a_standalone_redis_with_the_fleet_on_a_cluster(
    redis_cluster: LocalCluster, r: redis.Redis, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefix = "hacronc"
    monkeypatch.delenv("RQ_REDIS_URL", raising=False)
    monkeypatch.setenv("TOKENFLEET_REDIS_MODE", "cluster")  # the fleet's settings, shared by
    monkeypatch.setenv("REDIS_URL", seed_url(redis_cluster, prefix))  # cron and the rq worker
    monkeypatch.setenv("TOKENFLEET_KEY_PREFIX", prefix)
    assert cron.main([CRON_CONFIG]) == 2  # rq on the cluster: refused at start
    settings = cluster_settings(redis_cluster, prefix)
    _fill_batch_queue(settings)
    scheduler = cron.build_scheduler(
        [CRON_CONFIG, "--redis-mode", "standalone", "--url", redis_url]
    )
    try:
        assert [j.name for j in scheduler.enqueue_jobs()] == ["hourly-summary"]
        value = _run_cron_job(r)  # an rq worker on rq's Redis; the job reads the environment
        assert value["status"] == "skipped" and "is full" in value["reason"], value
        assert not list(r.scan_iter(match=f"{prefix}:*"))  # no fleet key on rq's Redis
    finally:
        scheduler.connection.close()
        with redis_client(settings) as owner:
            _delete(owner, f"{{{prefix}}}:*")
