"""The gateway's Prometheus metrics, served at ``GET /metrics``.

One registry per app (several apps in one test process must not share counters):
``tokenfleet_gateway_requests_total{route, code}`` (every answered HTTP request by status code),
``tokenfleet_gateway_sse_streams_open`` (SSE responses now streaming),
``tokenfleet_gateway_resumes_total`` (streams resumed from a ``Last-Event-ID`` or index),
``tokenfleet_gateway_disconnects_total{action}`` (clients that left mid-request, by what it did
to the request: cancel or continue).
"""

from __future__ import annotations

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

    def exposition(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)
