"""WorkerMetrics as a scrape sees it: step gauges read at collection time, counters per priority."""

from __future__ import annotations

from types import SimpleNamespace

from tokenfleet.shared.priority import Priority
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
