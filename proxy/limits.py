"""Per-backend concurrency limits: pure algorithms fed windows of observations.

Following Netflix concurrency-limits, a *limit* (this module) only answers "given what this
window looked like, how many requests may be in flight now?"; the *limiter* that acquires slots
and queues requests is proxy/admission.py. A limit never awaits and never reads a clock: it is fed
:class:`proxy.stats.Window` values and is tested with numbers alone.

- ``fixed``: a constant.
- ``adaptive`` (default): a knee search on the proxy's own measurements. See
  docs/limits-and-routing.md for the algorithm, its parameters and a convergence trace.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from proxy.stats import BackendStats, Window, weighted_median


class LimitSettings(BaseModel):
    """``[limits]`` (defaults for every backend; a backend may override any field)."""

    model_config = ConfigDict(extra="forbid")

    algorithm: Literal["adaptive", "fixed"] = "adaptive"
    initial: int | None = Field(
        None,
        ge=1,
        description="fixed: the limit; adaptive: where the search starts "
        "(default: the floor, at least 8)",
    )
    min_limit: int = Field(1, ge=1, description="floor (a pp backend never goes below pp_size)")
    max_limit: int = Field(512, ge=1, description="ceiling")
    window_s: float = Field(1.0, gt=0, description="shortest observation window")
    window_tokens: int = Field(
        200, ge=0, description="a window extends until it saw this many tokens..."
    )
    max_window_s: float = Field(5.0, gt=0, description="...or lasted this long")
    step: float = Field(0.25, gt=0, le=1, description="relative size of a climb step")
    min_gain: float = Field(
        0.3,
        ge=0,
        le=1,
        description="a step up by x% in flight must add >= min_gain*x% token rate to be kept",
    )
    latency_tolerance: float = Field(
        0.1, ge=0, description="ITL/TTFT above (1+tolerance) x reference count as rising"
    )
    drift_tolerance: float = Field(
        0.3,
        ge=0,
        description="at the knee, ITL or TTFT this far above the reference (three "
        "measurements in a row) while throughput did not grow means the backend changed: "
        "step down and follow the knee",
    )
    measure_windows: int = Field(
        3, ge=1, description="windows per measured level (their median; ITL weighted by tokens)"
    )
    settle_windows: int = Field(1, ge=0, description="windows ignored after a limit change")
    probe_every: int = Field(6, ge=1, description="measurements held at the knee between probes")
    backoff: float = Field(0.85, gt=0, lt=1, description="multiplicative decrease on congestion")
    kv_high: float = Field(
        0.95, gt=0, le=1, description="scraped token_usage at or above this = KV pool full"
    )
    congestion_memory_s: float = Field(
        60.0, ge=0, description="after a back-off, climbs stay below the congested level this long"
    )
    queue_tolerance: float = Field(
        1.0, ge=0, description="scraped num_queue_reqs above this = the backend is queueing"
    )
    slow_start_until: int = Field(
        64,
        ge=1,
        description="slow start doubles the limit up to this level; above it a step adds "
        "at most 50%",
    )


class Limit(Protocol):
    name: str

    @property
    def limit(self) -> int: ...

    @property
    def knee(self) -> int | None: ...

    def update(self, window: Window) -> None: ...

    def reset(self) -> None: ...

    def snapshot(self) -> dict: ...


class FixedLimit:
    name = "fixed"

    def __init__(self, limit: int) -> None:
        self._limit = max(1, int(limit))

    @property
    def limit(self) -> int:
        return self._limit

    @property
    def knee(self) -> int | None:
        return None

    def update(self, window: Window) -> None:
        return None

    def reset(self) -> None:
        return None

    def snapshot(self) -> dict:
        return {"algorithm": self.name, "limit": self._limit, "knee": None}

    describe = snapshot


@dataclass(frozen=True, slots=True)
class Measure:
    """Throughput and latency measured at one limit, averaged over a few windows.

    ``in_flight`` is the backend's total in-flight estimate: the proxy's own time-average plus
    the requests others sent it (scraped running + queued minus ours, when scraped), and
    ``tokens_per_s`` the backend's total token rate estimated from ours in the same proportion.
    Comparing totals keeps two proxies in front of one backend from mistaking a larger share of
    a saturated backend for more capacity.
    """

    level: int
    in_flight: float
    tokens_per_s: float
    itl: float | None
    ttft: float | None
    at: float
    slack: bool = False  # demand did not fill the limit; ``level`` is the in-flight count used
    rate: float = 0.0  # decode capacity: in_flight / median ITL (tokens/s), else tokens_per_s
    pressure: float = 0.0  # share of the time at the limit with requests waiting in the proxy
    awaiting: float = 0.0  # fewest of our requests without a token yet in any of the windows
    windows: int = 1  # how many windows were measured
    backlog: int = 0  # this backend's share of the proxy's queue at the end (Window.backlog)

    @staticmethod
    def of(level: int, windows: list[Window], external: float = 0.0) -> Measure:
        span = sum(w.duration for w in windows) or 1e-9
        if len(windows) >= 3:  # robust to one window caught in a prefill wave
            tps = statistics.median(w.tokens_per_s for w in windows)
        else:
            tps = sum(w.tokens for w in windows) / span
        ours = sum(w.in_flight * w.duration for w in windows) / span
        slack = ours < SLACK * level
        if slack:
            # Demand did not fill the limit: what was measured is the in-flight count used.
            level = max(1, math.ceil(ours))
        total = ours + external
        if ours > 0:
            tps *= total / ours
        # Weighted by tokens, as if the windows' token gaps were pooled: a PP window caught in a
        # prefill stall carries few tokens, all slow, and a plain median of three windows' medians
        # read one or two of those as the backend's ITL (on pp8 ~0.1 s against ~0.02 s).
        p50s = [(w.itl_p50 if w.itl_p50 is not None else w.itl, w.tokens) for w in windows]
        itl = weighted_median([(x, max(n, 1)) for x, n in p50s if x is not None and x > 0])
        # Each decoding request makes one token per ITL: in flight / median ITL is the token
        # rate without the noise of prefill stalls and of requests finishing (PP windows vary
        # by +-35% in tokens/s, their median ITL by a few %).
        # Requests without a token yet (queued in SGLang or in prefill) are in flight but do not
        # decode: the proxy counts its own live, SGLang's gauge (40 decode steps old) confirms.
        queues = [w.queue_reqs for w in windows if w.queue_reqs is not None]
        scraped = statistics.fmean(queues) if queues else 0.0
        awaiting = sum(w.awaiting * w.duration for w in windows) / span
        decoding = max(total - max(scraped, awaiting), 1e-9)
        rate = decoding / itl if itl else tps
        ttfts = [(w.ttft, w.ttft_count) for w in windows if w.ttft is not None]
        n_ttft = sum(n for _, n in ttfts)
        # A handful of TTFT samples says more about prompt lengths than about congestion.
        ttft = sum(x * n for x, n in ttfts) / n_ttft if n_ttft >= MIN_TTFT_SAMPLES else None
        pressure = sum(w.pressure * w.duration for w in windows) / span
        return Measure(
            level,
            max(total, 1e-9),
            tps,
            itl,
            ttft,
            windows[-1].end,
            slack,
            rate,
            pressure,
            min(w.awaiting for w in windows),
            len(windows),
            windows[-1].backlog,
        )


#: a window whose average in-flight stays below this fraction of the limit was demand-limited
SLACK = 0.8
#: TTFT samples a measurement needs before its TTFT counts as a signal
MIN_TTFT_SAMPLES = 5
#: consecutive windows with stale scraped metrics before (and between) back-offs
STALE_WINDOWS = 3
#: a window (or measurement) this much of the time at the limit with requests waiting in the
#: proxy's queue says demand exceeds the limit
PRESSURE = 0.8
#: measurements at a held knee under pressure between probes up (instead of ``probe_every``)
PRESSURE_PROBE_EVERY = 2
#: measurements in a row at the held knee that must read drifted before the limit steps down:
#: on pp8 a wave of arrivals stalls the pipeline in prefill for two measurements (~6 s), which
#: is no change of the backend
DRIFT_MEASUREMENTS = 3
#: a change has settled once at most this share of the limit still waits for a first token
SETTLED_AWAITING = 0.1
#: largest factor a slow-start step grows by to take in its share of a backlog
BACKLOG_JUMP = 4
#: largest relative step once slow start is over (steps double after linear growth up to it)
GROWN_STEP = 0.5


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def _rose(now: float | None, ref: float | None, tol: float) -> bool:
    return now is not None and ref is not None and ref > 0 and now > ref * (1.0 + tol)


Phase = Literal["climb", "hold", "probe_up", "probe_down"]


class AdaptiveLimit:
    """Knee search: the smallest in-flight count that reaches close to the backend's maximum
    token throughput.

    Each level is measured over ``measure_windows`` demand-bound windows (the proxy held the
    backend at its limit; otherwise a window says nothing about capacity). Climbing from the
    start, a step from P to L is kept while throughput grows with elasticity >= ``min_gain``
    (with the defaults a 25% step must add >= 7.5% tokens/s); while growth is nearly linear the
    step doubles (slow start, up to ``slow_start_until``; a doubling that paid less than linearly
    is measured once more before slow start ends), and an overshoot is refined with the base
    step below it. The first
    base step that does not pay is undone: P is the knee. At the knee the limit holds and every
    ``probe_every`` measurements probes a half step up or down (alternating): up is kept if it
    pays, down is kept if the throughput lost is below the same elasticity, so the knee follows
    the backend both ways. Explicit congestion (scraped queue above tolerance while TTFT rose, KV
    usage at ``kv_high``, stale metrics, failing requests) backs off multiplicatively at once and
    keeps climbs below the congested level for ``congestion_memory_s``. Demand above the limit
    (windows at the limit while requests wait in the proxy's queue: ``Window.pressure``) resumes
    the climb at once from a demand-limited hold, or in slow start after a refine, knee or probe
    down judged with nobody waiting, and makes a held knee probe up every
    PRESSURE_PROBE_EVERY measurements instead of every ``probe_every``. A restart resumes at the
    last measured knee (or searches from the start if none was found); ITL/TTFT drifting at the
    held knee without more throughput steps the limit down, and on down while little is lost (a
    knee that moved lower is followed, one that did not is returned to). Never below
    ``floor``, never above ``max_limit``.
    """

    name = "adaptive"

    #: elasticity above which growth counts as linear and the climb step doubles. A doubling
    #: from L that gains >= 60% puts a sharp knee at >= 1.6 L, so 2 L is within 25% (one base
    #: step) of it; real engines gain ~80% per doubling well below their knee (the step time
    #: grows with the batch), and a threshold at 80% ended slow start on noise.
    LINEAR = 0.6

    def __init__(self, settings: LimitSettings | None = None, *, floor: int = 1) -> None:
        self.s = settings or LimitSettings()
        self.floor = max(1, floor, self.s.min_limit)
        self.ceiling = max(self.floor, self.s.max_limit)
        self.history: deque[tuple[float, int, str]] = deque(maxlen=256)
        self.reset()

    # ---- interface -------------------------------------------------------------------

    @property
    def limit(self) -> int:
        return self._limit

    @property
    def knee(self) -> int | None:
        return self._knee

    def reset(self) -> None:
        start = self.s.initial if self.s.initial is not None else max(self.floor, 8)
        self._limit = self._clamp(start)
        self._knee: int | None = None
        self._phase: Phase = "climb"
        self._doubling = True  # slow start: double while growth is linear
        self._step = 1.0
        self._confirming = False  # re-measuring a doubling that did not look linear
        self._good_knee: int | None = None  # the last knee chosen by measurement, not back-off
        self._ref: Measure | None = None  # measurement at the accepted level
        self._baseline: Measure | None = None  # measurement when the knee was (re)chosen
        self._windows: list[Window] = []
        self._settle = 0
        self._settle_until = 0.0
        self._drifts = 0
        self._stale = 0  # consecutive windows with stale scraped metrics
        # Of the last step kept: linear growth means no probe down, and a climb resumed under a
        # backlog doubles. Before any step is judged growth is presumed linear, as slow start
        # does: a limit held for lack of demand from the start knows nothing above itself.
        self._last_elasticity = self.LINEAR
        self._held = 0
        self._since_down = 0  # measurements held since the last scheduled probe
        self._probe_up_next = True
        self._demand_held = False  # holding only because demand was lower (knee not found)
        #: the decision that slowed the search (a refine, a knee, a probe down kept) was made
        #: with nobody waiting in the proxy: the router alone filled the limit, and a step of a
        #: few requests is lost in the noise. A backlog takes the search up again in slow start.
        self._unpressured = False
        self._congested: tuple[int, float] | None = None  # (level, until)
        self._external = 0.0  # requests others have in flight at this backend (scraped)
        self._last: Window | None = None
        self.reason = "start"

    def update(self, window: Window) -> None:
        self._last = window
        if window.restarted:
            known = self._good_knee
            self.reset()
            if known is not None and known > self._limit:
                self._resume_at(known, window.end)
            else:
                self._log(window.end, "backend restarted: search again")
            return
        if window.running_reqs is not None:
            scraped = window.running_reqs + (window.queue_reqs or 0.0)
            ext = max(0.0, scraped - window.in_flight)
            self._external = 0.5 * self._external + 0.5 * ext
        if window.in_flight > window.limit * 1.1 + 1:
            # Still draining down to a lower limit: what the backend queues now is what we sent
            # before, so neither its gauges nor our timings say anything new yet.
            self._windows.clear()
            return
        # After a raise the new requests wait for their prefill inside the backend, so its
        # queue says nothing about congestion while climbing or probing up (there, the step's
        # measurement decides, with SGLang's queued requests taken out of the decode rate) nor
        # within one TTFT of a change. Nor does it while a surge fills a limit held for lack
        # of demand (requests wait in the proxy): the backend queues the new requests for their
        # prefill just as after a raise (backing off there left a surge waiting for ~15 s), and
        # the climb the backlog resumes measures the level.
        surge = self._demand_held and window.pressure > 0
        holding = self._phase in ("hold", "probe_down") and not surge
        congestion = self._congestion(window, queue=holding and window.start >= self._settle_until)
        if congestion and self._settle == 0:
            excess = window.queue_reqs if congestion.startswith("backend queueing") else None
            self._back_off(window.end, congestion, excess)
            return
        if self._settle > 0 or window.start < self._settle_until:
            # Requests admitted by the change produce tokens only one TTFT later.
            self._settle = max(0, self._settle - 1)
            return
        if window.stale:
            self._windows.clear()  # saturated as far as we can tell: learn nothing, add nothing
            return
        doubling = self._phase == "climb" and self._doubling  # already climbing as fast as it can
        if (
            window.pressure >= PRESSURE
            and not doubling
            and (self._demand_held or self._unpressured)
        ):
            self._resume_climb(window.end)  # this window is the first measurement of the level
        if not self._demand_bound(window) and self._phase not in ("climb", "probe_up"):
            # Too little demand to learn anything at the knee. (While climbing, a window that
            # did not fill the limit still tells how many requests there are to serve.)
            self._windows.clear()
            return
        if window.tokens <= 0:
            return
        self._windows.append(window)
        slow_start = self._phase == "climb" and self._doubling and not self._confirming
        if len(self._windows) < (1 if slow_start else self.s.measure_windows):
            return
        m = Measure.of(self._limit, self._windows, self._external)
        self._windows = []
        if self._phase in ("climb", "probe_up"):
            self._on_up(m)
        elif self._phase == "probe_down":
            self._on_down(m)
        else:
            self._on_hold(m)

    def snapshot(self) -> dict:
        ref, base, last = self._ref, self._baseline, self._last
        return {
            "algorithm": self.name,
            "limit": self._limit,
            "knee": self._knee,
            "floor": self.floor,
            "phase": self._phase,
            "reason": self.reason,
            "external_in_flight": self._external,
            "baseline_itl_s": base.itl if base else None,
            "baseline_ttft_s": base.ttft if base else None,
            "baseline_tokens_per_s": base.tokens_per_s if base else None,
            "reference_tokens_per_s": ref.tokens_per_s if ref else None,
            "current_itl_s": last.itl if last else None,
            "current_ttft_s": last.ttft if last else None,
            "current_tokens_per_s": last.tokens_per_s if last else None,
            "pressure": last.pressure if last else None,
        }

    describe = snapshot

    # ---- phases ----------------------------------------------------------------------

    def _on_up(self, m: Measure) -> None:
        ref = self._ref
        if m.slack and ref is None:
            return  # too little demand to start learning: leave the limit alone
        if m.slack and m.in_flight <= ref.in_flight * 1.02 + 0.5:
            # The extra slots were not used: demand, not the backend, limits here. Hold at the
            # measured level plus headroom for demand to grow into: half a step, or while growth
            # was still linear (extra requests cost the others nothing) a grown step, so that a
            # surge of demand is admitted at once rather than after measured climbs.
            used = math.ceil(m.in_flight)
            room = GROWN_STEP if self._last_elasticity >= self.LINEAR else self.s.step / 2
            keep = max(ref.level, min(self._limit, used + max(1, round(used * room))))
            level = self._limit
            self._hold_at(ref, "", log=False)
            self._demand_held = True
            self._set(keep, m.at, f"{ref.level}->{level}: demand-limited at {used}; hold {keep}")
            return
        if ref is None or ref.level >= m.level or ref.in_flight >= m.in_flight:
            self._ref = m
            self._climb_from(m, "measured; climb")
            return
        rel = m.in_flight / ref.in_flight - 1.0
        gain = m.rate / ref.rate - 1.0 if ref.rate > 0 else 1.0
        measured = m.tokens_per_s / ref.tokens_per_s - 1.0 if ref.tokens_per_s > 0 else 1.0
        elasticity = gain / rel
        if _rose(m.ttft, ref.ttft, self.s.latency_tolerance) and measured < self.s.min_gain * rel:
            # ITL may stay flat while the backend queues what we send (all its slots full):
            # TTFT rising and no more tokens actually delivered say the step did not pay.
            elasticity = min(elasticity, measured / rel)
        # Requests that waited for a token all through the measurement, beyond the prefill
        # churn seen at the lower level, were queued by the backend: its running cap lies
        # inside this step, and what it runs is all a higher limit can get.
        confirming, self._confirming = self._confirming, False
        excess = m.awaiting - ref.awaiting * (m.in_flight / ref.in_flight)
        # (Only where demand filled the limit: a slack step's level is the in-flight count
        # used, a step of a few requests whose churn alone can read as two or three waiting.)
        if not m.slack and excess >= max(2.0, 0.25 * (m.level - ref.level)):
            if m.windows < self.s.measure_windows and not confirming:
                # One window may still hold the prefill wave of the requests the raise
                # admitted: only waiting that lasts through a full measurement is a queue.
                self._confirming = True
                self._log(m.at, f"{ref.level}->{m.level}: {excess:.0f} wait for a token: measure")
                return
            cap = max(ref.level, min(m.level - 1, round(m.level - excess)))
            self._hold_at(ref, "", log=False)
            self._knee = self._good_knee = cap
            self._baseline = None  # the first measurement at the cap becomes it
            # Every probe past a running cap lands requests in SGLang's queue for a
            # measurement: none goes above it for ``congestion_memory_s``.
            self._congested = (cap + 1, m.at + self.s.congestion_memory_s)
            why = f"{ref.level}->{m.level}: {excess:.0f} waited for a token: running cap {cap}"
            self._set(cap, m.at, why)
            return
        doubled = self._phase == "climb" and self._step > self.s.step
        ambiguous = self.s.min_gain <= elasticity < self.LINEAR
        if doubled and self._doubling and ambiguous and not confirming:
            # Slow start measures a level from one window, and one window right after a raise
            # can be caught in the prefill of the requests it admitted: a doubling that paid,
            # but less than linearly, is measured again over ``measure_windows`` windows
            # before slow start is given up.
            self._confirming = True
            self._log(m.at, f"{ref.level}->{m.level} gained {gain:+.1%}: measure again")
            return
        if doubled and elasticity < (self.LINEAR if self._doubling else self.s.min_gain):
            # A doubled step that was not linear may hide the knee inside it: go back and
            # climb on with the base step. (A step grown after a refinement is kept if it paid
            # at all: it was measured like a base step; only the next one is small again.)
            self._step = self.s.step
            self._doubling = False
            self._climb_from(ref, f"{ref.level}->{m.level} gained {gain:+.1%}: refine", m.at)
            self._unpressured = m.pressure < PRESSURE
            return
        if elasticity >= self.s.min_gain:
            self._ref = m
            self._knee = self._good_knee = m.level
            self._baseline = None  # a step's measurement: not a steady baseline (_hold_at)
            self._phase = "climb"
            self._last_elasticity = elasticity
            if elasticity >= self.LINEAR:
                # Still linear: the step doubles (slow start; after a refinement too, up to
                # GROWN_STEP, so a noisy refinement far below a large knee does not leave 25%
                # steps all the way up).
                self._step = min(1.0 if self._doubling else GROWN_STEP, self._step * 2)
            else:
                self._step = self.s.step
            self._climb_from(m, f"{ref.level}->{m.level} gained {gain:+.1%}: climb")
            return
        rose = _rose(m.itl, ref.itl, self.s.latency_tolerance) or _rose(
            m.ttft, ref.ttft, self.s.latency_tolerance
        )
        why = f"{ref.level}->{m.level} gained {gain:+.1%}{' with latency up' if rose else ''}"
        self._hold_at(ref, f"{why}: knee {ref.level}", now=m.at)
        self._unpressured = m.pressure < PRESSURE

    def _on_down(self, m: Measure) -> None:
        ref = self._ref
        assert ref is not None
        rel = ref.in_flight / m.in_flight - 1.0 if m.in_flight < ref.in_flight else 0.0
        loss = ref.rate / m.rate - 1.0 if m.rate > 0 else 1.0
        if rel > 0 and loss < self.s.min_gain * rel:
            # The higher level was not worth its extra in-flight: move the knee down, go on.
            self._ref = m
            self._knee = self._good_knee = m.level
            self._baseline = None  # a step's measurement: not a steady baseline (_hold_at)
            nxt = self._down(m.level)
            if nxt < m.level:
                self._set(nxt, m.at, f"{ref.level}->{m.level} lost only {loss:.1%}: lower")
            else:
                self._hold_at(m, f"{ref.level}->{m.level} lost only {loss:.1%}: at floor")
            self._unpressured = m.pressure < PRESSURE
            return
        self._phase = "hold"
        self._held = 0
        self._set(ref.level, m.at, f"{ref.level}->{m.level} lost {loss:.1%}: back to knee")

    def _on_hold(self, m: Measure) -> None:
        base = self._baseline
        # A limit held only because demand was lower is no knee: its baseline is a climb step's
        # measurement (taken while the step's requests were still in prefill), not a steady one.
        if base is not None and base.level == m.level and not self._demand_held:
            drift = _rose(m.itl, base.itl, self.s.drift_tolerance) or _rose(
                m.ttft, base.ttft, 2 * self.s.drift_tolerance
            )
            drift = drift and m.tokens_per_s < base.tokens_per_s * (1.0 + self.s.latency_tolerance)
            self._drifts = self._drifts + 1 if drift else 0
            if self._drifts >= DRIFT_MEASUREMENTS:
                # Same in-flight, slower answers, no more throughput: the backend changed
                # (slower, or shared with other traffic). Step down from here and keep going
                # down while little is lost, as a probe down does: a knee that moved lower is
                # followed, one that did not is returned to. (Searching again from a quarter of
                # the knee starved the backend for ~30 s whenever a burst of prefills read as
                # drift, and two proxies sharing a backend threw each other down in turn.)
                self._drifts = 0
                self._baseline = None  # the next steady measurement held here is the baseline
                why = (
                    f"latency drifted at the knee (ITL {_ms(base.itl)} -> {_ms(m.itl)} ms, "
                    f"TTFT {_ms(base.ttft)} -> {_ms(m.ttft)} ms)"
                )
                nxt = self._down(m.level, self.s.step)
                if nxt < m.level:
                    self._ref = m
                    self._phase = "probe_down"
                    self._set(nxt, m.at, f"{why}: step down")
                    return
                self._log(m.at, f"{why}: at the floor")
        self._ref = m
        if self._baseline is None and self._held >= 1:
            # Not the first measurement after a change: that one may still hold the prefill
            # of the requests the change admitted (fewer decoding, ITL low).
            self._baseline = m
        self._held += 1
        self._since_down += 1
        if m.pressure >= PRESSURE and self._since_down < self.s.probe_every:
            # Requests wait in the proxy while this backend sits at its knee: probe up every
            # PRESSURE_PROBE_EVERY measurements rather than every other ``probe_every`` (if
            # the knee is real the probe is undone). Probes down keep their own schedule.
            if self._held < PRESSURE_PROBE_EVERY:
                return
            self._held = 0
            nxt = self._capped(self._up(m.level, self.s.step / 2), m.at)
            if nxt > m.level:
                self._phase = "probe_up"
                self._step = self.s.step
                self._set(nxt, m.at, "demand above the knee: probe up")
            return
        if self._held < self.s.probe_every and self._since_down < self.s.probe_every:
            return
        if m.pressure >= PRESSURE:
            self._probe_up_next = False  # the probes up were made; this one is the probe down
        self._since_down = 0
        self._held = 0
        up = self._probe_up_next or m.level <= self.floor
        self._probe_up_next = not up
        if up:
            nxt = self._capped(self._up(m.level, self.s.step / 2), m.at)
            if nxt > m.level:
                self._phase = "probe_up"
                self._step = self.s.step
                self._set(nxt, m.at, "probe up")
        elif self._last_elasticity < self.LINEAR:
            # Only where throughput was already bending: below a knee reached while growth was
            # still linear, a lower level is surely worse (and its requests would wait here).
            nxt = self._down(m.level)
            if nxt < m.level:
                self._phase = "probe_down"
                self._set(nxt, m.at, "probe down")

    def _resume_at(self, knee: int, now: float) -> None:
        """A restarted backend is most likely the same deployment: hold at the knee it had
        (a probe up follows soon). If it came back different, its first measurements say so:
        queueing or a full KV pool backs off, a lower knee is found by the probes down."""
        self._good_knee = knee
        self._knee = self._clamp(knee)
        self._phase = "hold"
        self._doubling = False
        self._step = self.s.step
        self._probe_up_next = True
        self._set(self._knee, now, f"backend restarted: resume at its knee {self._knee}")

    def _resume_climb(self, now: float) -> None:
        """Demand outgrew a limit held only because demand had been lower, or a refine, knee
        or probe down decided while nobody waited in the proxy: the search goes on from here
        with the usual steps, each one measured (doubling if growth was still linear when demand ran
        out; after an unpressured decision, which may have been noise, always: a backlog
        waits out every measured step, so it climbs in slow start)."""
        unpressured = self._unpressured and not self._demand_held
        self._demand_held = False
        self._unpressured = False
        self._ref = None
        self._windows = []
        self._phase = "climb"
        self._doubling = unpressured or self._last_elasticity >= self.LINEAR
        self._step = 1.0 if self._doubling else self.s.step
        why = "backlog after a step judged without one" if unpressured else "demand above the limit"
        self._log(now, f"{why}: climb again")

    def _climb_from(self, m: Measure, why: str, now: float | None = None) -> None:
        now = m.at if now is None else now
        nxt = self._up(m.level, self._step)
        if self._doubling and m.pressure >= PRESSURE:
            # Slow start under a backlog: admit this backend's share of what waits at once
            # (up to BACKLOG_JUMP x the level) rather than doubling once per measurement while
            # a surge waits out every step; the next measurement judges the level as usual.
            nxt = max(nxt, min(m.level * BACKLOG_JUMP, m.level + m.backlog))
        until = self.s.slow_start_until
        if self._step > GROWN_STEP and nxt > until:
            # Slow start ends at ``slow_start_until``: a doubling that overshoots under a backlog
            # commits requests to the backend's own queue, where they cannot be taken back.
            if m.level >= until:
                self._doubling = False
                self._step = GROWN_STEP
            nxt = max(until, self._up(m.level, GROWN_STEP))
        nxt = self._capped(nxt, now)
        if nxt <= m.level:
            self._hold_at(m, f"{why}; no room above", now=now)
            return
        self._phase = "climb"
        self._set(nxt, now, why)

    def _hold_at(self, m: Measure, why: str, *, log: bool = True, now: float | None = None) -> None:
        self._knee = self._good_knee = m.level
        # The drift baseline is a measurement *held* at the knee (kept across probes): ``m`` was
        # taken right after a step (its requests partly still in prefill, fewer of them
        # decoding), so its ITL reads low and the steady state would look like drift.
        if self._baseline is not None and self._baseline.level != m.level:
            self._baseline = None
        self._ref = m
        self._phase = "hold"
        self._held = 0
        self._probe_up_next = False
        self._demand_held = False
        self._unpressured = False
        self._step = self.s.step
        self._doubling = False
        if log:
            self._set(m.level, m.at if now is None else now, why)

    # ---- congestion --------------------------------------------------------------------

    def _congestion(self, w: Window, *, queue: bool = True) -> str | None:
        if w.stale:
            # Saturated: no climbing (see update); a back-off only once it has lasted
            # STALE_WINDOWS windows, then every STALE_WINDOWS windows (scrapes can be slow).
            self._stale += 1
            if self._stale % STALE_WINDOWS == 0:
                return "scraped metrics stale"
            return None
        self._stale = 0
        if w.token_usage is not None and w.token_usage >= self.s.kv_high:
            return f"KV usage {w.token_usage:.2f}"
        if queue and w.queue_reqs is not None and w.queue_reqs > self.s.queue_tolerance:
            ref = self._baseline or self._ref
            # The gauge confirms what the proxy's own timing says (it lags by up to 40 steps):
            # a queue of a tenth of the limit is congestion by itself; a smaller one only if the
            # proxy's TTFT rose too (a backend at exactly its running cap shows a request or
            # two queued between a finish and the next admission).
            big = w.queue_reqs >= max(2.0, 0.1 * self._limit)
            ttft_known = ref is not None and ref.ttft is not None and w.ttft_count >= 3
            rose = ttft_known and _rose(w.ttft, ref.ttft, self.s.latency_tolerance)
            if big or rose:
                return f"backend queueing {w.queue_reqs:g}"
        if w.errors >= 2 and w.errors * 2 > w.completions:
            return f"{w.errors} errors"
        return None

    def _back_off(self, now: float, why: str, excess: float | None = None) -> None:
        level = self._limit
        new = math.floor(level * self.s.backoff)
        if excess is not None:  # the backend says how many it queues: shed those (<= half)
            new = max(level - math.ceil(excess), level // 2)
        new = self._clamp(min(level - 1, new))
        self._congested = (level, now + self.s.congestion_memory_s)
        self._unpressured = False
        self._knee = new
        self._ref = None
        self._baseline = None
        self._windows = []
        self._phase = "hold"
        self._held = 0
        self._since_down = 0
        self._probe_up_next = True
        self._demand_held = False
        self._step = self.s.step
        self._set(new, now, f"{why}: back off")

    # ---- helpers -----------------------------------------------------------------------

    def _demand_bound(self, w: Window) -> bool:
        return w.at_limit >= 0.5 or w.in_flight >= SLACK * max(w.limit, 1)

    def _up(self, level: int, frac: float) -> int:
        return self._clamp(level + max(1, round(level * frac)))

    def _down(self, level: int, frac: float | None = None) -> int:
        frac = self.s.step / 2 if frac is None else frac
        return self._clamp(level - max(1, round(level * frac)))

    def _capped(self, nxt: int, now: float) -> int:
        caps = []
        if self._congested is not None:
            level, until = self._congested
            if now < until:
                caps.append(level - 1)
            else:
                self._congested = None
        return self._clamp(min([nxt, *caps]))

    def _clamp(self, n: int) -> int:
        return max(self.floor, min(self.ceiling, int(n)))

    @property
    def climbs_on_backlog(self) -> bool:
        """Would a window under pressure resume the climb (see ``update``)?"""
        doubling = self._phase == "climb" and self._doubling
        return not doubling and (self._demand_held or self._unpressured)

    @property
    def settle_until(self) -> float:
        """Until when the last change's requests are still in their prefill (see
        :func:`window_complete`)."""
        return self._settle_until

    def _set(self, new: int, now: float, why: str) -> None:
        if new != self._limit:
            self._settle = self.s.settle_windows
            ttft = self._last.ttft if self._last is not None else None
            if ttft is None and self._ref is not None:
                ttft = self._ref.ttft
            self._settle_until = now + min(ttft or 0.0, self.s.max_window_s)
            self._windows = []
        self._limit = new
        self._log(now, why)

    def _log(self, now: float, why: str) -> None:
        self.reason = why
        self.history.append((now, self._limit, why))


def window_complete(limit: Limit, stats: BackendStats, now: float) -> bool:
    """Is the backend's open observation window complete (admission then feeds it to the limit)?

    A window lasts ``window_s`` and until it saw ``window_tokens`` (at most ``max_window_s``).
    A window open while a change settles is ignored by the limit (``settle_until``: one TTFT
    after the change): it ends as soon as the requests the change admitted have had their
    prefill, i.e. once few of ours still wait for a first token (``SETTLED_AWAITING``), which
    is one TTFT after a small step and a whole prefill wave after a big one (a step measured
    inside the wave reads as no gain). Then, to take a surge in sooner:

    - for a limit that resumes its climb on a backlog (``climbs_on_backlog``), a window ends
      when a backlog begins (the window that follows is all backlog) and does not wait for
      ``window_tokens`` once it was under pressure: right after a surge the new requests are
      all in their prefill and tokens come slowly, which is when they wait most.
    """
    s = getattr(limit, "s", None)
    started = stats.window_started
    age = now - started
    settle_until = getattr(limit, "settle_until", None)
    if settle_until is not None and started < settle_until:
        if s is not None and age >= s.max_window_s:
            return True
        settled = stats.awaiting <= max(2.0, SETTLED_AWAITING * limit.limit)
        return now >= settle_until and settled
    on_backlog = getattr(limit, "climbs_on_backlog", False)
    backlog_since = stats.backlog_since()
    if on_backlog and backlog_since is not None and backlog_since > started:
        return True
    if age < getattr(s, "window_s", 1.0):
        return False
    if s is None or stats.window_tokens() >= s.window_tokens or age >= s.max_window_s:
        return True
    return on_backlog and stats.window_pressure(now) >= PRESSURE


def limit_floor(
    settings: LimitSettings, parallelism: str | None = None, pp_size: int | None = None
) -> int:
    """The hint's floor: a pipeline-parallel backend needs pp_size requests in flight."""
    floor = settings.min_limit
    if parallelism == "pp" and pp_size:
        floor = max(floor, int(pp_size))
    return floor


def make_limit(
    settings: LimitSettings | None = None,
    *,
    parallelism: str | None = None,
    pp_size: int | None = None,
) -> Limit:
    """Build the configured limit for one backend from its settings and parallelism hint."""
    settings = settings or LimitSettings()
    floor = limit_floor(settings, parallelism, pp_size)
    if settings.algorithm == "fixed":
        # A fixed limit is exactly what was asked for (benchmarks sweep below the floor too).
        return FixedLimit(settings.initial if settings.initial is not None else max(floor, 32))
    return AdaptiveLimit(settings, floor=floor)
