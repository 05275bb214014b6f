"""The fleet's own metrics, exported by every gateway at ``GET /metrics`` beside its HTTP ones:
what lives in Redis rather than in any one process (deploy/grafana's dashboards read them).

Read at scrape time from ``AsyncClient.fleet_status()`` (the reading ``tokenfleet status
--json`` and the console make) and the active batches, at most once per ``MIN_AGE_S`` however
often it is scraped; a scrape while Redis is away exports the HTTP metrics and
``tokenfleet_fleet_up 0``. Several gateways export the same fleet series: aggregate them with
``max by (...)`` (the dashboards do).

Series (labels: ``model``, ``priority``; ``status`` a terminal status; ``pool``, ``member``)::

    tokenfleet_fleet_up                          1 when the last reading succeeded
    tokenfleet_queue_waiting / _running          requests waiting / running per queue
    tokenfleet_queue_max_waiting                 the queue's bound
    tokenfleet_queue_oldest_wait_seconds         how long its oldest waiting request has waited
    tokenfleet_queue_ended_total{status}         requests of the queue that ended in status
    tokenfleet_fleet_workers{model}              live workers per model
    tokenfleet_dead_letters                      entries in the dead-letter streams
    tokenfleet_pool_blocks{pool}                 a KV pool's total blocks
    tokenfleet_pool_held_blocks{pool,member}     blocks a member holds
    tokenfleet_pool_member_weight{pool,member}   its share weight
    tokenfleet_batch_lines{batch,state}          an active batch's total, completed, failed lines
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import redis
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenfleet.producer.async_client import AsyncClient
from tokenfleet.producer.gateway.batches.store import BatchStore

MIN_AGE_S = 1.0
ACTIVE_BATCHES = 100  # the most active batches exported


class FleetMetrics(Collector):
    """A prometheus collector over the last fleet reading (module docstring)."""

    def __init__(self, client: AsyncClient, batches: BatchStore) -> None:
        self._client = client
        self._batches = batches
        self._at = 0.0
        self._status: dict[str, Any] | None = None
        self._active: list[dict[str, Any]] = []

    async def refresh(self) -> None:
        """Read the fleet unless the last reading is younger than ``MIN_AGE_S``."""
        if time.monotonic() - self._at < MIN_AGE_S:
            return
        self._at = time.monotonic()
        try:
            self._status = await self._client.fleet_status()
            self._active = [b.to_dict() for b in await self._batches.active(ACTIVE_BATCHES)]
        except redis.RedisError:
            self._status, self._active = None, []

    def collect(self) -> Iterator[Metric]:
        """The series of the last reading."""
        up = GaugeMetricFamily("tokenfleet_fleet_up", "1 when the fleet's last reading succeeded")
        up.add_metric([], 0 if self._status is None else 1)
        yield up
        if self._status is None:
            return
        yield from _queues(self._status["queues"])
        workers = GaugeMetricFamily("tokenfleet_fleet_workers", "Live workers", labels=["model"])
        per_model: dict[str, int] = {}
        for w in self._status["workers"]:
            per_model[w["model"]] = per_model.get(w["model"], 0) + 1
        for model, n in sorted(per_model.items()):
            workers.add_metric([model], n)
        yield workers
        dead = GaugeMetricFamily("tokenfleet_dead_letters", "Entries in the dead-letter streams")
        dead.add_metric([], self._status["dead_letters"])
        yield dead
        yield from _pools(self._status["pools"])
        lines = GaugeMetricFamily(
            "tokenfleet_batch_lines", "An active batch's lines", labels=["batch", "state"]
        )
        for b in self._active:
            counts = b["request_counts"]
            for state in ("total", "completed", "failed"):
                lines.add_metric([b["id"], state], counts[state])
        yield lines


def _queues(queues: list[dict[str, Any]]) -> Iterator[Metric]:
    labels = ["model", "priority"]
    gauges = {
        "waiting": GaugeMetricFamily("tokenfleet_queue_waiting", "Requests waiting", labels=labels),
        "running": GaugeMetricFamily("tokenfleet_queue_running", "Requests running", labels=labels),
        "max_waiting": GaugeMetricFamily(
            "tokenfleet_queue_max_waiting", "The queue's bound on waiting requests", labels=labels
        ),
    }
    oldest = GaugeMetricFamily(
        "tokenfleet_queue_oldest_wait_seconds",
        "How long the oldest waiting request has waited",
        labels=labels,
    )
    ended = CounterMetricFamily(
        "tokenfleet_queue_ended",
        "Requests of the queue that reached each terminal status",
        labels=[*labels, "status"],
    )
    now = time.time()
    for q in queues:
        key = [q["model"], q["priority"]]
        for name, family in gauges.items():
            family.add_metric(key, q[name])
        at = q["oldest_waiting_at"]
        oldest.add_metric(key, max(0.0, now - at) if at is not None else 0.0)
        for status, ends in q["ended"].items():
            ended.add_metric([*key, status], ends["total"])
    yield from gauges.values()
    yield oldest
    yield ended


def _pools(pools: list[dict[str, Any]]) -> Iterator[Metric]:
    total = GaugeMetricFamily("tokenfleet_pool_blocks", "A KV pool's blocks", labels=["pool"])
    held = GaugeMetricFamily(
        "tokenfleet_pool_held_blocks", "Blocks a pool member holds", labels=["pool", "member"]
    )
    weight = GaugeMetricFamily(
        "tokenfleet_pool_member_weight", "A pool member's share weight", labels=["pool", "member"]
    )
    for p in pools:
        total.add_metric([p["name"]], p["total"])
        for m in p["members"]:
            held.add_metric([p["name"], m["name"]], m["held"])
            weight.add_metric([p["name"], m["name"]], m["weight"])
    yield total
    yield held
    yield weight
