"""Per-backend concurrency limits: pure algorithms fed windows of observations.

Following Netflix concurrency-limits, a *limit* (this module) only answers "given what this
window looked like, how many requests may be in flight now?"; the *limiter* that acquires slots
and queues requests is proxy/admission.py, and proxy/control.py cuts the windows and applies
what a limit decides. A limit never awaits and never reads a clock: it is fed
:class:`proxy.stats.Window` values and is tested with numbers alone.

- ``fixed``: a constant.
- ``adaptive`` (default): the backend's capacity, found from direct evidence that the backend
  keeps requests waiting. See docs/limits-and-routing.md for the objective and the rules.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from dataclasses import dataclass
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from proxy.stats import Window


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
    max_limit: int = Field(2048, ge=1, description="ceiling")
    window_s: float = Field(1.0, gt=0, description="length of an observation window")
    max_window_s: float = Field(
        5.0,
        gt=0,
        description="after a change, the window ends once the change's requests had their "
        "prefill, or after this long",
    )
    queue_tolerance: float = Field(
        2.0,
        ge=0,
        description="requests the backend may keep waiting (and queue_share of what it has in "
        "flight, at most the limit) before it counts as full",
    )
    queue_share: float = Field(0.05, ge=0, le=1, description="see queue_tolerance")
    probe_every_s: float = Field(
        30.0,
        gt=0,
        description="at a capacity found, with requests waiting in the proxy, probe above it "
        "this often (the first probe after a cut comes after 1/8 of this, doubling)",
    )
    probe_step: float = Field(0.25, gt=0, le=1, description="relative size of a probe up")
    backoff: float = Field(
        0.85, gt=0, lt=1, description="multiplicative decrease on errors or stale metrics"
    )
    target_itl_s: float | None = Field(
        None,
        gt=0,
        description="latency objective (unset by default): the limit never grows, and steps "
        "down, while the median inter-token latency is above this",
    )


class Limit(Protocol):
    name: str
    settings: LimitSettings

    @property
    def limit(self) -> int: ...

    @property
    def knee(self) -> int | None: ...

    def update(self, window: Window) -> Decision | None: ...

    def demand(self, now: Demand) -> Decision | None: ...

    def reset(self) -> None: ...

    def snapshot(self) -> dict: ...


class Code(enum.StrEnum):
    """What a decision did, and on which evidence."""

    START = "start"  # the initial limit
    GROW = "grow"  # demand above the limit and the backend runs all it gets: double
    PROBE = "probe"  # held at a capacity found, demand above it for a while: try higher
    REOPEN = "reopen"  # a probe found no queue: capacity unknown again, grow
    FULL = "full"  # the backend keeps requests waiting: down to what it runs
    LATENCY = "latency"  # median ITL above the operator's target: step down
    ERRORS = "errors"  # most requests of the window failed: back off
    STALE = "stale"  # scraped metrics stale for a while: back off
    RESTART = "restart"  # the backend restarted: resume at its capacity, or start over
    SERVER = "server"  # no evidence yet: start at what the server says it runs at most
    PREFILL = "prefill"  # after a cut, some still wait: in prefill, not queued; cut less
    UNDO = "undo"  # full again after a cut, running fewer than before it: the cut is undone
    CLEARED = "cleared"  # draining after a cut, none of what it runs waits: the cut misread


@dataclass(frozen=True, slots=True)
class Decision:
    """One change of the limit: a code and the numbers it was decided on (tests assert on
    these; the log and /admin show ``str()``)."""

    code: Code
    before: int
    after: int
    at: float
    in_flight: float | None = None  # the window's mean in flight (ours)
    excess: float | None = None  # requests the backend kept waiting (see AdaptiveLimit)
    pressure: float | None = None
    itl: float | None = None

    def __str__(self) -> str:
        nums = []
        if self.in_flight is not None:
            nums.append(f"in flight {self.in_flight:.1f}")
        if self.excess is not None:
            nums.append(f"kept waiting {self.excess:.1f}")
        if self.pressure is not None:
            nums.append(f"pressure {self.pressure:.2f}")
        if self.itl is not None:
            nums.append(f"ITL {self.itl * 1000:.1f} ms")
        extra = f" ({', '.join(nums)})" if nums else ""
        return f"{self.code.value} {self.before}->{self.after}{extra}"


@dataclass(frozen=True, slots=True)
class Demand:
    """A moment, between windows, at which a backend has its limit in flight and requests for
    it wait in the proxy (the control loop looks at every tick and when a request queues; see
    proxy/control.py for when it does not)."""

    end: float  # when (named as a window's end: a decision is stamped with it)
    in_flight: float
    backlog: int  # this backend's share of the proxy's queue
    #: what the server says it runs at most, and whether another backend could take its
    #: requests, as a window carries them
    max_running: int | None = None
    elsewhere: bool = False
    pressure: float = 1.0  # the whole moment is at the limit with requests waiting


class FixedLimit:
    name = "fixed"

    def __init__(self, limit: int, settings: LimitSettings | None = None) -> None:
        self._limit = max(1, int(limit))
        self.settings = settings or LimitSettings(algorithm="fixed", initial=self._limit)

    @property
    def limit(self) -> int:
        return self._limit

    @property
    def knee(self) -> int | None:
        return None

    def update(self, window: Window) -> Decision | None:
        return None

    def demand(self, now: Demand) -> Decision | None:
        return None

    def reset(self) -> None:
        return None

    def snapshot(self) -> dict:
        return {"algorithm": self.name, "limit": self._limit, "knee": None}


#: judged windows in a row that must show the backend full before the limit comes down: a
#: wave of prefills can keep requests waiting for one window, a full backend keeps them waiting
FULL_WINDOWS = 2
#: judged windows in a row without a queue, at a probed level under demand, before the
#: capacity counts as unknown again and the limit grows as from the start
REOPEN_WINDOWS = 2
#: the first probe after the backend is found full (a cut, or a dip held through) comes after
#: this share of ``probe_every_s``; each probe that finds the backend full again doubles the
#: wait, up to ``probe_every_s``: under demand a limit below capacity loses throughput every
#: second, one above it keeps a few requests waiting for the length of a probe, so a capacity
#: read once (perhaps in a passing wave of prefills) is checked soon, and one confirmed seldom
FIRST_PROBE_SHARE = 0.125
#: share of a window spent at the limit with requests waiting in the proxy that says demand
#: exceeds the limit
PRESSURE = 0.5
#: consecutive windows with stale scraped metrics before (and between) back-offs
STALE_WINDOWS = 3
#: most of the in-flight requests that can count as always in prefill (beyond it the queue
#: estimate would divide by almost nothing)
MAX_PREFILL_SHARE = 0.8
#: share of our requests without a usable first-token signal (non-streamed) above which only
#: SGLang's own queue gauge can say the backend is full
OPAQUE_SHARE = 0.5


@dataclass(slots=True)
class CutCheck:
    """A cut made on our own count alone, waiting to be checked (``AdaptiveLimit._check_cut``):
    what still waits at the lower level is the prefill share, but only over a whole turnover of
    what the backend runs. Requests that arrive together (closed-loop clients with answers of
    one length, a surge) are in prefill together for as long as the backend takes to prefill
    them all, seconds on a deep pipeline; only once each request it runs was replaced has every
    one of them been seen past its prefill, so the fewest waiting over that span is a share
    that one window in a wave of prefills cannot inflate."""

    level: int  # the requests in flight where the cut was made
    waited: float  # the waiting the cut was read from
    before: Phase  # the state the cut interrupted
    share: float = math.inf  # fewest of ours waiting per request in flight since the cut
    completions: int = 0  # requests finished since the cut

    def observe(self, w: Window) -> bool:
        """Note one judged window; True once the backend finished as many as it runs."""
        self.share = min(self.share, w.awaiting_min / max(w.in_flight_at_fewest, 1e-9))
        self.completions += w.completions
        return self.completions >= w.in_flight


class Phase(enum.StrEnum):
    START = "start"  # capacity unknown: the limit doubles while demand fills it
    HOLD = "hold"  # at the capacity found (or at what demand needed): probes now and then
    PROBE = "probe"  # above the capacity found, to see whether it grew


class AdaptiveLimit:
    """The backend's capacity: as many requests in flight as it runs at once without keeping
    any waiting, so that the excess waits in the proxy and binds late to whichever backend
    frees first.

    Why capacity: for a continuous-batching engine the requests in flight are the batch it
    runs, and its token throughput does not fall as the batch grows until it stops admitting
    them (running cap, KV pool, pipeline micro-batches all full); past that point extra requests
    only wait inside it. So holding a backend at its capacity delivers what sending straight to
    it would, on any engine shape, without measuring throughput at all: the limit grows while
    demand fills it and the backend runs everything it gets, and comes down to what the backend
    runs when it keeps requests waiting. The limit does not search for a throughput knee below
    capacity (one noisy window can fake a plateau); the operator may ask for lower latency with
    ``target_itl_s``.

    The evidence that the backend is full ("kept waiting", ``excess``), per window:

    - ours: the fewest of our streamed requests that were still waiting for their first token
      at any moment of the window (``Window.awaiting_min``). Prefill makes a request wait a
      moment; only a queue keeps some waiting all window long.
    - SGLang's: its ``num_queue_reqs`` gauge, our share of it.
    - where both are known, the smaller: our timing has no lag, the gauge has no prefill noise.
      If most of our requests are non-streamed, the gauge alone decides. A full KV pool, and
      requests SGLang retracted (pushed back to its queue after they produced tokens), are not
      evidence by themselves: SGLang adapts its own admission after a retraction, and on the
      generated shapes cutting on them lost throughput against sending straight; even an
      oracle that knows the most in flight without retractions does worse than sending
      straight (benchmarks/kv_thrash.py).

    A backend is full when the excess is above ``max(queue_tolerance, queue_share * level)``
    (the tolerance; ``level``: the window's requests in flight, at most the limit) for
    ``FULL_WINDOWS`` judged windows that are not a wave of prefills draining (``_wave``; on
    our own count alone, a full backend also admits only as it finishes: ``_queue_stood``).
    The capacity is then what it ran in the one of them that
    ran the most (in flight when the fewest waited, less the excess: each window's pair, as
    arrivals may fill it from one window to the next), or the most it ran in a judged window
    of the last ``probe_every_s`` (``_peak``; see ``update`` for which), and the limit that
    plus the tolerance, which the backend keeps ready (``_ready``; only where no other
    backend could take them). A cut that took what the backend ran rather
    than what it kept waiting is undone (``_undo_cut``), and no cut goes below it again.
    Windows right after a change,
    or after demand arrived at once, are not judged (proxy/control.py waits until those
    requests had their prefill), nor
    windows with more in flight than the limit (draining: what the backend shows was sent
    before), except that one showing none of it waiting after a ``full`` cut clears the cut
    (``_cleared``).

    States: ``START`` doubles the limit, or takes all of this backend's share of the proxy's
    queue if that is more, on each judged window where demand filled it (``PRESSURE``) and the
    backend was not full: with the capacity unknown, sending what waits is what sending straight
    to the backend would do, so it cannot deliver less; a queue it makes is cut back with the
    requests recalled. The first window that carries the server's own ``max_running_requests``
    (``/server_info``) starts the limit there, with the requests kept ready if no other
    backend could take them (``SERVER``, ``_told_level``), and growth stops there. ``HOLD``
    keeps the capacity; after demand above it for ``FIRST_PROBE_SHARE`` of ``probe_every_s``,
    doubling with each probe that finds the same capacity up to ``probe_every_s``, a
    ``probe_step`` probe
    (``PROBE``; none above that level): full again -> back to
    what it runs; not full for ``REOPEN_WINDOWS`` -> the capacity grew, ``START`` again. Errors
    and stale metrics back off by ``backoff``; a restart resumes at the capacity found. Never
    below ``floor`` (a pipeline's stage count: the ``pp_size`` hint, or what the server's
    ``/server_info`` says), never above ``max_limit``.
    """

    name = "adaptive"

    def __init__(self, settings: LimitSettings | None = None, *, floor: int = 1) -> None:
        self.settings = settings or LimitSettings()
        self.floor = max(1, floor, self.settings.min_limit)
        self.ceiling = max(self.floor, self.settings.max_limit)
        self.history: deque[Decision] = deque(maxlen=256)
        self.reset()

    # ---- interface -------------------------------------------------------------------

    @property
    def limit(self) -> int:
        return self._limit

    @property
    def knee(self) -> int | None:
        """The capacity found (the limit at which the backend was last seen full)."""
        return self.capacity

    @property
    def phase(self) -> Phase:
        return self._phase

    def reset(self) -> None:
        s = self.settings
        self._limit = self._clamp(s.initial if s.initial is not None else max(self.floor, 8))
        self._phase = Phase.START
        self.capacity: int | None = None
        self._full = 0  # judged windows in a row that showed the backend full
        #: share of our in-flight requests that are always in prefill at this backend, learned
        #: from what still waits after a cut (see ``_check_cut``)
        self.prefill_share = 0.0
        #: a cut decided on our own count alone, until it is checked (``_check_cut``)
        self._cut: CutCheck | None = None
        #: of the judged windows in a row that showed the backend full, (in flight, kept
        #: waiting) of the one that ran the most, the count taken at the moment the fewest
        #: waited (``Window.in_flight_at_fewest``)
        self._fullest: tuple[float, float] | None = None
        #: first tokens and completions over those windows: the set it runs grew if the first
        #: outnumber the second
        self._admitted = self._finished = 0
        self._full_since = 0.0  # when the first of them started
        self._last_excess = math.inf  # in the last of them
        #: (window end, requests the backend ran) of judged windows (see ``update``)
        self._runs: deque[tuple[float, float]] = deque()
        #: (window end, median TTFT) of the same windows
        self._ttfts: deque[tuple[float, float]] = deque()
        self._open = 0  # judged windows in a row at a probe without a queue
        self._demand_since: float | None = None  # demand above a held limit since
        #: demand above a held limit for this long brings a probe (see FIRST_PROBE_SHARE)
        self._probe_wait = self._first_probe_wait()
        self._stale = 0
        self._slow = 0  # judged windows in a row with ITL above target_itl_s
        self._told = False  # the server's max_running_requests was applied (see update)
        #: (requests in flight, requests the backend ran for us, and for all its clients if
        #: SGLang said) where the highest ``full`` cut since the last undo was made from: what
        #: later cuts are judged against (``_undo_cut``)
        self._last_cut: tuple[int, int, float | None] | None = None
        #: no ``full`` cut below this: a cut that made the backend run fewer was undone here
        self._keep = 0
        self.decision = Decision(Code.START, self._limit, self._limit, 0.0)

    def update(self, window: Window) -> Decision | None:
        """Judge one window; returns the decision if the limit changed."""
        w = window
        if w.pp_size is not None and self.floor < min(w.pp_size, self.ceiling):
            # the server says it is a pipeline: fewer requests than stages cannot fill it
            self.floor = min(w.pp_size, self.ceiling)
            if self._limit < self.floor:
                return self._set(self.floor, w, Code.SERVER)
        if w.restarted:
            resumed = self._restart(w)
            if self.capacity is not None or w.max_running is None:
                return resumed
            # started over with nothing known: the server's own word below, as at a cold start
        if w.stale:
            self._stale += 1
            self._demand_since = None
            if self._stale % STALE_WINDOWS == 0:
                return self._back_off(w, Code.STALE)
            return None
        self._stale = 0
        if w.errors >= 2 and w.errors * 2 > w.completions:
            return self._back_off(w, Code.ERRORS)
        if self._phase is Phase.START and not self._told and w.max_running is not None:
            # The first word from the server (its /server_info): with no evidence yet, start at
            # what it says it runs (``_told_level``). Never more than sending straight would
            # put on it, and a cold start needs no windows to get there.
            self._told = True
            told = self._told_level(w)
            if self._limit < told:
                return self._set(self._clamp(told), w, Code.SERVER)
        if w.in_flight > w.limit + self._tolerance():
            # Still draining down to a lower limit (requests that had started cannot be
            # recalled): what the backend shows is what was sent before, not this limit.
            return self._cleared(w)
        if self._cut is not None:
            if not self._cut.observe(w):
                return None  # what still waits is being measured over a turnover: no new cut
            undo = self._check_cut(w)
            if undo is not None:
                return undo
        excess, tol = self.excess(w), self._held_tolerance(w)
        # On our own count alone (no gauge) the backend is ours: what it ran for us, demand
        # filling the limit or not, it runs. Where SGLang's gauge is scraped, other clients
        # (another replica of the proxy) may share it, and what ran for us while they had less
        # is not ours to keep.
        alone = w.queue_reqs is None
        if alone or excess > tol or w.pressure >= PRESSURE:
            self._note_runs(w.end, w.in_flight_at_fewest - excess, w.ttft)
        if excess > tol:
            if alone:
                self._count_streak(w)
            if self._wave(w, excess, tol, alone):
                self._forget_full()
                return None
            self._full += 1
            self._last_excess = excess
            at = w.in_flight_at_fewest
            if self._fullest is None or at - excess > self._fullest[0] - self._fullest[1]:
                self._fullest = (at, excess)
            self._open = 0
            if self._full >= FULL_WINDOWS and (not alone or self._queue_stood(w, tol)):
                return self._full_at(w)
            return None
        self._forget_full()
        if self._over_target(w):
            if self._slow < FULL_WINDOWS:
                return None  # no growth while above the target; a step down once it persists
            self._slow = 0
            self._phase = Phase.HOLD
            self._demand_since = None
            return self._set(self._down(self._limit), w, Code.LATENCY, itl=w.itl_p50)
        if w.pressure < PRESSURE:
            self._demand_since = None
            self._open = 0
            return None
        if self._phase is Phase.START:
            return self._grow(w, Code.GROW)
        if self._phase is Phase.PROBE:
            self._open += 1
            if self._open >= REOPEN_WINDOWS:
                self._phase = Phase.START
                self._keep, self._last_cut = 0, None
                return self._grow(w, Code.REOPEN)
            return None
        if self._demand_since is None:
            self._demand_since = w.start
        if w.end - self._demand_since >= self._probe_wait:
            nxt = self._probe_level()
            if w.max_running is not None:
                # the server runs no more than it said: beyond that a probe could only queue
                nxt = min(nxt, self._told_level(w))
            if nxt > self._limit:
                self._phase = Phase.PROBE
                self._open = 0
                return self._set(nxt, w, Code.PROBE)
        return None

    def demand(self, now: Demand) -> Decision | None:
        """Demand above the limit, seen as it arrives rather than at the end of a window. With
        the capacity unknown (``START``) and the last judged window not showing the backend
        full, the limit takes what waits at once, the step a judged window under pressure
        would take (``_grow``): that is what sending straight to the backend would do, so it
        cannot deliver less, and a cold start does not hold a deep pipeline at its first limit
        for the rest of a window it began idle (the engine's waves keep the phase that the
        first seconds gave them). The windows after judge any queue it makes."""
        if self._phase is not Phase.START or self._full or now.backlog <= 0:
            return None
        if now.in_flight < self._limit:
            return None
        return self._grow(now, Code.GROW)

    def excess(self, w: Window) -> float:
        """Requests of ours the backend kept waiting all through the window (see class doc)."""
        ours = self._queued(w.awaiting_min, w.in_flight_at_fewest)
        if w.queue_reqs is None:
            return ours
        scraped_total = (w.running_reqs or 0.0) + w.queue_reqs
        share = w.in_flight / max(scraped_total, w.in_flight, 1e-9)
        queued = w.queue_reqs * min(1.0, share)
        if w.opaque >= OPAQUE_SHARE * max(w.in_flight, 1e-9):
            return queued
        return min(ours, queued)

    def snapshot(self) -> dict:
        d = self.decision
        return {
            "algorithm": self.name,
            "limit": self._limit,
            "knee": self.capacity,
            "capacity": self.capacity,
            "floor": self.floor,
            "phase": self._phase.value,
            "decision": d.code.value,
            "reason": str(d),
        }

    # ---- transitions ------------------------------------------------------------------

    def _check_cut(self, w: Window) -> Decision | None:
        """A cut made on our own count alone, once the backend turned over what it runs at the
        lower level (:class:`CutCheck`). A queue empties when the limit comes down to what the
        backend runs, but requests in prefill (a dense stream of arrivals with long prompts)
        wait a moment each at any level, in proportion to it; one count cannot tell them apart,
        two levels can. Such a cut goes to what the backend runs with none kept ready, so the
        fewest still waiting since is the share in prefill (or more, if the cut left some
        queue: an overestimate errs towards a higher limit); it is
        discounted from now on, and the cut is redone with it, to what the backend runs plus
        the requests kept ready: at the level cut from, only the waiting beyond that share was
        a queue."""
        cut = self._cut
        assert cut is not None
        level, waited, before = cut.level, cut.waited, cut.before
        self._cut = None
        self.prefill_share = min(MAX_PREFILL_SHARE, cut.share)
        queue = self._queued(waited, level)
        runs = max(1, math.floor(level - queue))
        redo = self._clamp(min(level, self._ready(runs, w.elsewhere)))
        if redo <= self._limit:
            return None
        self._forget_full()
        self.capacity = runs
        # The cut was (partly) a misreading: carry on in the state it interrupted.
        self._phase = before
        self._demand_since = None
        return self._set(redo, w, Code.PREFILL, excess=queue)

    def _cleared(self, w: Window) -> Decision | None:
        """A window still above a ``full`` cut (what had started cannot be recalled, and with
        no other backend to take them none are): the backend shows what it does with what it
        runs now. If it keeps none of that waiting while demand is there, what the cut was
        read from has passed (a surge's prefills look like a queue for a window or two): it
        runs this many without a queue, the limit comes back up to it, and the capacity is
        unknown again (``START``)."""
        if self.decision.code is not Code.FULL or w.pressure < PRESSURE:
            return None
        level = math.floor(w.in_flight)
        excess = self.excess(w)
        if excess > self._tolerance_at(level):
            return None
        self._phase = Phase.START
        self.capacity = None
        self._keep, self._last_cut, self._cut = 0, None, None
        self._forget_full()
        return self._set(self._clamp(level), w, Code.CLEARED, excess=excess)

    def _full_at(self, w: Window) -> Decision | None:
        assert self._fullest is not None, "only after windows that showed the backend full"
        at, excess = self._fullest
        ran = max(1, math.floor(at - excess))
        runs = max(ran, math.floor(self._peak()))
        alone = w.queue_reqs is None  # judged on our own count: prefill may be in it
        self._forget_full()
        if self._phase is Phase.PROBE:  # the probe confirmed the capacity: probe less often
            self._probe_wait = min(self.settings.probe_every_s, 2 * self._probe_wait)
        else:  # a capacity read now: check it soon
            self._probe_wait = self._first_probe_wait()
        self._phase = Phase.HOLD
        self._demand_since = None
        undo = self._undo_cut(w, ran, excess)
        if undo is not None:
            return undo
        # on our own count, a cut leaves none ready, so that the turnover after it shows
        # prefill alone (``_check_cut`` then redoes it, with the requests kept ready)
        target = max(runs if alone else self._ready(runs, w.elsewhere), self._keep)
        self.capacity = runs
        if target >= self._limit:
            return None  # it ran this many lately: a passing dip in its room, held through
        if alone:  # the waiting that the cut's excess was read from (``_queued`` inverted)
            p = self.prefill_share
            # the level is what was in flight there: a limit that demand did not fill says
            # nothing of what the backend runs
            level = max(1, math.floor(at))
            self._cut = CutCheck(level, excess * (1.0 - p) + p * at, self._phase)
        if self._last_cut is None or w.in_flight >= self._last_cut[0]:
            self._last_cut = (math.ceil(w.in_flight), ran, w.running_reqs)
        return self._set(self._clamp(target), w, Code.FULL, excess=excess)

    def _undo_cut(self, w: Window, ran: int, excess: float) -> Decision | None:
        """The backend is full again after a cut: did the cut take away only requests it kept
        waiting? A cut of a queue leaves what the backend runs as it was. If instead most of
        the cut came out of what it runs (by more than the tolerance), while as many as before
        still wait, what waits there grows with what it is sent (an engine that admits in
        bursts as room frees, a pipeline whose prefill is long): not excess, but the queue that
        keeps it fed. Two levels tell the two apart where one window cannot. A cut of ``d``
        requests can take at most ``d`` from what the backend runs: a larger loss is its room
        shrinking (a KV pool thrashing, longer requests), not the cut, and is cut to as usual.
        Such a cut is undone, and no cut goes below that level again (until a restart or a
        reopen): there the backend runs what sending straight would make it run. Where SGLang
        says what it runs for all its clients, the loss must show there too: room the cut left
        that another proxy's requests took is not lost to the backend (two proxies that each
        undid their cut for it overfilled it for good)."""
        if self._last_cut is None:
            return None
        level, ran_there, total_there = self._last_cut
        cut, lost, tol = level - self._limit, ran_there - ran, self._tolerance()
        if total_there is not None and w.running_reqs is not None:
            lost = min(lost, total_there - w.running_reqs)
        if lost > cut + tol:
            self._last_cut = None  # the room shrank: later cuts are judged from this one
            return None
        if cut <= 0 or lost <= max(tol, cut / 2):
            return None  # the cut took mostly requests the backend kept waiting
        self._keep, self._last_cut = level, None
        self.capacity = ran_there
        return self._set(self._clamp(level), w, Code.UNDO, excess=excess)

    def _wave(self, w: Window, excess: float, tol: float, alone: bool) -> bool:
        """Is what waits in this window a wave of prefills draining (a cold start, a surge, a
        big raise) rather than a queue? SGLang's gauge counts its own queue: one that fell by
        more than the tolerance since the last window empties by itself. On our own count,
        prefill and queue look alike, but a full backend admits only as it finishes: one
        that admitted (first tokens) more than it finished since these windows began had
        room; and one that runs none of ours yet shows nothing of what it runs."""
        if not alone:
            return bool(self._full) and excess < self._last_excess - tol
        return w.in_flight_at_fewest - excess < 1 or self._admitted > self._finished + tol

    def _count_streak(self, w: Window) -> None:
        """Add a window that showed requests waiting to the streak's first tokens and
        completions (read by ``_wave`` and ``_queue_stood``; ``_forget_full`` resets them)."""
        if not self._full:
            self._full_since = w.start
        self._admitted += w.ttft_count
        self._finished += w.completions

    def _queue_stood(self, w: Window, tol: float) -> bool:
        """Over the windows that showed requests waiting, did the backend admit only as it
        finished? A full backend's queue moves only when a request ends, so it admitted
        (first tokens) no more than it finished (once it finished some, within the tolerance
        ``_wave`` reads them with: a backend that filled its last seats as the streak began
        admitted those before anything ended); and either it finished some, or the queue did
        not move for longer than the requests it admitted lately took to their first token
        (``_ttfts``; a cold start's first answers may take longer than that to finish, and a
        prefill-bound backend admits one request per prefill step)."""
        if self._admitted > self._finished + (tol if self._finished else 0.0):
            return False
        if self._finished > 0:
            return True
        lately = max((t for _, t in self._ttfts), default=0.0)
        return w.end - self._full_since > lately

    def _forget_full(self) -> None:
        self._full, self._fullest = 0, None
        self._admitted = self._finished = 0

    def _note_runs(self, at: float, runs: float, ttft: float | None) -> None:
        horizon = at - self.settings.probe_every_s
        self._runs.append((at, runs))
        while self._runs and self._runs[0][0] < horizon:
            self._runs.popleft()
        if ttft is not None:
            self._ttfts.append((at, ttft))
        while self._ttfts and self._ttfts[0][0] < horizon:
            self._ttfts.popleft()

    def _peak(self) -> float:
        """The most the backend ran in a judged window of the last ``probe_every_s``, whether
        demand filled its limit or not: it ran that many at once, so it runs at least that. Its
        capacity changes slowly (deployment, workload mix), its room from moment to moment
        (an SGLang server admits less for a while after it retracted requests, a prefill wave
        holds the pool): a cut follows the capacity, and a dip waits in the backend's queue
        as it would with no limit at all."""
        return max((r for _, r in self._runs), default=0.0)

    def _grow(self, w: Window | Demand, code: Code) -> Decision | None:
        level = self._limit
        nxt = max(2 * level, level + w.backlog)
        if w.max_running is not None:
            # The server runs at most this many: more than the few kept ready would only wait
            # inside it.
            nxt = min(nxt, max(level, self._told_level(w)))
        return self._set(self._clamp(nxt), w, code)

    def _restart(self, w: Window) -> Decision | None:
        known = self.capacity
        self.reset()
        if known is not None and known > self._limit:
            # Most likely the same deployment: hold at its capacity; if it came back smaller,
            # it keeps requests waiting and the limit comes down.
            self.capacity = self._clamp(known)
            self._phase = Phase.HOLD
            return self._set(self._clamp(self._ready(self.capacity, w.elsewhere)), w, Code.RESTART)
        self.decision = Decision(Code.RESTART, self._limit, self._limit, w.end)
        self.history.append(self.decision)
        return self.decision

    def _back_off(self, w: Window, code: Code) -> Decision | None:
        nxt = self._clamp(min(self._limit - 1, math.floor(self._limit * self.settings.backoff)))
        self._phase = Phase.HOLD
        self._demand_since = None
        self._forget_full()
        return self._set(nxt, w, code)

    def _over_target(self, w: Window) -> bool:
        """Is the window's median ITL above the operator's target (counted in ``_slow``)?"""
        target = self.settings.target_itl_s
        if target is None or w.itl_p50 is None or w.itl_p50 <= target:
            self._slow = 0
            return False
        self._slow += 1
        return True

    # ---- helpers -----------------------------------------------------------------------

    def _queued(self, waiting: float, in_flight: float) -> float:
        """Of ``waiting`` requests (at their fewest in a window, of ``in_flight``), those the
        backend queued: the rest are the prefill share of the ones it runs (waiting = queued +
        share x (in_flight - queued))."""
        p = self.prefill_share
        return max(0.0, (waiting - p * in_flight) / (1.0 - p))

    def _tolerance_at(self, level: int) -> float:
        s = self.settings
        return max(s.queue_tolerance, s.queue_share * level)

    def _tolerance(self) -> float:
        return self._tolerance_at(self._limit)

    def _held_tolerance(self, w: Window) -> float:
        """The tolerance at what the window held: a share of the requests in flight, not of a
        limit that demand did not fill (a backend running 64 of a limit of 128 that keeps 6
        waiting is full, though 6 is within 5% of 128)."""
        return self._tolerance_at(min(self._limit, max(1, math.ceil(w.in_flight))))

    def _ready(self, runs: int, elsewhere: bool) -> int:
        """The limit for a backend that runs ``runs``: that plus the tolerance, kept ready in
        its queue, when no other backend could take them. Its room is not constant (a
        token-sized KV pool frees room for several short requests when one long one ends; a
        prefill budget takes what waits at each step), and a request already there fills it at
        once; a cut to exactly ``runs`` would starve it at every peak. Where another backend
        could take them (``elsewhere``), exactly ``runs``: a request kept ready can no longer
        be bound late, and waits for this backend's next completion while another may free a
        slot first (as at a server's own cap, ``_told_level``); the proxy's queue refills a
        freed slot within a round trip."""
        if elsewhere:
            return runs
        return math.floor(runs + self._tolerance_at(runs))

    def _told_level(self, w: Window | Demand) -> int:
        """The limit for a server that says it runs ``w.max_running``. Its cap is a count that
        does not move (unlike a capacity read from what it ran, whose room moves around it), so
        the one reason to send more is the step: at exactly the cap, a slot that a step frees
        stays empty until the proxy's next request has crossed the network, and the step that
        starts meanwhile runs without it (about a step per request, a few % of a short
        answer). A request kept ready there cannot be bound late, though: where another
        backend could take it, it may wait behind a slow backend while the other frees first,
        which costs more in TTFT than the step gains. So the few are kept ready only where no
        other backend could take them."""
        assert w.max_running is not None, "only for a window that carries the server's word"
        return self._ready(w.max_running, w.elsewhere)

    def _first_probe_wait(self) -> float:
        return FIRST_PROBE_SHARE * self.settings.probe_every_s

    def _probe_level(self) -> int:
        """``probe_step`` above the limit, and at least enough that, if the capacity did not
        grow, the queue the probe makes is above the tolerance (so it cannot pass unseen)."""
        level = self._limit
        step = max(round(level * self.settings.probe_step), math.ceil(self._tolerance()) + 1)
        return self._clamp(level + step)

    def _down(self, level: int) -> int:
        return self._clamp(level - max(1, round(level * self.settings.probe_step / 2)))

    def _clamp(self, n: int) -> int:
        return max(self.floor, min(self.ceiling, int(n)))

    def _set(
        self,
        new: int,
        w: Window | Demand,
        code: Code,
        *,
        excess: float | None = None,
        itl: float | None = None,
    ) -> Decision | None:
        if new == self._limit:
            return None
        d = Decision(code, self._limit, new, w.end, w.in_flight, excess, w.pressure, itl)
        self._limit = new
        self.decision = d
        self.history.append(d)
        return d


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
        initial = settings.initial if settings.initial is not None else max(floor, 32)
        return FixedLimit(initial, settings)
    return AdaptiveLimit(settings, floor=floor)
