"""The server's Prometheus metrics (``GET /metrics``), in a registry of their own (never the process-global one).

* ``vla_serve_requests_total{transport, embodiment}``        answered requests (actions returned)
* ``vla_serve_errors_total{kind}``                            refused or failed requests by kind (``auth``,
  ``protocol``, ``observation``, ``limit``, ``unsafe_actions``, ``internal``, ``overloaded``)
* ``vla_serve_latency_seconds{transport}``                    request received -> response ready (histogram)
* ``vla_serve_inference_seconds``                              one batched forward pass (histogram)
* ``vla_serve_batch_size``                                     requests per forward pass (histogram)
* ``vla_serve_clamped_total{embodiment, dim}``                action values clamped to the spec's limits
* ``vla_serve_queue_depth``                                    requests waiting for the model (gauge)
* ``vla_serve_connections``                                    open WebSocket connections (gauge)
* ``vla_serve_in_flight``                                      requests accepted and not yet answered (gauge)
* ``vla_serve_rest_requests``                                  REST requests in progress, body still arriving
  included: with ``vla_serve_connections`` what counts against ``--max-connections`` (gauge)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

ERROR_KINDS = ("auth", "protocol", "observation", "limit", "unsafe_actions", "internal", "overloaded")
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class ServerMetrics:
    """Counters, histograms and gauges of one server; ``render()`` is the Prometheus text exposition."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, max_batch: int) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "vla_serve_requests", "Requests answered with actions", ["transport", "embodiment"], registry=r
        )
        self.errors = Counter("vla_serve_errors", "Requests refused or failed, by kind", ["kind"], registry=r)
        self.latency = Histogram(
            "vla_serve_latency_seconds",
            "Request received to response ready",
            ["transport"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.inference = Histogram(
            "vla_serve_inference_seconds", "One batched forward pass", buckets=_LATENCY_BUCKETS, registry=r
        )
        sizes = sorted({1, 2, 4, 8, 16, 32, 64, max_batch})
        self.batch_size = Histogram(
            "vla_serve_batch_size",
            "Requests per forward pass",
            buckets=[s for s in sizes if s <= max_batch],
            registry=r,
        )
        self.clamped = Counter(
            "vla_serve_clamped",
            "Action values clamped to the spec's limits",
            ["embodiment", "dim"],
            registry=r,
        )
        self.queue_depth = Gauge("vla_serve_queue_depth", "Requests waiting for the model", registry=r)
        self.batch_window = Gauge(
            "vla_serve_batch_window_seconds", "Wait for more requests the next batch gets", registry=r
        )
        self.connections = Gauge("vla_serve_connections", "Open WebSocket connections", registry=r)
        self.in_flight = Gauge("vla_serve_in_flight", "Requests accepted and not yet answered", registry=r)
        self.rest_requests = Gauge(
            "vla_serve_rest_requests",
            "REST requests in progress (counted against --max-connections)",
            registry=r,
        )
        for kind in ERROR_KINDS:  # every kind shows up (at 0) from the start
            self.errors.labels(kind=kind)

    def error(self, kind: str) -> None:
        self.errors.labels(kind=kind).inc()

    def answered(self, transport: str, embodiment: str, seconds: float) -> None:
        self.requests.labels(transport=transport, embodiment=embodiment).inc()
        self.latency.labels(transport=transport).observe(seconds)

    def add_clamped(self, embodiment: str, names: Sequence[str], counts: np.ndarray) -> None:
        for name, n in zip(names, counts.tolist()):
            if n:
                self.clamped.labels(embodiment=embodiment, dim=name).inc(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)
