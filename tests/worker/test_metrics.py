"""WorkerMetrics as a scrape sees it: step gauges read at collection time, counters per priority;
the routing counter as a real worker's ``/metrics`` endpoint serves it."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families
from thread_worker import ThreadWorker
from worker_helpers import wait_for

from tokenfleet.producer import Client
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.devtools.local_redis import RedisServer, free_port
from tokenfleet.worker.service.metrics import THROUGHPUT_WINDOW_S, WorkerMetrics


def _value(m: WorkerMetrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, {"model_name": "tiny", **labels})


def _stats(used: int, preemptions: int = 0, hits: int = 0) -> SimpleNamespace:
    return SimpleNamespace(
        num_kv_blocks_used=used, num_preemptions=preemptions, num_prefix_cache_hit_tokens=hits
    )


def test_step_gauges_show_the_last_step_and_a_windowed_throughput() -> None:
    m = WorkerMetrics("tiny")
    cap = SimpleNamespace(num_running=3, num_waiting=1)
    m.observe_step(100.0, 4, _stats(25, preemptions=2, hits=16), cap, 100)
    m.observe_step(101.0, 6, _stats(30), SimpleNamespace(num_running=5, num_waiting=0), 100)
    assert _value(m, "tokenfleet:num_requests_running") == 5
    assert _value(m, "tokenfleet:num_requests_waiting") == 0
    assert _value(m, "tokenfleet:kv_cache_usage_perc") == 0.30
    assert _value(m, "tokenfleet:avg_generation_throughput_toks_per_s") == 10.0  # 10 tok / 1 s
    assert _value(m, "tokenfleet:num_preemptions_total") == 2
    assert _value(m, "tokenfleet:prefix_cache_hit_tokens_total") == 16
    # steps older than the window drop out of the throughput
    m.observe_step(101.0 + THROUGHPUT_WINDOW_S + 1, 3, _stats(0), cap, 100)
    m.observe_step(102.0 + THROUGHPUT_WINDOW_S + 1, 5, _stats(0), cap, 100)
    assert _value(m, "tokenfleet:avg_generation_throughput_toks_per_s") == 8.0


def test_generation_tokens_are_counted_per_priority() -> None:
    m = WorkerMetrics("tiny")
    m.observe_tokens(Priority.CRITICAL, 3)
    m.observe_tokens(Priority.BATCH, 1)
    m.observe_tokens(Priority.CRITICAL, 2)
    assert _value(m, "tokenfleet:generation_tokens_total", priority="critical") == 5
    assert _value(m, "tokenfleet:generation_tokens_total", priority="batch") == 1
    assert _value(m, "tokenfleet:generation_tokens_total", priority="normal") is None


def test_per_tenant_series_are_bounded_by_the_declared_limit() -> None:
    """The first ``tenant_labels`` tenants keep their names, every later one is "other" (the
    metric's series stay bounded whatever names clients send; docs/fairness.md)."""
    m = WorkerMetrics("tiny", tenant_labels=2)
    for i, tenant in enumerate(["", "acme", "globex", "initech", "acme"]):
        m.observe_finish(
            Priority.NORMAL, "done", "stop", 10, {}, tenant=tenant, num_output_tokens=i
        )
    served = "tokenfleet:tenant_tokens_served_total"
    assert _value(m, served, tenant="default") == 10
    assert _value(m, served, tenant="acme") == (10 + 1) + (10 + 4)
    assert _value(m, served, tenant="other") == (10 + 2) + (10 + 3)  # globex and initech
    assert _value(m, served, tenant="globex") is None
    assert _value(m, "tokenfleet:tenant_requests_finished_total", tenant="other") == 2


def test_a_beat_names_the_running_tenants_only_when_there_are_others() -> None:
    from tokenfleet.worker.service.heartbeat import TENANTS_IN_BEAT, tenants_running

    assert tenants_running(["", "", "default"]) == {}  # one tenant: the beat as it was
    assert tenants_running(["", "acme", "acme"]) == {"tenants_running": "acme=2,default=1"}
    many = [f"t{i}" for i in range(TENANTS_IN_BEAT + 3)]
    field = tenants_running(many)["tenants_running"].split(",")
    assert len(field) == TENANTS_IN_BEAT + 1 and field[-1] == "other=3"


def _routed_counts(port: int) -> dict[str, float]:
    """``tokenfleet:requests_routed_total`` by ``how``, scraped from a worker's endpoint."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as f:
        text = f.read().decode()
    return {
        sample.labels["how"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "tokenfleet:requests_routed_total"
        and sample.labels.get("model_name") == "default"
    }


@pytest.mark.slow
def test_a_worker_counts_how_each_request_it_started_came(
    tiny_model_dir: Path, redis_server: RedisServer, tmp_path: Path
) -> None:
    """A session's request routed to the worker's own stream is a ``hit``, a short prompt with
    no session (the shared stream) a ``miss``: counted when they start, so once they are done."""
    prefix, port = "tmr", free_port()
    keys = Keys(prefix)
    rr = redis.Redis.from_url(redis_server.url)
    worker = ThreadWorker(  # (nothing signals it: a thread of this process)
        tiny_model_dir, redis_server.url, prefix, "mr-1", "--metrics-port", str(port)
    )
    try:
        worker.wait_ready(rr)
        wait_for(
            lambda: (rr.zscore(keys.routers("default"), "mr-1") or 0) > time.time(),
            "mr-1 to be a routing target",
        )
        settings = Settings(redis_url=redis_server.url, key_prefix=prefix)
        with Client.from_url(settings=settings) as client:
            hits = [  # two sessions, two prompts (no shared prefix: each is routed by session)
                client.submit(
                    messages=[{"role": "user", "content": f"hi {i}"}],
                    max_tokens=2,
                    metadata={"session": f"s{i}"},
                )
                for i in range(2)
            ]
            miss = client.submit("a short prompt", max_tokens=2)
            for handle in (*hits, miss):
                handle.result(timeout=120)
            routes = [client.status(h.request_id) for h in (*hits, miss)]
        assert [(rec.route, rec.routed_to) for rec in routes] == [
            ("session", "mr-1"),
            ("session", "mr-1"),
            ("shared", ""),
        ]
        assert _routed_counts(port) == {"hit": 2.0, "miss": 1.0}
    finally:
        worker.close()
        rr.delete(*(rr.keys(f"{prefix}:*") or ["-"]))
        rr.close()


def test_step_times_and_the_heartbeats_own_figures() -> None:
    """Each step's duration goes to the step-time histogram; the heartbeat carries the
    throughput window's tokens/s, the engine's device and the last error met (a request that
    ended ``error``, or an entry that could not run), with its time."""
    from tokenfleet.worker.service.heartbeat import worker_stats

    m = WorkerMetrics("tiny")
    cap = SimpleNamespace(num_running=1, num_waiting=0, free_kv_blocks=10)
    stats = SimpleNamespace(num_kv_blocks_used=2, duration_s=0.004)
    m.observe_step(100.0, 4, stats, cap, 12)
    m.observe_step(102.0, 6, stats, cap, 12)
    assert _value(m, "tokenfleet:engine_step_seconds_count") == 2
    assert _value(m, "tokenfleet:engine_step_seconds_sum") == pytest.approx(0.008)
    engine = SimpleNamespace(
        capacity=lambda: cap,
        last_step_stats=stats,
        runner=SimpleNamespace(device="cpu"),
    )
    ws = SimpleNamespace(model_name="tiny", priorities=[Priority.NORMAL], device=None)
    beat = worker_stats(
        ws, engine, running=1, kv_total=12, tokens_total=10, stopping=False, metrics=m
    )
    assert (beat["device"], beat["tokens_per_s"]) == ("cpu", 5.0)  # 10 tokens in 2 s
    assert "last_error" not in beat
    m.observe_finish(Priority.NORMAL, "done", "stop", 3, {})
    assert m.last_error is None  # a request that ended well is no error
    m.observe_finish(Priority.NORMAL, "error", None, 3, {}, error="engine_error: boom")
    m.observe_outcome(Priority.BATCH, "expired")
    assert m.last_error is not None and m.last_error[1] == "engine_error: boom"
    m.observe_outcome(Priority.BATCH, "worker_lost")
    beat = worker_stats(
        ws, engine, running=1, kv_total=12, tokens_total=10, stopping=False, metrics=m
    )
    assert beat["last_error"].startswith("worker_lost: ")
    assert beat["last_error_at"] == pytest.approx(time.time(), abs=5)
