"""The proxy's Prometheus metrics (``/metrics``), all prefixed ``pipefill_``.

One registry per proxy instance (tests run several in one process). Per-backend label children
are cached in :class:`BackendMetrics` so the hot path does no label lookups per token.
Gauges that mirror state (in flight, health, limit) are read from the pool at scrape time.
Each metric is documented in docs/proxy.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from proxy.backends import Backend, State

disable_created_metrics()  # no *_created series: they double the output for no use here

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5)
LAG_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)


class BackendMetrics:
    """Cached label children for one backend."""

    __slots__ = ("disconnects", "duration", "itl", "tokens", "ttft")

    def __init__(self, m: Metrics, name: str) -> None:
        self.duration = m.request_duration.labels(name)
        self.ttft = m.ttft.labels(name)
        self.itl = m.itl.labels(name)
        self.tokens = m.output_tokens.labels(name)
        self.disconnects = m.client_disconnects.labels(name)


class _PoolCollector(Collector):
    def __init__(self, backends: Callable[[], Iterable[Backend]]) -> None:
        self._backends = backends

    def collect(self):
        in_flight = GaugeMetricFamily(
            "pipefill_backend_in_flight",
            "Requests the proxy has in flight per backend",
            labels=["backend"],
        )
        healthy = GaugeMetricFamily(
            "pipefill_backend_healthy", "1 if the backend is healthy, else 0", labels=["backend"]
        )
        state = GaugeMetricFamily(
            "pipefill_backend_state",
            "1 for the backend's current state",
            labels=["backend", "state"],
        )
        limit = GaugeMetricFamily(
            "pipefill_backend_limit", "The backend's current concurrency limit", labels=["backend"]
        )
        for b in self._backends():
            in_flight.add_metric([b.name], b.in_flight)
            healthy.add_metric([b.name], 1.0 if b.state is State.HEALTHY else 0.0)
            for s in State:
                state.add_metric([b.name, s.value], 1.0 if b.state is s else 0.0)
            value = getattr(b.limit, "limit", None)
            if isinstance(value, int | float):
                limit.add_metric([b.name], value)
        yield from (in_flight, healthy, state, limit)


class Metrics:
    def __init__(self, backends: Callable[[], Iterable[Backend]]) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "pipefill_requests",
            "Requests answered, by backend ('none' if none served it), route and HTTP status",
            ["backend", "route", "status"],
            registry=r,
        )
        self.request_duration = Histogram(
            "pipefill_request_duration_seconds",
            "Time from the request reaching the proxy to the last byte of its response",
            ["backend"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "pipefill_ttft_seconds",
            "Time from sending upstream to the first token-carrying SSE event",
            ["backend"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "pipefill_itl_seconds",
            "Inter-token latency: gap between token-carrying events / tokens in the event",
            ["backend"],
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.output_tokens = Counter(
            "pipefill_output_tokens", "Generated tokens relayed to clients", ["backend"], registry=r
        )
        self.upstream_errors = Counter(
            "pipefill_upstream_errors",
            "Failed upstream attempts by kind (connect, disconnect, http_5xx, *_timeout, ...)",
            ["backend", "kind"],
            registry=r,
        )
        self.retries = Counter(
            "pipefill_retries",
            "Upstream attempts repeated before any byte reached the client, by reason",
            ["reason"],
            registry=r,
        )
        self.client_disconnects = Counter(
            "pipefill_client_disconnects",
            "Clients that went away before their response ended (upstream closed at once)",
            ["backend"],
            registry=r,
        )
        self.health_checks = Counter(
            "pipefill_health_checks",
            "Active health checks by result",
            ["backend", "result"],
            registry=r,
        )
        self.ejections = Counter(
            "pipefill_backend_ejections",
            "Passive ejections after consecutive request failures",
            ["backend"],
            registry=r,
        )
        self.rejections = Counter(
            "pipefill_rejections",
            "Requests the proxy refused itself, by reason (bad_request, auth, queue_full, ...)",
            ["reason"],
            registry=r,
        )
        self.loop_lag = Histogram(
            "pipefill_event_loop_lag_seconds",
            "How late the event loop runs a timer (sampled every 0.25 s)",
            buckets=LAG_BUCKETS,
            registry=r,
        )
        r.register(_PoolCollector(backends))
        self._backend_cache: dict[str, BackendMetrics] = {}

    def backend(self, name: str) -> BackendMetrics:
        cached = self._backend_cache.get(name)
        if cached is None:
            cached = self._backend_cache[name] = BackendMetrics(self, name)
        return cached

    def render(self) -> bytes:
        return generate_latest(self.registry)


# ---- ADAPT: admission/limit metrics may be appended below this line ------------------------
