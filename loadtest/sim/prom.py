"""The simulator's ``/metrics``: SGLang's Prometheus names, labels and staleness.

Scheduler gauges (``sglang:num_running_reqs``, ``sglang:token_usage``, ...) are read from
``engine.logged_stats()`` at scrape time: like SGLang's, they change only on prefill batches
and every ``decode_log_interval`` decode steps, and keep their last value when idle. They
carry the label sets SGLang's schedulers write (``model_name``, ``engine_type``, ``tp_rank``,
``pp_rank``, ``moe_ep_rank``, plus ``dp_rank`` with DP attention and ``priority`` with
priority scheduling):

- with DP attention (``dp_size`` > 1) each DP rank's scheduler writes its own series, and its
  ``tp_rank`` and ``moe_ep_rank`` are its first TP rank (``dp_rank`` x tp_size / dp_size): the
  engine's counts are split over the ranks, ratios repeated;
- every pipeline stage (``pp_rank`` 0..pp_size-1) writes the same state;
- with ``priority_scheduling`` the running/queue gauges are written as the total under
  ``priority=""`` and again per priority (everything runs at the default priority, "0");
- ``sglang:num_retracted_reqs`` is a per-process gauge in SGLang (a ``pid`` label).

A reader must combine them as SGLang means them (proxy/scrape.py): a sum over every series
over-counts.
Per-request histograms and token counters are the tokenizer side's and carry
``model_name`` only. Durations are modelled seconds (wall seconds divided by
``--time-scale``), i.e. what the real deployment would report.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

# Bucket bounds as in SGLang's metrics collector (tokenizer side).
TTFT_BUCKETS = (
    0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0,
    100.0, 200.0, 400.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060,
    0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.0, 2.0, 4.0, 6.0, 8.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0,
    100.0, 200.0, 400.0, 800.0, 1200.0, 1600.0, 2000.0, 2400.0,
)  # fmt: skip
RETRACTION_BUCKETS = (0, 1, 2, 3, 4, 5, 10, 20, 50, 100)

# (metric, attribute of logged_stats, help)
SCHEDULER_GAUGES = (
    ("sglang:num_running_reqs", "num_running_reqs", "The number of running requests."),
    ("sglang:num_queue_reqs", "num_queue_reqs", "The number of requests in the waiting queue."),
    ("sglang:num_grammar_queue_reqs", "num_grammar_queue_reqs",
     "The number of requests in the grammar waiting queue."),
    ("sglang:num_used_tokens", "num_used_tokens", "The number of used tokens."),
    ("sglang:token_usage", "token_usage", "The token usage."),
    ("sglang:max_total_num_tokens", "max_total_num_tokens",
     "Maximum total number of tokens in the KV cache pool."),
    ("sglang:gen_throughput", "gen_throughput", "The generation throughput (token/s)."),
    ("sglang:cache_hit_rate", "cache_hit_rate", "The prefix cache hit rate."),
    ("sglang:num_retracted_reqs", "num_retracted_reqs", "The number of retracted requests."),
    ("sglang:utilization", "utilization", "The utilization."),
)  # fmt: skip

# (metric without _total, engine counter attribute, help)
COUNTERS = (
    ("sglang:prompt_tokens", "prompt_tokens_total", "Number of prefill tokens processed."),
    ("sglang:generation_tokens", "generation_tokens_total",
     "Number of generation tokens processed."),
    ("sglang:cached_tokens", "cached_tokens_total",
     "Number of cached prompt tokens."),
    ("sglang:num_requests", "requests_total", "The number of requests."),
    ("sglang:num_aborted_requests", "aborted_total", "The number of aborted requests."),
    ("sglang:num_retracted_requests", "retractions_total", "The number of retracted requests."),
)  # fmt: skip


def stat(obj: Any, name: str, default: float = 0.0) -> float:
    """Read one field from a stats object (dataclass, pydantic model or dict)."""
    if obj is None:
        return default
    value = obj.get(name, default) if isinstance(obj, dict) else getattr(obj, name, default)
    return default if value is None else value


# gauges that are ratios: every DP rank reports the same value (the rest are split evenly)
RATIO_GAUGES = frozenset({"token_usage", "cache_hit_rate", "utilization"})
# gauges SGLang writes again per priority with priority scheduling
PRIORITY_GAUGES = frozenset({"num_running_reqs", "num_queue_reqs"})
# gauges SGLang keeps per process (prometheus-client's "all" multiprocess mode: a pid label)
PID_GAUGES = frozenset({"num_retracted_reqs"})
SIM_PID = "1"  # the pid label's value (one simulated scheduler process)


class _EngineCollector:
    """Reads the engine's (stale) gauges and counters at scrape time, in SGLang's label sets."""

    def __init__(
        self,
        engine: Any,
        base_labels: dict[str, str],
        model_name: str,
        *,
        dp_size: int = 1,
        tp_size: int = 1,
        pp_size: int = 1,
        ep: bool = False,
        priority: bool = False,
    ) -> None:
        self._engine = engine
        self._model = model_name
        self._dp = dp_size
        self._priority = priority
        # one label dict per scheduler that writes (per DP rank and pipeline stage)
        per_dp = max(tp_size // dp_size, 1)
        self._schedulers: list[dict[str, str]] = []
        for pp in range(pp_size):
            for dp in range(dp_size):
                labels = {**base_labels, "tp_rank": str(dp * per_dp), "pp_rank": str(pp)}
                if ep:
                    labels["moe_ep_rank"] = str(dp * per_dp)
                if priority:
                    labels["priority"] = ""
                if dp_size > 1:
                    labels["dp_rank"] = str(dp)
                self._schedulers.append(labels)

    def collect(self) -> Iterator[Metric]:
        logged = self._engine.logged_stats()
        names = list(self._schedulers[0])
        for metric, attr, doc in SCHEDULER_GAUGES:
            extra = ["pid"] if attr in PID_GAUGES else []
            g = GaugeMetricFamily(metric, doc, labels=names + extra)
            total = float(stat(logged, attr))
            value = total if attr in RATIO_GAUGES else total / self._dp
            for labels in self._schedulers:
                g.add_metric([*labels.values(), *([SIM_PID] if extra else [])], value)
                if self._priority and attr in PRIORITY_GAUGES:
                    g.add_metric([*{**labels, "priority": "0"}.values()], value)
            yield g
        counters = _counters(self._engine)
        for metric, attr, doc in COUNTERS:
            c = CounterMetricFamily(metric, doc, labels=["model_name"])
            c.add_metric([self._model], float(stat(counters, attr)))
            yield c


def _counters(engine: Any) -> Any:
    counters = getattr(engine, "counters", None)
    if callable(counters):
        counters = counters()
    return counters if counters is not None else engine.live_stats()


class SimMetrics:
    """One backend's registry: engine gauges/counters plus per-request histograms."""

    def __init__(
        self,
        engine: Any,
        *,
        model_name: str,
        parallelism: str,
        dp_size: int = 1,
        tp_size: int = 1,
        pp_size: int = 1,
        priority: bool = False,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        labels = {"model_name": model_name, "engine_type": "unified"}
        self.registry.register(
            _EngineCollector(
                engine,
                labels,
                model_name,
                dp_size=dp_size,
                tp_size=tp_size,
                pp_size=pp_size,
                ep=parallelism == "ep",
                priority=priority,
            )
        )
        kw = {"labelnames": ["model_name"], "registry": self.registry}
        self._ttft = Histogram(
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            buckets=TTFT_BUCKETS,
            **kw,
        ).labels(model_name)
        self._itl = Histogram(
            "sglang:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            buckets=ITL_BUCKETS,
            **kw,
        ).labels(model_name)
        self._e2e = Histogram(
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            buckets=E2E_BUCKETS,
            **kw,
        ).labels(model_name)
        self._retractions = Histogram(
            "sglang:num_retractions",
            "Histogram of retractions per request.",
            buckets=RETRACTION_BUCKETS,
            **kw,
        ).labels(model_name)

    def observe_first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def observe_chunk(self, interval: float, new_tokens: int) -> None:
        """SGLang observes one ITL sample per chunk: interval / tokens in the chunk."""
        if new_tokens > 0:
            self._itl.observe(interval / new_tokens)

    def observe_finish(self, e2e: float, retractions: int) -> None:
        self._e2e.observe(e2e)
        self._retractions.observe(retractions)

    def render(self) -> bytes:
        return generate_latest(self.registry)
