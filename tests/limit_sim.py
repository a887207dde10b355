"""Limits and routing in front of the simulator's engine, in virtual time: fast, deterministic.

``closed_loop_through_proxy`` runs ``clients`` closed-loop clients through a proxy-like gate
(the proxy's FIFO queue, late binding, a routing policy, one limit per backend) into one
``loadtest.sim.scheduler.Scheduler`` per backend. Observations land in real
:class:`proxy.stats.BackendStats` objects on the virtual clock exactly as the proxy's
forwarding would make them (TTFT from sending upstream, ITL per event, tokens, completions, the
in-flight count), plus a scrape of each engine's logged gauges every ``scrape_interval_s``;
windows are cut and fed to the limits by the proxy's own control loop (proxy/control.py), and a
limit that falls below what is in flight recalls requests without a first token, as the proxy
does. ``output_len`` may be a (lo, hi) range so that closed-loop clients do not finish in
lockstep.

Used by tests/test_limits_sim.py and benchmarks/limit_trace.py (the traces in
docs/limits-and-routing.md).
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field
from typing import Any, Literal

from loadtest.sim.profiles import Profile, load_profile
from loadtest.sim.scheduler import Finish, GenRequest, Req, Scheduler
from proxy.control import LimitControl
from proxy.stats import BackendStats


@dataclass
class SimRun:
    limit_trace: list[tuple[float, int, float, float]] = field(default_factory=list)
    """(t, limit after the window, mean in flight, window tokens/s) per closed window
    (of the first backend; ``traces`` has every backend's)."""
    traces: dict[str, list[tuple[float, int, float, float]]] = field(default_factory=dict)
    tokens_at: list[tuple[float, int]] = field(default_factory=list)
    ttfts: list[tuple[float, float]] = field(default_factory=list)  # (t_first, client TTFT)
    e2es: list[tuple[float, float]] = field(default_factory=list)  # (t_done, client E2E)
    completed: int = 0
    sent: int = 0
    recalled: int = 0
    served: dict[str, int] = field(default_factory=dict)
    retractions_at: list[tuple[float, int]] = field(default_factory=list)
    """(t, requests the first backend's engine retracted so far) at each scrape."""

    def throughput(self, t0: float, t1: float) -> float:
        return sum(n for t, n in self.tokens_at if t0 <= t < t1) / (t1 - t0)

    @staticmethod
    def _pct(pairs: list[tuple[float, float]], t0: float, t1: float, q: float) -> float:
        xs = sorted(x for t, x in pairs if t0 <= t < t1)
        if not xs:
            return float("nan")
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    def ttft_pct(self, t0: float, t1: float, q: float) -> float:
        return self._pct(self.ttfts, t0, t1, q)

    def e2e_pct(self, t0: float, t1: float, q: float) -> float:
        return self._pct(self.e2es, t0, t1, q)

    def mean_limit(self, t0: float, t1: float) -> float:
        xs = [lim for t, lim, _, _ in self.limit_trace if t0 <= t < t1]
        return statistics.fmean(xs) if xs else float("nan")

    def first_time_at(self, level: float) -> float | None:
        for t, lim, _, _ in self.limit_trace:
            if lim >= level:
                return t
        return None


class SimBackend:
    """What a policy sees (name, weight, in_flight, limit, stats) plus its engine."""

    def __init__(self, name: str, profile: Profile, limit: Any, clock: list[float], seed: int):
        self.name = name
        self.weight = 1.0
        self.routable = True
        self.in_flight = 0
        self.limit = limit
        self.stats = BackendStats(clock=lambda: clock[0])
        self.profile = profile
        self.sched: Scheduler  # set by the runner (its emit closes over this backend)
        self.seed = seed


def closed_loop_through_proxy(
    profiles: list[Profile | str],
    clients: int,
    limits: list[Any],
    policy: Any = None,
    *,
    duration_s: float,
    input_len: int = 1024,
    output_len: int | tuple[int, int] = 512,
    tick_s: float = 0.25,
    scrape_interval_s: float | None = 1.0,
    seed: int = 0,
    clients_at_s: float = 0.0,
    gauges: Literal["metrics", "loads", "none"] = "metrics",
    word: bool = True,
) -> SimRun:
    """``clients`` closed-loop clients through the proxy's queue, limits and ``policy`` into the
    backends' schedulers, for ``duration_s`` modelled seconds. The proxy scrapes the backends
    once before anything else (the server's word reaches the limits at t = 0); the clients
    arrive together at ``clients_at_s``: at 0 with the word, or later, as a real proxy, which
    scrapes on start, meets them.

    What the proxy hears, as a real deployment decides it. ``gauges``: SGLang's ``/metrics``
    (the values of its last log point, up to 40 decode steps old, and retractions), its load
    report ``/v1/loads`` (what a server started without ``--enable-metrics`` answers: the
    scheduler's current counts, no retractions), or none (an older SGLang without either).
    ``word`` off: a server that does not say its ``max_running_requests``."""
    clock = [0.0]
    backends = []
    for i, (prof, lim) in enumerate(zip(profiles, limits, strict=True)):
        p = load_profile(prof) if isinstance(prof, str) else prof
        backends.append(SimBackend(f"{p.name}-{i}", p, lim, clock, seed + i))
    run = SimRun(traces={b.name: [] for b in backends}, served={b.name: 0 for b in backends})
    rng = random.Random(seed)
    queued: list[float] = []  # the proxy's queue: each waiting client's arrival time, FIFO
    sent: dict[str, tuple[float, float]] = {}  # rid -> (t_arrive at proxy, t_send upstream)
    last_tok: dict[str, float] = {}
    counter = 0

    def dispatch(now: float) -> None:
        hand_out(now)
        note_waiters(now)
        if control.demand(backends, now):  # as proxy/admission does when its queue grows
            hand_out(now)
            note_waiters(now)

    def note_waiters(now: float) -> None:
        for b in backends:  # as proxy/admission does: requests waiting here = pressure
            b.stats.observe_waiters(len(queued), now)

    def hand_out(now: float) -> None:
        nonlocal counter
        while queued:
            free = [b for b in backends if b.routable and b.in_flight < b.limit.limit]
            if not free:
                return
            b = policy.pick(free) if policy is not None and len(free) > 1 else free[0]
            arrive = queued.pop(0)
            counter += 1
            rid = f"r{counter}"
            sent[rid] = (arrive, now)
            b.in_flight += 1
            b.stats.observe_in_flight(b.in_flight, b.limit.limit, now)
            keys[rid] = b.stats.observe_sent(now, recall=make_recall(b, rid))
            run.sent += 1
            n_out = output_len if isinstance(output_len, int) else rng.randint(*output_len)
            b.sched.submit(GenRequest(rid, input_len, n_out, ignore_eos=True), now)

    recalled: set[str] = set()
    keys: dict[str, int] = {}  # rid -> its key in the backend's stats (until answered)
    aborts: list[tuple[SimBackend, str]] = []  # recalled, to abort after the control step

    def make_recall(b: SimBackend, rid: str):
        def recall() -> bool:
            # As the proxy's forwarding does: a request without a first token is taken back
            # (SGLang aborts it) and waits in the proxy's queue again, keeping its arrival time.
            # The abort lands after the control step, as the proxy's cancellation does.
            if rid in last_tok or rid not in sent or rid in recalled:
                return False
            recalled.add(rid)
            aborts.append((b, rid))
            return True

        return recall

    def make_emit(b: SimBackend):
        def emit(req: Req, ids: list[int], finish: Finish | None) -> None:
            now = b.sched._now
            clock[0] = now
            stats = b.stats
            if ids:
                n = len(ids)
                arrive, t_send = sent[req.rid]
                prev = last_tok.get(req.rid)
                if prev is None:
                    stats.observe_answered(now, keys.pop(req.rid, None))
                    stats.observe_ttft(now - t_send)
                    run.ttfts.append((now, now - arrive))
                else:
                    stats.observe_itl((now - prev) / n, n)
                last_tok[req.rid] = now
                stats.observe_tokens(n, now)
                run.tokens_at.append((now, n))
            if finish is not None and req.rid in recalled:
                recalled.discard(req.rid)
                stats.observe_answered(now, keys.pop(req.rid, None))
                arrive, _ = sent.pop(req.rid)
                b.in_flight -= 1
                stats.observe_in_flight(b.in_flight, b.limit.limit, now)
                run.recalled += 1
                queued.insert(0, arrive)  # first in the queue, as Admission's ``front``
                dispatch(now)
                return
            if finish is not None:
                ok = finish.type != "abort"
                if req.rid not in last_tok:
                    stats.observe_answered(now, keys.pop(req.rid, None))  # ended without one
                stats.observe_completion(ok, None if ok else "abort", output_tokens=req.generated)
                arrive, _ = sent.pop(req.rid, (now, now))
                last_tok.pop(req.rid, None)
                b.in_flight -= 1
                stats.observe_in_flight(b.in_flight, b.limit.limit, now)
                run.completed += 1
                run.served[b.name] += 1
                run.e2es.append((now, now - arrive))
                queued.append(now)  # the closed-loop client sends its next request at once
                dispatch(now)

        return emit

    for b in backends:
        b.sched = Scheduler(b.profile, seed=b.seed, emit=make_emit(b), make_ids=False)
        if scrape_interval_s and gauges != "none":
            b.stats.stale_after_s = 3 * scrape_interval_s

    def scrape(t: float) -> None:
        run.retractions_at.append((t, backends[0].sched.counters.retractions_total))
        for b in backends:
            # what the server's /server_info says, as the proxy's scraper reads it
            if word:
                b.stats.scrape.max_running_requests = b.profile.max_running_requests
                b.stats.scrape.pp_size = b.profile.pp_size
            if gauges == "none":
                continue
            metrics = gauges == "metrics"
            lg = b.sched.logged_stats() if metrics else b.sched.live_stats()
            b.stats.observe_scrape(
                ok=True,
                queue_reqs=float(lg.num_queue_reqs),
                running_reqs=float(lg.num_running_reqs),
                token_usage=float(lg.token_usage),
                retractions_total=float(b.sched.counters.retractions_total) if metrics else None,
                now=t,
            )

    control = LimitControl()
    if scrape_interval_s:
        # as the proxy: one scrape before the first request, and the limits told of it
        scrape(0.0)
        control.tick(backends, 0.0)
    arrival: float | None = clients_at_s
    if clients_at_s <= 0.0:
        queued.extend([0.0] * clients)
        dispatch(0.0)
        arrival = None
    next_tick = tick_s
    next_scrape = scrape_interval_s or float("inf")
    while True:
        t, due = min(((b.sched.next_time(), b) for b in backends), key=_key)
        t = min(x for x in (t, next_tick, next_scrape, arrival) if x is not None)
        if t >= duration_s:
            break
        clock[0] = t
        if arrival is not None and arrival <= t:
            queued.extend([t] * clients)
            dispatch(t)
            arrival = None
            continue
        if due is not None and due.sched.next_time() is not None and due.sched.next_time() <= t:
            due.sched.advance(t)
            continue
        if next_scrape <= t:
            scrape(t)
            next_scrape = t + (scrape_interval_s or float("inf"))
        if next_tick <= t:
            started = [b.stats.window_started for b in backends]
            control.tick(backends, t)
            while aborts:
                ab, rid = aborts.pop()
                ab.sched._now = max(ab.sched._now, t)
                if not ab.sched.abort(rid):  # it answered meanwhile: nothing to take back
                    recalled.discard(rid)
            for i, b in enumerate(backends):
                if b.stats.window_started == started[i]:
                    continue  # no window closed
                row = (t, b.limit.limit, b.in_flight, b.stats.tokens_per_s)
                run.traces[b.name].append(row)
                if i == 0:
                    run.limit_trace.append(row)
            dispatch(t)
            next_tick = t + tick_s
    return run


def _key(pair: tuple[float | None, Any]) -> float:
    return float("inf") if pair[0] is None else pair[0]


def closed_loop_through_limit(
    profile: Profile | str, clients: int, limit: Any, **kwargs: Any
) -> SimRun:
    """One backend behind the proxy's queue."""
    return closed_loop_through_proxy([profile], clients, [limit], None, **kwargs)
