"""Per-backend statistics: the one place observations land.

The forwarding path calls ``observe_*`` as a response streams (TTFT, inter-token gaps, tokens,
completion); the admission layer reports in-flight changes; the scraper reports SGLang's gauges.
Two kinds of read side come out of it:

- long-lived estimates for routing (time-decayed EWMAs: TTFT with peaks adopted at once, ITL,
  drain rate in tokens/s and completions/s, output tokens per request), read as properties;
- fixed windows for the limit algorithms: :meth:`BackendStats.take_window` closes the current
  window and returns a :class:`Window` of plain numbers, so a limit never sees this object.

Nothing here awaits; all methods are O(1) except closing a window (a sort of its TTFT samples).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True, slots=True)
class Window:
    """One window of a backend's observations, the input of a limit algorithm.

    ``in_flight`` is the proxy's own time-averaged count; ``at_limit`` the fraction of the window
    the backend spent with ``in_flight >= limit`` (1.0 means demand exceeded the limit all along).
    ``pressure`` the fraction spent at the limit *while the proxy's queue held waiters*: demand
    this backend could have taken had its limit been higher (1.0: the limit, not demand, bound
    all along). Scraped values are the latest fresh ones, or None when the backend is not
    scraped; ``stale`` is True when scraping is configured but its last success is too old
    (count as saturated).
    """

    start: float
    end: float
    limit: int
    in_flight: float
    at_limit: float
    tokens: int
    tokens_per_s: float
    itl: float | None  # mean seconds per token over the window
    ttft: float | None  # median of the window's TTFT samples
    ttft_count: int
    completions: int
    errors: int
    queue_reqs: float | None = None
    token_usage: float | None = None
    running_reqs: float | None = None
    stale: bool = False
    restarted: bool = False
    itl_p50: float | None = None  # token-weighted median ITL: robust to prefill stalls
    pressure: float = 0.0  # fraction of the window at the limit with requests queued in the proxy
    #: time-averaged count of our requests sent upstream that have not produced a token yet:
    #: SGLang's queue and prefill as the proxy sees them, without the gauges' 40-step lag
    awaiting: float = 0.0
    #: this backend's share of the requests waiting in the proxy's queue when the window closed
    #: (admission splits the queue by the backends' limits)
    backlog: int = 0
    #: the fewest of our streamed requests without a token yet at any moment of the window:
    #: prefill makes a request wait a moment, only a queue keeps some waiting all window long
    awaiting_min: float = 0.0
    #: our requests in flight at the moment ``awaiting_min`` was reached (None: not recorded,
    #: the mean stands in): the fewest waiting are a share of what was in flight *then*; where
    #: the count moves within a window (open-loop arrivals, a raise filling), its mean is not
    in_flight_at_min: float | None = None
    #: time-averaged count of our requests whose first token the proxy cannot see
    #: (non-streamed: their answer arrives whole), left out of ``awaiting``
    opaque: float = 0.0
    #: the most requests the server says it runs at once (its ``/server_info``), if it said
    max_running: int | None = None
    #: the server's pipeline stages (its ``/server_info``), if it said
    pp_size: int | None = None
    #: another routable backend could take this one's requests (the control loop says)
    elsewhere: bool = False

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def in_flight_at_fewest(self) -> float:
        """In flight when the fewest waited (``in_flight_at_min``, else the mean)."""
        return self.in_flight if self.in_flight_at_min is None else self.in_flight_at_min


class DecayingEwma:
    """Time-decayed mean of samples (Finagle's peak EWMA when ``peak`` is set).

    Every sample weighs 1 when it arrives and decays with time constant ``tau`` seconds; the
    value is the weighted mean of the samples seen, so the first one counts as one sample, not
    as all history (an estimate begun in a burst would otherwise carry the burst for ``tau``),
    and a sample after a long gap counts no more than any other. With ``peak`` a sample above
    the current value is adopted at once and lower samples pull it down slowly.
    """

    __slots__ = ("_stamp", "_weight", "peak", "tau", "value")

    def __init__(self, tau: float, *, peak: bool = False) -> None:
        self.tau = tau
        self.peak = peak
        self.value: float | None = None
        self._weight = 0.0
        self._stamp = 0.0

    def observe(self, x: float, now: float) -> None:
        if self.value is None:
            self.value, self._weight = x, 1.0
        else:
            self._weight = self._weight * math.exp(-max(now - self._stamp, 0.0) / self.tau) + 1.0
            self.value = (
                x if self.peak and x > self.value else self.value + (x - self.value) / self._weight
            )
        self._stamp = now

    def observe_sum(self, total: float, n: int, now: float) -> None:
        """``n`` samples adding up to ``total``, all at ``now`` (not with ``peak``): the same
        weighted mean as observing them one by one."""
        if self.value is None:
            self.value, self._weight = total / n, float(n)
        else:
            kept = self._weight * math.exp(-max(now - self._stamp, 0.0) / self.tau)
            self._weight = kept + n
            self.value = (self.value * kept + total) / self._weight
        self._stamp = now

    def faded(self, since: float, now: float) -> float | None:
        """The value decayed toward zero for the time since ``since`` or the last sample,
        whichever is later: an estimate nothing has refreshed loses its weight (tower's and
        Finagle's peak EWMA read)."""
        if self.value is None:
            return None
        return self.value * math.exp(-max(now - max(since, self._stamp), 0.0) / self.tau)

    def reset(self) -> None:
        self.value = None
        self._weight = 0.0


class DecayingSlope:
    """Time-decayed least-squares slope of y against x (how ITL grows with the in-flight count).

    Every sample weighs 1 when it arrives and decays with time constant ``tau``. ``slope`` is
    None until x has varied by at least ``min_spread`` (standard deviation): a backend held at
    one load says nothing about how its latency grows with load.
    """

    __slots__ = ("_s0", "_stamp", "_sx", "_sxx", "_sxy", "_sy", "min_spread", "tau")

    def __init__(self, tau: float, *, min_spread: float = 1.0) -> None:
        self.tau = tau
        self.min_spread = min_spread
        self.reset()

    def observe(self, x: float, y: float, now: float) -> None:
        self.observe_sums(1, x, y, x * x, x * y, now)

    def observe_sums(
        self, n: int, sx: float, sy: float, sxx: float, sxy: float, now: float
    ) -> None:
        """``n`` samples at ``now`` given by their sums (x, y, x*x, x*y)."""
        d = math.exp(-max(now - self._stamp, 0.0) / self.tau)
        self._stamp = now
        self._s0 = self._s0 * d + n
        self._sx = self._sx * d + sx
        self._sy = self._sy * d + sy
        self._sxx = self._sxx * d + sxx
        self._sxy = self._sxy * d + sxy

    @property
    def slope(self) -> float | None:
        if self._s0 < 2.0:
            return None
        mx = self._sx / self._s0
        var = self._sxx / self._s0 - mx * mx
        if var < self.min_spread**2:
            return None
        return (self._sxy / self._s0 - mx * self._sy / self._s0) / var

    def reset(self) -> None:
        self._s0 = self._sx = self._sy = self._sxx = self._sxy = 0.0
        self._stamp = 0.0


#: ITL samples summed before they are folded into the estimates span at most this share of
#: their horizon (so that folding them as of the last one's time changes nothing that matters)
FOLD_SHARE = 0.01


class ItlModel:
    """Inter-token latency as routing reads it: its time-decayed mean (``ewma``), the
    in-flight count it was measured at (``load``), and how it grows with that count
    (``slope``, over a six times longer horizon: the load must have varied for one to show).

    A sample comes with every relayed token event, hundreds per decode step, on the relay's
    hot path; samples are summed as they arrive and folded into the estimates when one is
    read (``fold``), or when the batch spans ``FOLD_SHARE`` of the horizon. Samples folded
    together count as arriving at the last one's time: they are at most that far apart.
    """

    __slots__ = ("_at", "_n", "_since", "_span", "_x", "_xx", "_xy", "_y", "ewma", "load", "slope")

    def __init__(self, tau: float) -> None:
        self.ewma = DecayingEwma(tau)
        self.load = DecayingEwma(tau)
        self.slope = DecayingSlope(tau * 6)
        self._span = FOLD_SHARE * tau
        self._clear()

    def add(self, itl: float, in_flight: float, now: float) -> None:
        if now - self._since > self._span:
            self.fold()
            self._since = now
        self._n += 1
        self._y += itl
        self._x += in_flight
        self._xx += in_flight * in_flight
        self._xy += in_flight * itl
        self._at = now

    def fold(self) -> None:
        n = self._n
        if n:
            at = self._at
            self.ewma.observe_sum(self._y, n, at)
            self.load.observe_sum(self._x, n, at)
            self.slope.observe_sums(n, self._x, self._y, self._xx, self._xy, at)
            self._clear()

    def reset(self) -> None:
        self.ewma.reset()
        self.load.reset()
        self.slope.reset()
        self._clear()

    def _clear(self) -> None:
        self._n = 0
        self._y = self._x = self._xx = self._xy = self._at = 0.0
        self._since = -math.inf  # when the batch's first sample came (none: the next starts one)


class RateMeter:
    """Events per second over a sliding horizon, in fixed buckets (tokens/s, completions/s).

    The bucket being filled is kept apart (``_key``, its time span, ``_cur``): a token event
    lands in it with one comparison, and it joins the others when time leaves it or a rate
    is read."""

    __slots__ = ("_buckets", "_cur", "_hi", "_key", "_lo", "_n", "_width")

    def __init__(self, horizon_s: float = 10.0, buckets: int = 20) -> None:
        self._n = buckets
        self._width = horizon_s / buckets
        self._buckets: dict[int, float] = {}
        self._key = 0
        self._lo = self._hi = self._cur = 0.0

    def add(self, amount: float, now: float) -> None:
        if self._lo <= now < self._hi:
            self._cur += amount
            return
        self._flush()
        key = int(now // self._width)
        self._key, self._lo, self._hi = key, key * self._width, (key + 1) * self._width
        self._cur = amount
        if len(self._buckets) > self._n + 2:
            oldest = key - self._n
            for k in [k for k in self._buckets if k <= oldest]:
                del self._buckets[k]

    def rate(self, now: float) -> float:
        self._flush()
        key = int(now // self._width)
        lo = key - self._n + 1
        total = sum(v for k, v in self._buckets.items() if lo <= k <= key)
        span = self._n * self._width
        return total / span

    def _flush(self) -> None:
        if self._cur:
            self._buckets[self._key] = self._buckets.get(self._key, 0.0) + self._cur
            self._cur = 0.0


@dataclass(slots=True)
class ScrapeState:
    """The latest scrape of a backend's /metrics, or of its load report without them (counts
    summed over ranks), and what the server said of itself (``/server_info``)."""

    #: where the counts come from: ``metrics``, ``loads`` (``/v1/loads``: a server without
    #: metrics) or ``none`` (neither is served: only the server's word, if it says one)
    source: Literal["metrics", "loads", "none"] = "metrics"

    ok_at: float | None = None  # when the last successful scrape happened
    attempted_at: float | None = None
    queue_reqs: float | None = None
    running_reqs: float | None = None
    token_usage: float | None = None
    generation_tokens_total: float | None = None
    retractions_total: float | None = None
    errors: int = 0
    restarts: int = 0
    last_error: str | None = None
    #: ``max_running_requests`` from the server's own info (None: not said, or not asked yet)
    max_running_requests: int | None = None
    #: ``pp_size`` from the same: the server's pipeline stages
    pp_size: int | None = None
    #: the restart count when that was last asked (None: never, or to be asked again: after a
    #: restart the metrics show, or health saw the backend come back)
    word_asked: int | None = None


@dataclass(slots=True)
class _WindowAcc:
    start: float
    tokens: int = 0
    itl_sum: float = 0.0
    itl_tokens: int = 0
    itls: list[tuple[float, int]] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    completions: int = 0
    errors: int = 0
    in_flight_area: float = 0.0
    at_limit_time: float = 0.0
    pressure_time: float = 0.0
    awaiting_area: float = 0.0
    awaiting_min: int = 0
    in_flight_at_min: int = 0  # in flight when awaiting_min was reached
    opaque_area: float = 0.0


class BackendStats:
    """Observations of one backend.

    ``clock`` is a monotonic time source (injectable for tests). ``stale_after_s`` is how old the
    last successful scrape may be before the backend counts as saturated; None disables the
    check (also the state before any scraper reported).
    """

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        decay_s: float = 10.0,
        stale_after_s: float | None = None,
        error_penalty_s: float = 1.0,
    ) -> None:
        self._clock = clock
        self.decay_s = decay_s
        self.stale_after_s = stale_after_s
        self.error_penalty_s = error_penalty_s
        # routing estimates
        self.ttft_ewma = DecayingEwma(decay_s, peak=True)
        self.itl_model = ItlModel(decay_s)
        self.output_tokens_ewma = DecayingEwma(decay_s * 3)
        self._tokens_rate = RateMeter(horizon_s=decay_s)
        self._completion_rate = RateMeter(horizon_s=decay_s)
        self.peak_tokens_per_s = DecayingEwma(decay_s * 6, peak=True)
        # counters
        self.ttft_count = 0
        self.first_bytes = 0
        self.tokens_total = 0
        self.completions_ok = 0
        self.completions_failed = 0
        self.errors_by_kind: dict[str, int] = {}
        self.consecutive_errors = 0
        # the prefix cache as the backend reports it (answers that said their cached tokens)
        self.reported_prompt_tokens = 0
        self.cached_tokens = 0
        self.scrape = ScrapeState()
        # in-flight integration for windows
        self._in_flight = 0
        self._idle_since = clock()  # when ``_in_flight`` last dropped to zero
        self._limit = 0
        self._waiters = 0  # our share of the requests waiting in the proxy's queue (admission)
        #: streamed requests sent upstream without a token yet: when each was sent, oldest
        #: first (key -> time)
        self._awaiting_since: dict[int, float] = {}
        #: when a streamed request last produced its first token (or ended without one)
        self.answered_at: float | None = None
        self._opaque = 0  # non-streamed requests upstream (no first token to see)
        self._opaque_keys: set[int] = set()
        self._send_seq = 0
        self._recallable: dict[int, Callable[[], bool]] = {}  # unanswered, oldest first
        self._recalled: set[int] = set()
        self._if_stamp = clock()
        self._win = _WindowAcc(start=self._if_stamp)
        self._restart_pending = False

    # ---- write side (forwarding, admission, scraper) ------------------------------------

    def now(self) -> float:
        return self._clock()

    def observe_ttft(self, seconds: float) -> None:
        """Time from sending the request upstream to its first token-carrying event."""
        now = self._clock()
        self.ttft_count += 1
        self.ttft_ewma.observe(seconds, now)
        self._win.ttfts.append(seconds)

    def observe_first_byte(self) -> None:
        """The backend started answering (response headers): enough to trust a new backend
        with more than a probe's worth of requests, also for non-streaming traffic."""
        self.first_bytes += 1

    def observe_itl(
        self, seconds_per_token: float, tokens: int = 1, now: float | None = None
    ) -> None:
        """One inter-token gap: an event with ``tokens`` tokens after a gap gives that many samples
        of ``gap / tokens``."""
        if tokens <= 0:
            return
        now = self._clock() if now is None else now
        self.itl_model.add(seconds_per_token, self._in_flight, now)
        w = self._win
        w.itl_sum += seconds_per_token * tokens
        w.itl_tokens += tokens
        if len(w.itls) < 50_000:
            w.itls.append((seconds_per_token, tokens))

    def observe_tokens(self, n: int, now: float | None = None) -> None:
        """``n`` generated tokens arrived (each token-carrying event, first one included)."""
        if n <= 0:
            return
        now = self._clock() if now is None else now
        self.tokens_total += n
        self._win.tokens += n
        self._tokens_rate.add(n, now)

    def observe_completion(
        self,
        ok: bool,
        error_kind: str | None = None,
        duration: float | None = None,
        output_tokens: int | None = None,
    ) -> None:
        """A request to this backend ended. Errors (incl. 429) count as slow for routing: they
        feed a TTFT penalty so a fast failure never attracts traffic."""
        now = self._clock()
        self._completion_rate.add(1, now)
        self._win.completions += 1
        if ok:
            self.completions_ok += 1
            self.consecutive_errors = 0
            if output_tokens is not None and output_tokens > 0:
                self.output_tokens_ewma.observe(float(output_tokens), now)
        else:
            self.completions_failed += 1
            self.consecutive_errors += 1
            self._win.errors += 1
            kind = error_kind or "error"
            self.errors_by_kind[kind] = self.errors_by_kind.get(kind, 0) + 1
            current = self.ttft_ewma.value or 0.0
            self.ttft_ewma.observe(max(self.error_penalty_s, 3.0 * current), now)

    def observe_cached(self, prompt_tokens: int | None, cached_tokens: int) -> None:
        """An answer reported ``cached_tokens`` of its ``prompt_tokens`` found in the backend's
        prefix cache (``usage.prompt_tokens_details.cached_tokens``,
        ``meta_info.cached_tokens``)."""
        if prompt_tokens:
            self.reported_prompt_tokens += prompt_tokens
            self.cached_tokens += min(cached_tokens, prompt_tokens)

    @property
    def cached_hit_rate(self) -> float | None:
        """Cached over prompt tokens, over the answers that reported them."""
        if not self.reported_prompt_tokens:
            return None
        return self.cached_tokens / self.reported_prompt_tokens

    def observe_in_flight(self, in_flight: int, limit: int, now: float | None = None) -> None:
        """The proxy's in-flight count (or the limit) for this backend changed."""
        now = self._clock() if now is None else now
        self._integrate(now)
        if in_flight == 0 and self._in_flight > 0:
            self._idle_since = now
        self._in_flight = in_flight
        self._limit = limit

    def observe_sent(
        self,
        now: float | None = None,
        recall: Callable[[], bool] | None = None,
        *,
        streamed: bool = True,
    ) -> int:
        """A request went upstream: it awaits its first token until ``observe_answered(key)``
        with the key returned here. ``recall`` (optional) takes it back from the backend
        before it answers (see ``recall_unanswered``); it returns whether it could. A
        non-streamed request (``streamed=False``) has no first token to see: it is counted
        apart (``Window.opaque``), not as awaiting."""
        now = self._clock() if now is None else now
        self._integrate(now)
        self._send_seq += 1
        if streamed:
            self._awaiting_since[self._send_seq] = now
        else:
            self._opaque += 1
            self._opaque_keys.add(self._send_seq)
        if recall is not None:
            self._recallable[self._send_seq] = recall
        return self._send_seq

    def observe_answered(self, now: float | None = None, key: int | None = None) -> None:
        """A request sent upstream produced its first token, or ended without one."""
        now = self._clock() if now is None else now
        self._integrate(now)
        if key is not None and key in self._opaque_keys:
            self._opaque_keys.discard(key)
            self._opaque = max(0, self._opaque - 1)
        else:
            since = self._awaiting_since
            if since and (key is None or since.pop(key, None) is None):
                del since[next(iter(since))]  # unnamed: the oldest
            self.answered_at = now
            if len(since) < self._win.awaiting_min:
                self._win.awaiting_min = len(since)
                self._win.in_flight_at_min = self._in_flight
        if key is not None:
            self._recallable.pop(key, None)
            self._recalled.discard(key)

    @property
    def awaiting(self) -> int:
        """Requests sent upstream that have produced no token yet."""
        return len(self._awaiting_since)

    def awaiting_since(self, before: float, enough: int) -> int:
        """How many of the requests still without a first token were sent before ``before``
        (counting stops past ``enough``: oldest first, so this costs at most that many steps)."""
        n = 0
        for sent in self._awaiting_since.values():
            if sent >= before or n > enough:
                break
            n += 1
        return n

    @property
    def recalling(self) -> int:
        """Requests recalled from this backend that have not let go of their slot yet."""
        return len(self._recalled)

    def recall_unanswered(self, n: int) -> int:
        """Take back up to ``n`` requests that have not produced a token yet, newest first (at
        the tail of the backend's own queue): they go back to the proxy's queue. Returns how
        many were recalled."""
        done = 0
        for key in reversed(list(self._recallable)):
            if done >= n:
                break
            recall = self._recallable.pop(key)
            if recall():
                self._recalled.add(key)
                done += 1
        return done

    @property
    def waiters(self) -> int:
        """This backend's share of the requests waiting in the proxy's queue now."""
        return self._waiters

    def observe_waiters(self, waiters: int, now: float | None = None) -> None:
        """This backend's share of the requests waiting in the proxy's queue changed (admission
        reports it): time at the limit with waiters is the window's ``pressure``, the share at
        its end the window's ``backlog``."""
        if (waiters > 0) == (self._waiters > 0):
            self._waiters = waiters
            return
        self._integrate(self._clock() if now is None else now)
        self._waiters = waiters

    def observe_scrape(
        self,
        *,
        ok: bool,
        queue_reqs: float | None = None,
        running_reqs: float | None = None,
        token_usage: float | None = None,
        generation_tokens_total: float | None = None,
        retractions_total: float | None = None,
        error: str | None = None,
        now: float | None = None,
    ) -> None:
        """Result of one scrape of the backend's /metrics (gauges already summed over ranks).
        A counter that went backwards means the backend restarted."""
        now = self._clock() if now is None else now
        s = self.scrape
        s.attempted_at = now
        if not ok:
            s.errors += 1
            s.last_error = error
            return
        if (
            generation_tokens_total is not None
            and s.generation_tokens_total is not None
            and generation_tokens_total + 1e-9 < s.generation_tokens_total
        ):
            s.restarts += 1
            self._restart_pending = True
        s.ok_at = now
        s.queue_reqs = queue_reqs
        s.running_reqs = running_reqs
        s.token_usage = token_usage
        s.generation_tokens_total = generation_tokens_total
        s.retractions_total = retractions_total
        s.last_error = None

    def mark_restarted(self) -> None:
        """Health saw the backend come back: the next window tells the limit to start over, and
        routing forgets its old TTFT/ITL (error penalties included: they would otherwise stay
        until it serves again, and a backend that looks slow is never picked while others have
        room), so the returned backend counts as unmeasured and is probed first. The scraper
        asks its word again, and for its metrics if it had none (it may have come back with
        other arguments; without metrics this is the only restart the proxy sees)."""
        self._restart_pending = True
        self.scrape.word_asked = None
        self.scrape.source = "metrics"
        self.ttft_ewma.reset()
        self.itl_model.reset()

    # ---- read side ---------------------------------------------------------------------

    @property
    def ttft(self) -> float | None:
        """Peak-EWMA TTFT in seconds (errors included as penalties), faded while idle."""
        return self._estimate(self.ttft_ewma)

    @property
    def itl(self) -> float | None:
        """EWMA inter-token latency, seconds per token, faded while idle."""
        self.itl_model.fold()
        return self._estimate(self.itl_model.ewma)

    def _estimate(self, ewma: DecayingEwma) -> float | None:
        """A routing estimate as of now. While none of our requests is on the backend nothing
        refreshes it, and an estimate taken in a burst (a start-up prefill wave, a penalty)
        would otherwise keep routing away from the backend for good: it fades toward zero
        until the backend is tried again and measured afresh."""
        if self._in_flight > 0:
            return ewma.value
        return ewma.faded(self._idle_since, self._clock())

    def itl_at(self, in_flight: float) -> float | None:
        """Expected ITL with ``in_flight`` requests: the current EWMA moved along the measured
        slope from the load it was measured at (no slope yet, or a negative one: the EWMA).
        Kept within [1/2, 2] x the EWMA: the fit is local, not a model of the engine."""
        itl, model = self.itl, self.itl_model  # (folded by ``itl``)
        load, slope = model.load.value, model.slope.slope
        if itl is None or load is None or slope is None or slope <= 0:
            return itl
        return min(2.0 * itl, max(0.5 * itl, itl + slope * (in_flight - load)))

    @property
    def output_tokens(self) -> float | None:
        """EWMA of output tokens per successful request."""
        return self.output_tokens_ewma.value

    @property
    def tokens_per_s(self) -> float:
        return self._tokens_rate.rate(self._clock())

    @property
    def completions_per_s(self) -> float:
        return self._completion_rate.rate(self._clock())

    @property
    def max_tokens_per_s(self) -> float | None:
        """Slowly decaying peak of the windowed token throughput (the backend's drain rate)."""
        return self.peak_tokens_per_s.value

    @property
    def trusted(self) -> bool:
        """A backend is trusted unless its latest request failed; admission gives an untrusted
        one ``probe_in_flight`` requests until one succeeds. A new backend has passed its
        health checks before it is routable: holding it to one request until its first answer
        sent every waiting request to whichever backend answered first when prefills are long
        (a cold start behind a few long prompts)."""
        return self.consecutive_errors == 0

    def scrape_age(self, now: float | None = None) -> float | None:
        if self.scrape.ok_at is None:
            return None
        return (self._clock() if now is None else now) - self.scrape.ok_at

    def scrape_stale(self, now: float | None = None) -> bool:
        """True when scraping is enabled and its last success is older than stale_after_s."""
        if self.stale_after_s is None or self.scrape.attempted_at is None:
            return False
        age = self.scrape_age(now)
        return age is None or age > self.stale_after_s

    @property
    def window_started(self) -> float:
        return self._win.start

    def take_window(self, now: float | None = None, *, elsewhere: bool = False) -> Window:
        """Close the current window and return it; a new one starts at ``now``. ``elsewhere``:
        another routable backend could take this one's requests."""
        now = self._clock() if now is None else now
        self._integrate(now)
        w = self._win
        span = max(now - w.start, 1e-9)
        ttft = None
        if w.ttfts:
            xs = sorted(w.ttfts)
            ttft = xs[len(xs) // 2]
        stale = self.scrape_stale(now)
        fresh = self.scrape.ok_at is not None and not stale
        tps = w.tokens / span
        if w.tokens > 0 and span > 0.2:
            self.peak_tokens_per_s.observe(tps, now)
        out = Window(
            start=w.start,
            end=now,
            limit=self._limit,
            in_flight=w.in_flight_area / span,
            at_limit=w.at_limit_time / span,
            pressure=w.pressure_time / span,
            awaiting=w.awaiting_area / span,
            awaiting_min=float(w.awaiting_min),
            in_flight_at_min=float(w.in_flight_at_min),
            max_running=self.scrape.max_running_requests,
            pp_size=self.scrape.pp_size,
            elsewhere=elsewhere,
            opaque=w.opaque_area / span,
            backlog=self._waiters,
            tokens=w.tokens,
            tokens_per_s=tps,
            itl=(w.itl_sum / w.itl_tokens) if w.itl_tokens else None,
            ttft=ttft,
            ttft_count=len(w.ttfts),
            completions=w.completions,
            errors=w.errors,
            queue_reqs=self.scrape.queue_reqs if fresh else None,
            token_usage=self.scrape.token_usage if fresh else None,
            running_reqs=self.scrape.running_reqs if fresh else None,
            stale=stale,
            restarted=self._restart_pending,
            itl_p50=weighted_median(w.itls),
        )
        self._restart_pending = False
        self._win = _WindowAcc(
            start=now, awaiting_min=self.awaiting, in_flight_at_min=self._in_flight
        )
        return out

    def snapshot(self) -> dict:
        """Plain-data view for /admin/backends."""
        now = self._clock()
        return {
            "ttft_s": self.ttft,
            "itl_s": self.itl,
            "tokens_per_s": self.tokens_per_s,
            "max_tokens_per_s": self.max_tokens_per_s,
            "completions_per_s": self.completions_per_s,
            "output_tokens_mean": self.output_tokens,
            "awaiting_first_token": self.awaiting,
            "trusted": self.trusted,
            "tokens_total": self.tokens_total,
            "completions_ok": self.completions_ok,
            "completions_failed": self.completions_failed,
            "errors_by_kind": dict(self.errors_by_kind),
            "prompt_tokens_reported": self.reported_prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "cached_hit_rate": self.cached_hit_rate,
            "scrape": {
                "source": self.scrape.source,
                "queue_reqs": self.scrape.queue_reqs,
                "running_reqs": self.scrape.running_reqs,
                "token_usage": self.scrape.token_usage,
                "age_s": self.scrape_age(now),
                "stale": self.scrape_stale(now),
                "errors": self.scrape.errors,
                "restarts": self.scrape.restarts,
                "retractions_total": self.scrape.retractions_total,
                "max_running_requests": self.scrape.max_running_requests,
                "pp_size": self.scrape.pp_size,
            },
        }

    # ---- internals ---------------------------------------------------------------------

    def _integrate(self, now: float) -> None:
        dt = now - self._if_stamp
        if dt > 0:
            self._win.in_flight_area += self._in_flight * dt
            self._win.awaiting_area += self.awaiting * dt
            self._win.opaque_area += self._opaque * dt
            if self._limit > 0 and self._in_flight >= self._limit:
                self._win.at_limit_time += dt
                if self._waiters > 0:
                    self._win.pressure_time += dt
        self._if_stamp = now


def weighted_median(samples: list[tuple[float, int]]) -> float | None:
    """The median of values given as (value, weight) pairs; None when there are none."""
    if not samples:
        return None
    xs = sorted(samples)
    half = sum(n for _, n in xs) / 2.0
    acc = 0
    for x, n in xs:
        acc += n
        if acc >= half:
            return x
    return xs[-1][0]
