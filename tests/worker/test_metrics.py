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
from worker_helpers import WorkerProc, wait_for

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
    worker = WorkerProc(
        tiny_model_dir, redis_server.url, prefix, "mr-1", tmp_path, "--metrics-port", str(port)
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
