"""rq integration: the ``generate`` job and the cron config, run by a real rq ``SimpleWorker``
in burst mode, with rq's JSON serializer everywhere (nothing is pickled)."""

from __future__ import annotations

import json
import threading
import zlib
from pathlib import Path
from typing import Any

import pytest
import redis
from producer_helpers import FakeWorker
from rq import Queue, SimpleWorker
from rq.job import Job
from rq.serializers import JSONSerializer

from tokenfleet.producer import Client
from tokenfleet.producer.cron import JsonCronScheduler
from tokenfleet.producer.jobs import generate, url_of
from tokenfleet.shared.priority import Priority

CRON_CONFIG = Path(__file__).resolve().parents[2] / "examples" / "cron_config.py"


@pytest.fixture(autouse=True)
def _prefix(monkeypatch: pytest.MonkeyPatch, redis_url: str) -> None:
    """Jobs build their client from the environment, as in production."""
    monkeypatch.setenv("TOKENFLEET_KEY_PREFIX", "tft")
    monkeypatch.setenv("REDIS_URL", redis_url)


def _run_burst(
    r: redis.Redis,
    queue: Queue,
    serve: FakeWorker | None,
    texts: list[str],
    priority: Priority = Priority.NORMAL,
) -> None:
    thread = None
    if serve is not None:
        thread = threading.Thread(target=serve.serve, args=(texts, priority, 20_000))
        thread.start()
    SimpleWorker([queue], connection=r, serializer=JSONSerializer).work(burst=True)
    if thread is not None:
        thread.join(30)


def _value(job: Job) -> Any:
    value = job.return_value()
    assert value is not None, job.get_status()
    return value


def _stored_payload(r: redis.Redis, job: Job) -> object:
    return json.loads(zlib.decompress(r.hget(job.key, "data")))  # type: ignore[arg-type]


def test_generate_job_returns_json_result(r: redis.Redis, worker: FakeWorker) -> None:
    queue = Queue("tokenfleet", connection=r, serializer=JSONSerializer)
    job = queue.enqueue(generate, prompt="hi", max_tokens=4, temperature=0.0, result_timeout=15)
    assert _stored_payload(r, job)  # JSON, not a pickle
    _run_burst(r, queue, worker, ["he", "llo"])
    job = Job.fetch(job.id, connection=r, serializer=JSONSerializer)
    result = _value(job)
    assert result["text"] == "hello" and result["token_ids"] == [100, 101]
    assert result["status"] == "done"
    assert result["request_id"].startswith(f"rq-{job.id}")


def test_generate_skip_and_fail_on_overload(r: redis.Redis, client: Client) -> None:
    client.set_queue_config("normal", max_waiting=0, policy="block")
    queue = Queue("tokenfleet", connection=r, serializer=JSONSerializer)
    skipped = queue.enqueue(generate, prompt="hi", on_overload="skip")
    failed = queue.enqueue(
        generate, prompt="hi", on_overload="fail", timeout=0.1, result_timeout=10
    )
    _run_burst(r, queue, None, [])
    skipped = Job.fetch(skipped.id, connection=r, serializer=JSONSerializer)
    assert _value(skipped)["status"] == "skipped"
    failed = Job.fetch(failed.id, connection=r, serializer=JSONSerializer)
    assert failed.is_failed
    assert "Overloaded" in (failed.latest_result().exc_string or "")  # type: ignore[union-attr]


def test_cron_config_runs_with_json_serializer(r: redis.Redis, worker: FakeWorker) -> None:
    scheduler = JsonCronScheduler(connection=r)
    scheduler.load_config_from_file(str(CRON_CONFIG))
    [cron_job] = scheduler.get_jobs()
    assert cron_job.kwargs["on_overload"] == "skip"
    assert [j.name for j in scheduler.enqueue_jobs()] == ["hourly-summary"]
    assert scheduler.enqueue_jobs() == []  # interval not elapsed: nothing more
    queue = Queue(cron_job.queue_name, connection=r, serializer=JSONSerializer)
    [job] = queue.get_jobs()
    assert _stored_payload(r, job)
    _run_burst(r, queue, worker, ["all", " good"], Priority.BATCH)
    job = Job.fetch(job.id, connection=r, serializer=JSONSerializer)
    assert _value(job)["text"] == "all good"


def test_a_job_on_the_rq_workers_redis_names_that_server_in_its_settings() -> None:
    """With no REDIS_URL, a job talks to the rq worker's Redis; its settings must name the same
    server, since a batch's handle opens its own connections from them."""
    cases = [
        (redis.Redis(unix_socket_path="/tmp/x.sock", db=2), "unix:///tmp/x.sock?db=2"),
        (redis.Redis(host="10.0.0.5", port=6380, db=1), "redis://10.0.0.5:6380/1"),
        (
            redis.Redis(password="p@ss", username="u", port=7001),
            "redis://u:p%40ss@localhost:7001/0",
        ),
        (redis.Redis(host="h", port=7002, ssl=True), "rediss://h:7002/0"),
    ]
    for conn, url in cases:
        assert url_of(conn) == url
        back = redis.Redis.from_url(url).connection_pool.connection_kwargs
        mine = conn.connection_pool.connection_kwargs
        for key in ("host", "port", "db", "path", "username", "password"):
            assert back.get(key) == mine.get(key), (url, key)
