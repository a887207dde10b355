"""Per-level statistics of a load test, computed from `RequestRecord`s only.

Definitions follow DESIGN.md ("Metric definitions"); docs/loadtest-metrics.md explains them
for users. In short, for one level with steady-state window W = [w0, w1):

- A request *counts* (towards completions, per-request percentiles, goodput and errors) when
  it finished inside W: its `t_end` (else `t_last`) lies in W. Requests that finished before
  W (warmup), after W or never (drain) are not dropped silently: `outside` counts them.
- Aggregate output tok/s = tokens whose event falls in W / |W|, over *all* requests. A
  non-streaming response's tokens all fall at `t_last`. When the server's
  `usage.completion_tokens` differs from what the events added up to, the difference is put on
  the last event (the final usage reconciles the count) and the request is counted in
  `token_mismatch`.
- Achieved concurrency = time-average over W of the number of requests in flight, each
  request being in flight over [t_send, t_end] clipped to W.
- Goodput = counted, successful requests meeting every SLO / |W|.
- Percentiles are per request (TTFT, TPOT, E2E, decode and end-to-end tok/s); ITL pools the
  per-token samples of the counted requests (token-weighted, by definition).
"""

from __future__ import annotations

import itertools
import math
import re
import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from loadtest.records import RequestRecord

# Percentile points reported for every distribution, as (attribute, JSON key, quantile).
QUANTILES: tuple[tuple[str, str, float], ...] = (
    ("p50", "p50", 0.50),
    ("p90", "p90", 0.90),
    ("p95", "p95", 0.95),
    ("p99", "p99", 0.99),
    ("p999", "p99.9", 0.999),
)
STAT_KEYS: tuple[str, ...] = ("count", "mean", "min", *(k for _, k, _ in QUANTILES), "max")

# Distributions in a LevelSummary: key -> (label, unit). Order is the report order.
DISTRIBUTIONS: dict[str, tuple[str, str]] = {
    "ttft": ("TTFT", "s"),
    "tpot": ("TPOT", "s"),
    "itl": ("ITL", "s"),
    "e2e": ("E2E latency", "s"),
    "decode_tok_s": ("decode tok/s per request (1/TPOT)", "tok/s"),
    "e2e_tok_s": ("end-to-end tok/s per request (n/E2E)", "tok/s"),
    "output_tokens": ("output tokens per request", "tok"),
    "dispatch_delay": ("dispatch delay", "s"),
}

SLO_KEYS = ("ttft", "tpot", "e2e")


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Quantile q in [0, 1] of already sorted values, linearly interpolated.

    The same as numpy's default (``method="linear"``): position h = (n - 1) * q between
    the two nearest order statistics.
    """
    n = len(sorted_values)
    if n == 0:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile {q} outside [0, 1]")
    h = (n - 1) * q
    lo = math.floor(h)
    hi = min(lo + 1, n - 1)
    a, b = sorted_values[lo], sorted_values[hi]
    return a + (h - lo) * (b - a)


@dataclass(slots=True)
class Distribution:
    """count, mean, min, p50, p90, p95, p99, p99.9, max of a sample (None when empty)."""

    count: int = 0
    mean: float | None = None
    min: float | None = None
    p50: float | None = None
    p90: float | None = None
    p95: float | None = None
    p99: float | None = None
    p999: float | None = None
    max: float | None = None

    @classmethod
    def of(cls, values: Iterable[float]) -> Distribution:
        xs = sorted(values)
        if not xs:
            return cls()
        quantiles = {attr: percentile(xs, q) for attr, _, q in QUANTILES}
        return cls(count=len(xs), mean=math.fsum(xs) / len(xs), min=xs[0], max=xs[-1], **quantiles)

    def get(self, key: str) -> float | None:
        """A statistic by its JSON key ("p99.9", "mean", ...)."""
        return getattr(self, _ATTR_OF_KEY.get(key, key))

    def to_dict(self) -> dict[str, Any]:
        return {key: self.get(key) for key in STAT_KEYS}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Distribution:
        return cls(**{_ATTR_OF_KEY.get(k, k): v for k, v in data.items() if k in STAT_KEYS})


_ATTR_OF_KEY = {key: attr for attr, key, _ in QUANTILES}


@dataclass(slots=True)
class LevelSummary:
    """Everything reported about one level (one concurrency or rate, one repetition).

    Rates are per second of the window. `outside` says what fell outside the window;
    `errors` counts error kinds among counted requests, `errors_all` over the whole level.
    `repeats > 1` means the numbers are medians of that many repetitions and `spread`
    maps each numeric metric path ("ttft/p99") to its {"min", "q1", "q3", "max"}.
    """

    concurrency: int  # requested (closed loop); 0 for open loop
    window: tuple[float, float]  # monotonic seconds of the run's clock
    rate: float | None = None  # requested arrival rate (open loop)
    duration: float = 0.0  # |W|
    span: tuple[float, float] | None = None  # first send .. last end of the level's records
    requests: int = 0  # records given
    completed: int = 0  # counted and successful
    failed: int = 0  # counted and failed
    achieved_concurrency: float = 0.0  # time-average in flight over W
    concurrency_max: int = 0  # most in flight at any instant of W
    request_throughput: float = 0.0  # completed / |W|
    output_tokens: int = 0  # tokens whose event fell in W
    output_tok_s: float = 0.0  # aggregate: output_tokens / |W|
    slo: dict[str, float] | None = None
    good: int | None = None  # counted, successful, meeting every SLO
    goodput: float | None = None  # good / |W|
    slo_attainment: float | None = None  # good / (completed + failed)
    ttft: Distribution = field(default_factory=Distribution)
    tpot: Distribution = field(default_factory=Distribution)
    itl: Distribution = field(default_factory=Distribution)
    e2e: Distribution = field(default_factory=Distribution)
    decode_tok_s: Distribution = field(default_factory=Distribution)
    e2e_tok_s: Distribution = field(default_factory=Distribution)
    output_tokens_per_request: Distribution = field(default_factory=Distribution)
    dispatch_delay: Distribution = field(default_factory=Distribution)
    errors: dict[str, int] = field(default_factory=dict)
    errors_all: dict[str, int] = field(default_factory=dict)
    outside: dict[str, int] = field(default_factory=dict)
    token_mismatch: int = 0  # successful streams whose usage != sum of event tokens
    usage_missing: int = 0  # successful requests without usage.completion_tokens
    early_stops: int = 0  # successful requests with fewer tokens than requested
    prompt_tokens: dict[str, float | int | None] = field(default_factory=dict)
    # prefix cache hits as the servers reported them (``cache_summary``); None: none reported
    cache: dict[str, Any] | None = None
    selfcheck: dict[str, Any] | None = None
    repeats: int = 1
    spread: dict[str, dict[str, float]] | None = None

    def distribution(self, key: str) -> Distribution:
        return getattr(self, "output_tokens_per_request" if key == "output_tokens" else key)

    @property
    def label(self) -> str:
        """How the level is named in tables: its concurrency, or its rate in open loop."""
        if self.rate is not None and self.concurrency == 0:
            return f"{self.rate:g}/s"
        return str(self.concurrency)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Distribution):
                value = value.to_dict()
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LevelSummary:
        known = {f.name: f for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        for name, value in data.items():
            if name not in known:
                continue
            if name in _DIST_FIELDS:
                value = Distribution.from_dict(value or {})
            elif name in ("window", "span") and value is not None:
                value = (float(value[0]), float(value[1]))
            kwargs[name] = value
        if "concurrency" not in kwargs or "window" not in kwargs:
            raise ValueError("level summary needs 'concurrency' and 'window'")
        return cls(**kwargs)


_DIST_FIELDS = {f.name for f in fields(LevelSummary) if f.type in ("Distribution", Distribution)}


def parse_slo(text: str) -> dict[str, float]:
    """Parse ``ttft=0.5,tpot=50ms,e2e=10`` (seconds unless suffixed ms/s) into a dict.

    Raises ValueError with a one-line message on bad input.
    """
    slo: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, raw = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in SLO_KEYS:
            raise ValueError(
                f"bad SLO {part!r}: expected KEY=SECONDS with KEY one of {', '.join(SLO_KEYS)}"
            )
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e-?[0-9]+)?)\s*(ms|s)?\s*", raw, re.I)
        if not m:
            raise ValueError(
                f"bad SLO value {raw!r} for {key}: expected seconds, e.g. 0.5 or 500ms"
            )
        value = float(m.group(1)) / (1000.0 if (m.group(2) or "").lower() == "ms" else 1.0)
        if value <= 0:
            raise ValueError(f"SLO {key} must be positive")
        slo[key] = value
    if not slo:
        raise ValueError("empty SLO: expected e.g. ttft=0.5,tpot=0.05")
    return slo


def meets_slo(record: RequestRecord, slo: dict[str, float]) -> bool:
    """A successful request whose TTFT, TPOT and E2E are each within their bound.

    An undefined TPOT (fewer than 2 tokens) cannot violate its bound; an undefined TTFT or
    E2E (no token at all) violates theirs.
    """
    if not record.ok:
        return False
    for key, bound in slo.items():
        value = getattr(record, key)
        if value is None:
            if key == "tpot":
                continue
            return False
        if value > bound:
            return False
    return True


def done_time(record: RequestRecord) -> float | None:
    """When a request finished: response fully read, else its last token."""
    return record.t_end if record.t_end is not None else record.t_last


def token_events(record: RequestRecord) -> list[tuple[float, int]]:
    """(time, tokens) of each token-carrying event, reconciled with the server's usage."""
    times, counts = record.token_times, record.token_counts
    n = record.output_tokens
    if not times:
        at = record.t_last if record.t_last is not None else record.t_end
        return [(at, n)] if at is not None and n > 0 else []
    events = list(zip(times, counts, strict=False))
    residual = n - sum(c for _, c in events)
    if residual:
        t, c = events[-1]
        events[-1] = (t, max(c + residual, 0))
    return events


def _in_flight_end(record: RequestRecord, w1: float) -> float:
    end = done_time(record)
    if end is not None:
        return end
    return record.t_send if record.error is not None else w1  # failed at once / still running


def _concurrency(records: Sequence[RequestRecord], w0: float, w1: float) -> tuple[float, int]:
    """Time-average and peak of requests in flight over [w0, w1)."""
    area = 0.0
    level = 0
    changes: list[tuple[float, int]] = []
    for r in records:
        a, b = r.t_send, _in_flight_end(r, w1)
        if b <= a or b <= w0 or a >= w1:
            continue
        area += min(b, w1) - max(a, w0)
        if a <= w0:
            level += 1
        else:
            changes.append((a, 1))
        if b < w1:
            changes.append((b, -1))
    # at one instant ends go before starts: a slot freed and refilled never counts twice
    changes.sort()
    peak = level
    for _, d in changes:
        level += d
        peak = max(peak, level)
    return area / (w1 - w0), peak


def _dispatch_delays(records: Sequence[RequestRecord]) -> list[float]:
    """Open loop: t_send - t_scheduled. Closed loop: t_send - the worker's previous t_end."""
    out: list[float] = []
    by_worker: dict[int, list[RequestRecord]] = {}
    for r in records:
        if r.t_send > r.t_scheduled:
            out.append(r.t_send - r.t_scheduled)
        elif r.level > 0:
            by_worker.setdefault(r.worker, []).append(r)
    for rs in by_worker.values():
        rs.sort(key=lambda r: r.t_send)
        for prev, cur in itertools.pairwise(rs):
            end = done_time(prev)
            if end is not None and cur.t_send >= end:
                out.append(cur.t_send - end)
    return out


def summarize_level(
    records: Iterable[RequestRecord],
    *,
    concurrency: int,
    window: tuple[float, float],
    slo: dict[str, float] | None = None,
    selfcheck: dict[str, Any] | None = None,
    rate: float | None = None,
) -> LevelSummary:
    """Summarise one level's records over its steady-state window (see the module docstring)."""
    records = list(records)
    w0, w1 = float(window[0]), float(window[1])
    if w1 <= w0:
        raise ValueError(f"empty window {window!r}")
    duration = w1 - w0

    counted: list[RequestRecord] = []
    outside = Counter(done_before_window=0, done_after_window=0, never_done=0)
    for r in records:
        end = done_time(r)
        if end is None:
            outside["never_done"] += 1
        elif end < w0:
            outside["done_before_window"] += 1
        elif end >= w1:
            outside["done_after_window"] += 1
        else:
            counted.append(r)
    ok = [r for r in counted if r.ok]

    tokens_in = tokens_before = tokens_after = 0
    for r in records:
        for t, c in token_events(r):
            if t < w0:
                tokens_before += c
            elif t >= w1:
                tokens_after += c
            else:
                tokens_in += c
    outside["tokens_before_window"] = tokens_before
    outside["tokens_after_window"] = tokens_after

    achieved, c_max = _concurrency(records, w0, w1)

    # all tokens in one event (a whole, non-streamed response) carries no decode timing
    tpots = [t for r in ok if (t := r.tpot) is not None and r.t_last > r.t_first]
    e2e_rates = [
        r.output_tokens / e
        for r in ok
        if (e := r.e2e) is not None and e > 0 and r.output_tokens > 0
    ]
    itl: list[float] = []
    for r in ok:
        itl.extend(r.itl_samples())

    good = goodput = attainment = None
    if slo:
        good = sum(1 for r in ok if meets_slo(r, slo))
        goodput = good / duration
        attainment = good / len(counted) if counted else None

    prompt_server = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    prompt_requested = [r.requested_input_len for r in ok]
    streamed_ok = [r for r in ok if r.token_times]

    spans = [r.t_send for r in records]
    ends = [e for r in records if (e := done_time(r)) is not None]
    return LevelSummary(
        concurrency=concurrency,
        window=(w0, w1),
        rate=rate,
        duration=duration,
        span=(min(spans), max(ends or spans)) if spans else None,
        requests=len(records),
        completed=len(ok),
        failed=len(counted) - len(ok),
        achieved_concurrency=achieved,
        concurrency_max=c_max,
        request_throughput=len(ok) / duration,
        output_tokens=tokens_in,
        output_tok_s=tokens_in / duration,
        slo=dict(slo) if slo else None,
        good=good,
        goodput=goodput,
        slo_attainment=attainment,
        ttft=Distribution.of(t for r in ok if (t := r.ttft) is not None),
        tpot=Distribution.of(tpots),
        itl=Distribution.of(itl),
        e2e=Distribution.of(e for r in ok if (e := r.e2e) is not None),
        decode_tok_s=Distribution.of(1.0 / t for t in tpots if t > 0),
        e2e_tok_s=Distribution.of(e2e_rates),
        output_tokens_per_request=Distribution.of(float(r.output_tokens) for r in ok),
        dispatch_delay=Distribution.of(_dispatch_delays(records)),
        errors=dict(Counter(r.error for r in counted if r.error is not None)),
        errors_all=dict(Counter(r.error for r in records if r.error is not None)),
        outside=dict(outside),
        token_mismatch=sum(
            1
            for r in streamed_ok
            if r.completion_tokens is not None and r.completion_tokens != r.chunk_tokens
        ),
        usage_missing=sum(1 for r in ok if r.completion_tokens is None),
        early_stops=sum(
            1 for r in ok if r.requested_output_len and r.output_tokens < r.requested_output_len
        ),
        prompt_tokens={
            "requested_mean": _mean(prompt_requested),
            "server_mean": _mean(prompt_server),
            "server_missing": len(ok) - len(prompt_server),
            "differ": sum(
                1
                for r in ok
                if r.prompt_tokens is not None and r.prompt_tokens != r.requested_input_len
            ),
        },
        cache=cache_summary(ok),
        selfcheck=dict(selfcheck) if selfcheck else None,
    )


def _hit(records: Sequence[RequestRecord]) -> tuple[int, int]:
    return sum(r.cached_tokens or 0 for r in records), sum(r.prompt_tokens or 0 for r in records)


def cache_summary(ok: Sequence[RequestRecord]) -> dict[str, Any] | None:
    """The prefix-cache hit rate of successful requests whose server reported cached tokens:
    cached / prompt tokens, summed (so long prompts weigh what they cost), overall and per
    backend that served (``X-Pipefill-Backend``). None when no server reported any: unknown,
    not zero (SGLang's OpenAI routes report it only with ``--enable-cache-report``)."""
    reported = [r for r in ok if r.cached_tokens is not None and r.prompt_tokens]
    if not reported:
        return None
    cached, prompt = _hit(reported)
    by: dict[str, list[RequestRecord]] = {}
    for r in reported:
        if r.served_by is not None:
            by.setdefault(r.served_by, []).append(r)
    backends = {}
    for name, rs in sorted(by.items()):
        c, p = _hit(rs)
        backends[name] = {"hit_rate": c / p, "requests": len(rs)}
    return {
        "hit_rate": cached / prompt,
        "cached_tokens": cached,
        "prompt_tokens": prompt,
        "reported": len(reported),
        "unreported": len(ok) - len(reported),
        "by_backend": backends,
    }


def _mean(values: Sequence[float]) -> float | None:
    return math.fsum(values) / len(values) if values else None


DISPATCH_P99_LIMIT_S = 1e-3  # a closed-loop client should refill a slot well within this


def summary_warnings(level: LevelSummary) -> list[str]:
    """Warnings that follow from a summary alone (the runner adds its own self-checks)."""
    warnings: list[str] = []
    c = level.concurrency
    if c and level.achieved_concurrency < 0.95 * c:
        warnings.append(f"achieved concurrency {level.achieved_concurrency:.2f} < requested {c}")
    p99 = level.dispatch_delay.p99
    if p99 is not None and p99 > DISPATCH_P99_LIMIT_S:
        warnings.append(f"dispatch delay p99 {p99 * 1e3:.1f} ms: the client may be the bottleneck")
    if level.token_mismatch:
        warnings.append(f"{level.token_mismatch} request(s): usage differs from chunk tokens")
    if level.usage_missing:
        warnings.append(
            f"{level.usage_missing} request(s) without server usage: counts from chunks"
        )
    if level.errors:
        kinds = ", ".join(f"{k}={v}" for k, v in sorted(level.errors.items()))
        warnings.append(f"errors: {kinds}")
    return warnings


# ---------------------------------------------------------------- repetitions (--repeat K)


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict):
        out: dict[str, Any] = {}
        for k, v in data.items():
            out.update(_flatten(v, f"{prefix}{k}/"))
        return out
    return {prefix.rstrip("/"): data}


def _set_path(target: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split("/")
    for p in parents:
        target = target.setdefault(p, {})
    target[last] = value


_NOT_COMBINED = {"concurrency", "rate", "window", "span", "slo", "selfcheck", "repeats", "spread"}


def combine_repeats(summaries: Sequence[LevelSummary]) -> LevelSummary:
    """K repetitions of one level -> one summary of per-metric medians, with their spread.

    Every numeric metric (including each percentile) becomes the median over repetitions;
    `spread[path]` holds its min, quartiles and max. The window and SLO are the first
    repetition's, the span covers all of them, and `selfcheck["repeats"]` holds every
    repetition's self-checks (the first one's keys stay at the top level).
    """
    if not summaries:
        raise ValueError("no repetitions to combine")
    if len(summaries) == 1:
        return summaries[0]
    first = summaries[0]
    if any((s.concurrency, s.rate) != (first.concurrency, first.rate) for s in summaries[1:]):
        raise ValueError("repetitions of different levels cannot be combined")
    flats = [
        _flatten({k: v for k, v in s.to_dict().items() if k not in _NOT_COMBINED})
        for s in summaries
    ]
    paths = list(dict.fromkeys(p for flat in flats for p in flat))
    combined: dict[str, Any] = {k: v for k, v in first.to_dict().items() if k in _NOT_COMBINED}
    spread: dict[str, dict[str, float]] = {}
    for path in paths:
        values = [flat.get(path) for flat in flats]
        if path.startswith(("errors/", "errors_all/", "outside/")):
            values = [0 if v is None else v for v in values]  # a kind absent in one run: 0
        nums = sorted(
            float(v) for v in values if isinstance(v, int | float) and not isinstance(v, bool)
        )
        if not nums:
            _set_path(combined, path, values[0])
            continue
        median = statistics.median(nums)
        if all(isinstance(v, int) for v in values) and median.is_integer():
            median = int(median)
        _set_path(combined, path, median)
        if nums[0] != nums[-1]:
            spread[path] = {
                "min": nums[0],
                "q1": percentile(nums, 0.25),
                "q3": percentile(nums, 0.75),
                "max": nums[-1],
            }
    spans = [s.span for s in summaries if s.span is not None]
    if spans:  # the level's records are those of every repetition
        combined["span"] = [min(a for a, _ in spans), max(b for _, b in spans)]
    combined["repeats"] = len(summaries)
    combined["spread"] = spread
    combined["selfcheck"] = {
        **(first.selfcheck or {}),
        "repeats": [s.selfcheck for s in summaries],
    }
    return LevelSummary.from_dict(combined)


# ------------------------------------------------------------------------ compare two runs

# (path, label, unit, higher_is_better): what `loadtest compare` shows, in order.
COMPARE_METRICS: tuple[tuple[str, str, str, bool], ...] = (
    ("achieved_concurrency", "achieved concurrency", "", True),
    ("request_throughput", "request throughput", "req/s", True),
    ("output_tok_s", "aggregate output tok/s", "tok/s", True),
    ("goodput", "goodput", "req/s", True),
    ("decode_tok_s/p50", "decode tok/s per request p50", "tok/s", True),
    ("e2e_tok_s/p50", "end-to-end tok/s per request p50", "tok/s", True),
    ("ttft/p50", "TTFT p50", "s", False),
    ("ttft/p90", "TTFT p90", "s", False),
    ("ttft/p99", "TTFT p99", "s", False),
    ("tpot/p50", "TPOT p50", "s", False),
    ("tpot/p90", "TPOT p90", "s", False),
    ("tpot/p99", "TPOT p99", "s", False),
    ("itl/p50", "ITL p50", "s", False),
    ("itl/p99", "ITL p99", "s", False),
    ("e2e/p50", "E2E p50", "s", False),
    ("e2e/p99", "E2E p99", "s", False),
    ("completed", "completed requests", "n", True),
    ("errors", "errors", "n", False),
)


def metric_value(level: LevelSummary, path: str) -> float | None:
    """A metric by path: a scalar field ("output_tok_s"), "errors" (their total) or a
    distribution statistic ("ttft/p99", "itl/p99.9")."""
    if path == "errors":
        return float(sum(level.errors.values()))
    name, _, stat = path.partition("/")
    if stat:
        return level.distribution(name).get(stat)
    value = getattr(level, name)
    return None if value is None else float(value)


@dataclass(frozen=True, slots=True)
class MetricChange:
    """One metric of one level in two runs: a, b, b - a and (b - a) / a in percent."""

    path: str
    label: str
    unit: str
    higher_is_better: bool
    a: float | None
    b: float | None
    delta: float | None
    percent: float | None

    @property
    def better(self) -> bool | None:
        """Whether b improves on a (None when unchanged or undefined)."""
        if self.delta is None or self.delta == 0:
            return None
        return (self.delta > 0) == self.higher_is_better


def compare_levels(a: LevelSummary, b: LevelSummary) -> list[MetricChange]:
    """Each metric of COMPARE_METRICS side by side with its absolute and relative change."""
    out: list[MetricChange] = []
    for path, label, unit, higher in COMPARE_METRICS:
        va, vb = metric_value(a, path), metric_value(b, path)
        delta = percent = None
        if va is not None and vb is not None:
            delta = vb - va
            percent = delta / abs(va) * 100.0 if va != 0 else None
        out.append(MetricChange(path, label, unit, higher, va, vb, delta, percent))
    return out
