"""The proxy's Prometheus metrics (``/metrics``), all prefixed ``pipefill_``.

One registry per proxy instance (tests run several in one process). Per-backend label children
are cached in :class:`BackendMetrics` so the hot path does no label lookups per token.
Gauges that mirror state (in flight, health, limit) are read from the pool at scrape time.
Each metric is documented in docs/proxy.md.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from proxy.backends import Backend, State
from proxy.prefix import PrefixIndex

disable_created_metrics()  # no *_created series: they double the output for no use here

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5)
LAG_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)


class EventHistogram:
    """One backend's histogram of a per-event value (ITL), observed from the relay's hot path:
    a bucket count and a sum, no lock (the event loop is its only writer; a scrape reads it in
    the same thread). prometheus_client's Histogram takes a lock per bucket and per sum on
    every observation, which per relayed event costs more than the rest of its accounting."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def cumulative(self) -> list[tuple[str, float]]:
        """(le, count at or below it), with ``le`` written as prometheus-client writes it."""
        out, total = [], 0
        for bound, n in zip((*self.bounds, math.inf), self.counts, strict=True):
            total += n
            out.append((floatToGoString(bound), total))
        return out


class _EventHistograms(Collector):
    """Exposes the backends' :class:`EventHistogram` of one metric."""

    def __init__(self, name: str, doc: str, bounds: tuple[float, ...]) -> None:
        # ``_name`` and ``_labelnames`` as prometheus-client's own metrics carry them:
        # proxy/reference.py reads them to list a metric's labels before it has a sample
        self._name, self._labelnames = name, ("backend",)
        self.doc, self.bounds = doc, bounds
        self.children: dict[str, EventHistogram] = {}

    def labels(self, backend: str) -> EventHistogram:
        return self.children.setdefault(backend, EventHistogram(self.bounds))

    def collect(self):
        family = HistogramMetricFamily(self._name, self.doc, labels=list(self._labelnames))
        for backend, h in self.children.items():
            family.add_metric([backend], h.cumulative(), sum_value=h.sum)
        yield family


class BackendMetrics:
    """Cached label children for one backend (a ``labels()`` lookup costs microseconds on
    every request)."""

    __slots__ = (
        "_m",
        "_name",
        "_requests",
        "disconnects",
        "duration",
        "itl",
        "malformed",
        "tokens",
        "ttft",
    )

    def __init__(self, m: Metrics, name: str) -> None:
        self._m, self._name = m, name
        #: pipefill_requests_total children by (route, status): routes and statuses are few
        self._requests: dict[tuple[str, int], Any] = {}
        self.duration = m.request_duration.labels(name)
        self.ttft = m.ttft.labels(name)
        self.itl = m.itl.labels(name)
        self.tokens = m.output_tokens.labels(name)
        self.disconnects = m.client_disconnects.labels(name)
        self.malformed = m.malformed_events.labels(name)

    def request(self, route: str, status: int) -> Any:
        """The pipefill_requests_total child of this backend, ``route`` and ``status``."""
        child = self._requests.get((route, status))
        if child is None:
            child = self._m.requests.labels(self._name, route, str(status))
            self._requests[(route, status)] = child
        return child


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
            limit.add_metric([b.name], b.limit.limit)
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
        self.itl = _EventHistograms(
            "pipefill_itl_seconds",
            "Inter-token latency: gap between token-carrying events / tokens in the event",
            ITL_BUCKETS,
        )
        r.register(self.itl)
        self.output_tokens = Counter(
            "pipefill_output_tokens", "Generated tokens relayed to clients", ["backend"], registry=r
        )
        self.malformed_events = Counter(
            "pipefill_malformed_events",
            "Streamed SSE events of a shape the proxy did not expect: relayed, carrying no token",
            ["backend"],
            registry=r,
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
            "Requests the proxy refused itself, by reason: the error's code (invalid_json, "
            "invalid_api_key, queue_full, ...)",
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


class _AdaptCollector(Collector):
    """Per-backend limit/knee/latency/scrape state and the proxy queue, read at scrape time."""

    def __init__(self, backends: Callable[[], Iterable[Backend]], admission: Any) -> None:
        self._backends = backends
        self._admission = admission

    def collect(self):
        def gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=labels)

        be = ["backend"]
        knee = gauge(
            "pipefill_backend_knee",
            "Capacity found: the in-flight count past which the backend keeps requests waiting",
            be,
        )
        phase = gauge(
            "pipefill_backend_limit_phase",
            "1 for the adaptive limit's current state (start, hold, probe)",
            ["backend", "phase"],
        )
        decision = gauge(
            "pipefill_backend_limit_decision",
            "1 for the code of the limit's last decision, as /admin shows it (start, grow, full, "
            "probe, server, restart, ...)",
            ["backend", "code"],
        )
        itl = gauge(
            "pipefill_backend_itl_seconds",
            "ITL estimate routing uses (seconds per token; fades while the backend holds none "
            "of our requests)",
            be,
        )
        ttft = gauge(
            "pipefill_backend_ttft_seconds",
            "TTFT estimate routing uses (peak EWMA; errors count; fades while the backend "
            "holds none of our requests)",
            be,
        )
        tps = gauge("pipefill_backend_tokens_per_second", "Output tokens/s over the last 10 s", be)
        sq = gauge(
            "pipefill_backend_scraped_queue_reqs", "sglang:num_queue_reqs (sum of ranks)", be
        )
        sr = gauge(
            "pipefill_backend_scraped_running_reqs", "sglang:num_running_reqs (sum of ranks)", be
        )
        su = gauge("pipefill_backend_scraped_token_usage", "sglang:token_usage (fullest rank)", be)
        waiting = gauge(
            "pipefill_backend_awaiting_first_token",
            "Requests sent to the backend that have produced no token yet (queued in SGLang "
            "or in prefill, as the proxy sees them)",
            be,
        )
        age = gauge("pipefill_backend_scrape_age_seconds", "Age of the last successful scrape", be)
        stale = gauge(
            "pipefill_backend_scrape_stale",
            "1 if scraped metrics are stale (the scraped_* gauges are then not exported)",
            be,
        )
        for b in self._backends():
            n = [b.name]
            snap = b.limit.snapshot()
            k = b.limit.knee
            if k is not None:
                knee.add_metric(n, k)
            if snap.get("phase") is not None:
                phase.add_metric([b.name, snap["phase"]], 1.0)
            if snap.get("decision") is not None:
                decision.add_metric([b.name, snap["decision"]], 1.0)
            st = b.stats
            if st.itl is not None:
                itl.add_metric(n, st.itl)
            if st.ttft is not None:
                ttft.add_metric(n, st.ttft)
            tps.add_metric(n, st.tokens_per_s)
            waiting.add_metric(n, st.awaiting)
            sc = st.scrape
            stale_now = sc.attempted_at is not None and st.scrape_stale()
            for fam, value in ((sq, sc.queue_reqs), (sr, sc.running_reqs), (su, sc.token_usage)):
                if value is not None and not stale_now:  # a stale value is not exported as now
                    fam.add_metric(n, value)
            a = st.scrape_age()
            if a is not None:
                age.add_metric(n, a)
            if sc.attempted_at is not None:
                stale.add_metric(n, 1.0 if stale_now else 0.0)
        yield from (knee, phase, decision, itl, ttft, tps, waiting, sq, sr, su, age, stale)

        adm = self._admission
        depth = gauge("pipefill_queue_depth", "Requests waiting in the proxy's queue", ["class"])
        oldest = gauge(
            "pipefill_queue_oldest_wait_seconds", "Wait of the oldest queued request", ["class"]
        )
        for cls, d in adm.depth_by_class().items():
            depth.add_metric([cls], d)
            oldest.add_metric([cls], adm.oldest_wait_s(cls))
        gone = CounterMetricFamily(
            "pipefill_queue_rejections",
            "Requests that left the queue without a backend, by reason "
            "(queue_full, queue_bytes_full, queue_timeout, no_healthy_backend, client_gone)",
            labels=["reason"],
        )
        for reason, count in adm.rejections.items():
            gone.add_metric([reason], count)
        yield from (depth, oldest, gone)


QUEUE_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


def register_adapt_metrics(
    metrics: Metrics, backends: Callable[[], Iterable[Backend]], admission: Any
) -> None:
    """Add limit/knee/scrape gauges and queue metrics to ``metrics.registry``; hook the queue's
    wait observations into ``pipefill_queue_wait_seconds{class,outcome}``."""
    metrics.registry.register(_AdaptCollector(backends, admission))
    wait = Histogram(
        "pipefill_queue_wait_seconds",
        "Time requests waited in the proxy's queue, by class and outcome",
        ["class", "outcome"],
        buckets=QUEUE_WAIT_BUCKETS,
        registry=metrics.registry,
    )
    admission.on_wait = lambda cls, waited, outcome: wait.labels(cls, outcome).observe(waited)


class _PrefixCollector(Collector):
    """Prefix-cache hit rates per backend: as the proxy's index predicted them (routing text
    matched over routed) and as the backends reported them (cached over prompt tokens)."""

    def __init__(self, backends: Callable[[], Iterable[Backend]], index: PrefixIndex | None):
        self._backends = backends
        self._index = index

    def collect(self):
        be = ["backend"]
        reported_prompt = CounterMetricFamily(
            "pipefill_backend_reported_prompt_tokens",
            "Prompt tokens of answers that reported their cached tokens",
            labels=be,
        )
        cached = CounterMetricFamily(
            "pipefill_backend_cached_tokens",
            "Prompt tokens the backend reported found in its prefix cache "
            "(usage.prompt_tokens_details.cached_tokens, meta_info.cached_tokens)",
            labels=be,
        )
        reported_rate = GaugeMetricFamily(
            "pipefill_backend_prefix_hit_rate_reported",
            "Cached over prompt tokens, as the backend reported them (since start)",
            labels=be,
        )
        for b in self._backends():
            st = b.stats
            reported_prompt.add_metric([b.name], st.reported_prompt_tokens)
            cached.add_metric([b.name], st.cached_tokens)
            if st.cached_hit_rate is not None:
                reported_rate.add_metric([b.name], st.cached_hit_rate)
        yield from (reported_prompt, cached, reported_rate)
        index = self._index
        if index is None:
            return
        chars = CounterMetricFamily(
            "pipefill_backend_prompt_chars",
            "Routing-text bytes of the requests bound to the backend by prefix routing",
            labels=be,
        )
        matched = CounterMetricFamily(
            "pipefill_backend_prefix_matched_chars",
            "Of those, the bytes the prefix index predicted the backend held cached",
            labels=be,
        )
        predicted = GaugeMetricFamily(
            "pipefill_backend_prefix_hit_rate_predicted",
            "Matched over routed routing-text bytes, as the prefix index predicted (since start)",
            labels=be,
        )
        trust = GaugeMetricFamily(
            "pipefill_backend_prefix_trust",
            "Weight of the index's claims on the backend: EWMA of reported / predicted cached "
            "fraction (1 until it reports)",
            labels=be,
        )
        for b in self._backends():
            bp = index.backends.get(b.name)
            chars.add_metric([b.name], bp.prompt_chars if bp else 0)
            matched.add_metric([b.name], bp.matched_chars if bp else 0)
            if bp is not None and bp.prompt_chars:
                predicted.add_metric([b.name], bp.matched_chars / bp.prompt_chars)
            trust.add_metric([b.name], index.trust(b.name))
        size = GaugeMetricFamily(
            "pipefill_prefix_index_bytes", "Memory of the prefix index (entries x entry size)"
        )
        size.add_metric([], index.bytes)
        entries = GaugeMetricFamily(
            "pipefill_prefix_index_entries", "Chained block hashes held by the prefix index"
        )
        entries.add_metric([], index.entries)
        yield from (chars, matched, predicted, trust, size, entries)


def register_prefix_metrics(
    metrics: Metrics, backends: Callable[[], Iterable[Backend]], index: PrefixIndex | None
) -> None:
    """Add the prefix-cache hit rates (and, with prefix affinity on, the index's) to
    ``metrics.registry``."""
    metrics.registry.register(_PrefixCollector(backends, index))
