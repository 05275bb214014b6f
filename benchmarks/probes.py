"""What a benchmark reads from the processes it runs, as counters that only grow: a process's
CPU seconds, a redis-server's, and a worker's engine step totals (its Prometheus metrics)."""

from __future__ import annotations

import os
import urllib.request
from pathlib import Path
from typing import Any

import redis
from prometheus_client.parser import text_string_to_metric_families


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def redis_cpu_s(url: str) -> float:
    """CPU seconds the redis-server has used so far (INFO cpu)."""
    r = redis.Redis.from_url(url)
    try:
        info: Any = r.info("cpu")
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
    finally:
        r.close()


def step_totals(port: int) -> tuple[float, float]:
    """(sum, count) of the worker's engine step histogram."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as got:
        text = got.read().decode()
    total = count = 0.0
    for family in text_string_to_metric_families(text):
        if family.name == "tokenfleet:engine_step_seconds":
            for s in family.samples:
                if s.name.endswith("_sum"):
                    total += s.value
                elif s.name.endswith("_count"):
                    count += s.value
    return total, count
