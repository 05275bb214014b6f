"""Prometheus metrics of one worker, named after vLLM's where vLLM has one (``vllm:`` →
``tokenfleet:``), labelled by served model name and, per request, by priority.

Each worker owns its own ``CollectorRegistry`` (no module-level globals), exposed by
``start_http_server`` when a metrics port is configured.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from tokenfleet.shared.priority import Priority
from tokenfleet.shared.tenants import DEFAULT_TENANT, TenantLabels

LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5, 5.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.4, 0.8, 1.6, 5.0)
THROUGHPUT_WINDOW_S = 10.0


class WorkerMetrics:
    """The worker's metrics. ``observe_*`` methods are called from the service loop only.

    Invariant: ``_window`` holds (time, tokens) of the last ``THROUGHPUT_WINDOW_S`` seconds and
    ``_window_tokens`` their sum, so the throughput gauge is that sum divided by the window's
    span (kept as a running sum: ``observe_step`` runs after every engine step, in the loop).
    The step gauges (running, waiting, KV usage, throughput) read ``_gauges`` when scraped: the
    loop only stores numbers there, so a step takes no prometheus lock for them.
    """

    def __init__(
        self,
        model_name: str,
        registry: CollectorRegistry | None = None,
        *,
        tenant_labels: int = 16,
    ) -> None:
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        # per-tenant series: at most ``tenant_labels`` names + "other" (docs/fairness.md)
        self.tenant_labels = TenantLabels(tenant_labels)
        m, mp = ["model_name"], ["model_name", "priority"]
        r = self.registry
        self.running = Gauge(
            "tokenfleet:num_requests_running", "Requests running in the engine.", m, registry=r
        )
        self.waiting = Gauge(
            "tokenfleet:num_requests_waiting",
            "Requests admitted to the engine but not yet scheduled.",
            m,
            registry=r,
        )
        self.kv_usage = Gauge(
            "tokenfleet:kv_cache_usage_perc",
            "Fraction of KV cache blocks in use (0..1).",
            m,
            registry=r,
        )
        self.throughput = Gauge(
            "tokenfleet:avg_generation_throughput_toks_per_s",
            f"Generated tokens per second over the last {THROUGHPUT_WINDOW_S:g} s.",
            m,
            registry=r,
        )
        self.preemptions = Counter(
            "tokenfleet:num_preemptions", "Running requests preempted (recompute).", m, registry=r
        )
        self.prompt_tokens = Counter(
            "tokenfleet:prompt_tokens", "Prompt tokens of finished requests.", mp, registry=r
        )
        self.generation_tokens = Counter(
            "tokenfleet:generation_tokens", "Generated tokens published.", mp, registry=r
        )
        self.prefix_hits = Counter(
            "tokenfleet:prefix_cache_hit_tokens",
            "Prompt tokens served from the prefix cache.",
            m,
            registry=r,
        )
        self.queue_time = Histogram(
            "tokenfleet:request_queue_time_seconds",
            "Enqueue to first scheduled (Redis wait included).",
            mp,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "tokenfleet:time_to_first_token_seconds",
            "Enqueue to first token.",
            mp,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "tokenfleet:time_per_output_token_seconds",
            "Mean time per output token after the first.",
            mp,
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "tokenfleet:e2e_request_latency_seconds",
            "Enqueue to finish.",
            mp,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tenant_finished = Counter(
            "tokenfleet:tenant_requests_finished",
            "Requests this worker ended, per tenant (at most --metrics-tenants names + 'other').",
            ["model_name", "tenant"],
            registry=r,
        )
        self.tenant_tokens = Counter(
            "tokenfleet:tenant_tokens_served",
            "Prompt + output tokens of the requests this worker ended, per tenant.",
            ["model_name", "tenant"],
            registry=r,
        )
        self.finished = Counter(
            "tokenfleet:request_success",
            "Requests finished, by terminal status and finish reason.",
            [*mp, "status", "finished_reason"],
            registry=r,
        )
        self.expired = Counter(
            "tokenfleet:requests_expired",
            "Requests whose deadline passed before they could start.",
            mp,
            registry=r,
        )
        self.dropped = Counter(
            "tokenfleet:requests_dropped",
            "Entries this worker could not run: dead-lettered (undecodable "
            "or invalid) or poisoned (worker_lost).",
            [*mp, "reason"],
            registry=r,
        )
        self.repairs = Counter(
            "tokenfleet:request_repairs",
            "Requests checked after a Redis rollback that needed something: repaired (put back "
            "from the worker's memory), yield (another worker had it), divergent (ended error).",
            [*m, "outcome"],
            registry=r,
        )
        self.repaired_tokens = Counter(
            "tokenfleet:repaired_tokens",
            "Token events appended again after a Redis rollback (repairs).",
            m,
            registry=r,
        )
        self.claimed = Counter(
            "tokenfleet:requests_claimed",
            "Requests claimed from workers whose heartbeat lapsed.",
            mp,
            registry=r,
        )
        self.routed = Counter(
            "tokenfleet:requests_routed",
            "Requests started, by how they came (docs/routing.md): hit (from this worker's "
            "routed stream), miss (from the shared stream), steal (another worker's routed "
            "work that waited), overflow (aged work taken as an overflow worker).",
            [*m, "how"],
            registry=r,
        )
        self.steps_cut = Counter(
            "tokenfleet:batch_steps_cut",
            "Batch-only engine steps cut short because more urgent work arrived.",
            m,
            registry=r,
        )
        self.step_time = Histogram(
            "tokenfleet:engine_step_seconds",
            "Duration of one engine step (schedule, forward pass, sampling).",
            m,
            buckets=STEP_BUCKETS,
            registry=r,
        )
        # the last error this worker met, for its heartbeat (``tokenfleet status``, the
        # console): (epoch seconds, "CODE: message"); None before the first
        self.last_error: tuple[float, str] | None = None
        self._window: deque[tuple[float, int]] = deque()
        self._window_tokens = 0
        # the step gauges' children, looked up once (labels() takes a lock and hashes each time)
        self._preemptions = self.preemptions.labels(model_name)
        self._prefix_hits = self.prefix_hits.labels(model_name)
        self._steps_cut = self.steps_cut.labels(model_name)
        self._step_time = self.step_time.labels(model_name)
        # what the step gauges show when scraped; written by the loop (a dict store is atomic)
        self._gauges: dict[str, float] = dict.fromkeys(
            ("running", "waiting", "kv_usage", "throughput"), 0.0
        )
        for name, gauge in (
            ("running", self.running),
            ("waiting", self.waiting),
            ("kv_usage", self.kv_usage),
            ("throughput", self.throughput),
        ):
            gauge.labels(model_name).set_function(functools.partial(self._gauges.__getitem__, name))
        self._generation_tokens: dict[Priority, Any] = {}

    def serve(self, port: int, addr: str = "0.0.0.0") -> Any:
        """Start the HTTP endpoint (a daemon thread); returns the server object."""
        return start_http_server(port, addr=addr, registry=self.registry)

    def observe_step(
        self, now: float, num_tokens: int, stats: Any, capacity: Any, num_kv_blocks_total: int
    ) -> None:
        """After each step: gauges, preemptions, prefix hits, the throughput window."""
        gauges = self._gauges
        if stats is not None:
            duration = getattr(stats, "duration_s", 0.0)
            if duration > 0:
                self._step_time.observe(duration)
            preempted = getattr(stats, "num_preemptions", 0)
            if preempted:
                self._preemptions.inc(preempted)
            if getattr(stats, "cut", False):
                self._steps_cut.inc()
            hits = getattr(stats, "num_prefix_cache_hit_tokens", 0)
            if hits:
                self._prefix_hits.inc(hits)
            if num_kv_blocks_total > 0:
                gauges["kv_usage"] = getattr(stats, "num_kv_blocks_used", 0) / num_kv_blocks_total
        if capacity is not None:
            gauges["running"] = capacity.num_running
            gauges["waiting"] = capacity.num_waiting
        self._window.append((now, num_tokens))
        self._window_tokens += num_tokens
        while self._window and self._window[0][0] < now - THROUGHPUT_WINDOW_S:
            self._window_tokens -= self._window.popleft()[1]
        span = now - self._window[0][0] if len(self._window) > 1 else 0.0
        gauges["throughput"] = self._window_tokens / span if span > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second over the last ``THROUGHPUT_WINDOW_S`` (the gauge's value,
        which the heartbeat carries too)."""
        return self._gauges["throughput"]

    def note_error(self, what: str, now: float | None = None) -> None:
        """Remember ``what`` ("CODE: message") as the last error (the heartbeat shows it)."""
        self.last_error = (time.time() if now is None else now, what[:500])

    def observe_tokens(self, priority: Priority, n: int) -> None:
        """``n`` tokens published for requests of ``priority`` (the loop sums them per step)."""
        child = self._generation_tokens.get(priority)
        if child is None:
            child = self._generation_tokens[priority] = self.generation_tokens.labels(
                self.model_name, priority.label
            )
        child.inc(n)

    def observe_finish(
        self,
        priority: Priority,
        status: str,
        finish_reason: str | None,
        num_prompt_tokens: int,
        timings: dict[str, float],
        error: str = "",
        *,
        tenant: str = "",
        num_output_tokens: int = 0,
    ) -> None:
        """A request this worker ran reached a terminal state (``error``: "CODE: message" of an
        ``error`` end, noted as the last error; ``tenant``: "" for the default tenant's)."""
        if error:
            self.note_error(error)
        label = self.tenant_labels.label(tenant or DEFAULT_TENANT)
        self.tenant_finished.labels(self.model_name, label).inc()
        self.tenant_tokens.labels(self.model_name, label).inc(num_prompt_tokens + num_output_tokens)
        labels = (self.model_name, priority.label)
        self.finished.labels(*labels, status, finish_reason or "").inc()
        self.prompt_tokens.labels(*labels).inc(num_prompt_tokens)
        for key, hist in (
            ("queue_s", self.queue_time),
            ("ttft_s", self.ttft),
            ("tpot_s", self.tpot),
            ("e2e_s", self.e2e),
        ):
            value = timings.get(key)
            if value is not None and value >= 0:
                hist.labels(*labels).observe(value)

    def observe_route(self, how: str) -> None:
        """A request started: ``hit``, ``miss``, ``steal`` or ``overflow`` (``routed``)."""
        self.routed.labels(self.model_name, how).inc()

    def observe_repair(self, outcome: str, tokens: int) -> None:
        """A repair's outcome (``repaired``, ``yield``, ``divergent``) and tokens put back."""
        self.repairs.labels(self.model_name, outcome).inc()
        if tokens:
            self.repaired_tokens.labels(self.model_name).inc(tokens)

    def observe_outcome(self, priority: Priority, kind: str) -> None:
        """An entry that never ran: ``expired``, ``dead_letter``, ``worker_lost``, ``claimed``."""
        labels = (self.model_name, priority.label)
        if kind in ("dead_letter", "worker_lost"):
            self.note_error(f"{kind}: an entry of the {priority.label} queue could not run")
        if kind == "expired":
            self.expired.labels(*labels).inc()
        elif kind == "claimed":
            self.claimed.labels(*labels).inc()
        else:
            self.dropped.labels(*labels, kind).inc()
