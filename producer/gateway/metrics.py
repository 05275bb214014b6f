"""The gateway's Prometheus metrics, served at ``GET /metrics``.

One registry per app (several apps in one test process must not share counters):
``tokenfleet_gateway_requests_total{route, code}`` (every answered HTTP request by status code),
``tokenfleet_gateway_sse_streams_open`` (SSE responses now streaming),
``tokenfleet_gateway_resumes_total`` (streams resumed from a ``Last-Event-ID`` or index),
``tokenfleet_gateway_disconnects_total{action}`` (clients that left mid-request, by what it did
to the request: cancel or continue), ``tokenfleet_gateway_console_listeners`` (fleet consoles
open on this process). With a fleet collector (``fleet_metrics.FleetMetrics``) the registry also
exports the fleet's own series, read from Redis at scrape time.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest


class GatewayMetrics:
    """Counters and gauges of one gateway app."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "tokenfleet_gateway_requests",
            "HTTP requests answered, by route and status code",
            ["route", "code"],
            registry=self.registry,
        )
        self.streams_open = Gauge(
            "tokenfleet_gateway_sse_streams_open",
            "SSE responses streaming now",
            registry=self.registry,
        )
        self.resumes = Counter(
            "tokenfleet_gateway_resumes",
            "Streams resumed from a Last-Event-ID (or ?last_event_id)",
            registry=self.registry,
        )
        self.disconnects = Counter(
            "tokenfleet_gateway_disconnects",
            "Clients that disconnected before their request ended, by what was done",
            ["action"],
            registry=self.registry,
        )

        self.console_listeners = Gauge(
            "tokenfleet_gateway_console_listeners",
            "Fleet consoles open on this gateway process (their live feeds)",
            registry=self.registry,
        )
        self.fleet: Any = None  # the fleet collector, once the app's lifespan made it

    def watch_fleet(self, collector: Any) -> None:
        """Export ``collector``'s fleet series too (``fleet_metrics.FleetMetrics``)."""
        self.registry.register(collector)
        self.fleet = collector

    async def exposition(self) -> bytes:
        """The text exposition format (the fleet's series read first, when watched)."""
        if self.fleet is not None:
            await self.fleet.refresh()
        return generate_latest(self.registry)
