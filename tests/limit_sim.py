"""A limit in front of the simulator's engine, in virtual time: fast, deterministic.

``closed_loop_through_limit`` runs ``clients`` closed-loop clients through a proxy-like gate
(the proxy's queue + one backend with ``limit``) into ``loadtest.sim.scheduler.Scheduler``.
Observations land in a real :class:`proxy.stats.BackendStats` on the virtual clock exactly as
the proxy's forwarding would make them (TTFT from sending upstream, ITL per event, tokens,
completions, the in-flight count) plus a scrape of the engine's logged gauges every
``scrape_interval_s``; ``output_len`` may be a (lo, hi) range so that closed-loop clients do not
finish in lockstep; windows are closed by the same rule as proxy/admission.py. Used by
tests/test_limits_sim.py and benchmarks/limit_trace.py (the trace in docs/limits-and-routing.md).
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field
from typing import Any

from loadtest.sim.profiles import Profile, load_profile
from loadtest.sim.scheduler import Finish, GenRequest, Req, Scheduler
from proxy.stats import BackendStats


@dataclass
class SimRun:
    limit_trace: list[tuple[float, int, float, float]] = field(default_factory=list)
    """(t, limit after the window, mean in flight, window tokens/s) per closed window."""
    tokens_at: list[tuple[float, int]] = field(default_factory=list)
    ttfts: list[tuple[float, float]] = field(default_factory=list)  # (t_first, client TTFT)
    completed: int = 0

    def throughput(self, t0: float, t1: float) -> float:
        return sum(n for t, n in self.tokens_at if t0 <= t < t1) / (t1 - t0)

    def ttft_pct(self, t0: float, t1: float, q: float) -> float:
        xs = sorted(x for t, x in self.ttfts if t0 <= t < t1)
        if not xs:
            return float("nan")
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    def mean_limit(self, t0: float, t1: float) -> float:
        xs = [lim for t, lim, _, _ in self.limit_trace if t0 <= t < t1]
        return statistics.fmean(xs) if xs else float("nan")

    def first_time_at(self, level: float) -> float | None:
        for t, lim, _, _ in self.limit_trace:
            if lim >= level:
                return t
        return None


def closed_loop_through_limit(
    profile: Profile | str,
    clients: int,
    limit: Any,
    *,
    duration_s: float,
    input_len: int = 1024,
    output_len: int | tuple[int, int] = 512,
    tick_s: float = 0.25,
    window_s: float | None = None,
    window_tokens: int | None = None,
    max_window_s: float | None = None,
    scrape_interval_s: float | None = 1.0,
    seed: int = 0,
) -> SimRun:
    p = load_profile(profile) if isinstance(profile, str) else profile
    s = getattr(limit, "s", None)
    window_s = window_s if window_s is not None else getattr(s, "window_s", 1.0)
    window_tokens = window_tokens if window_tokens is not None else getattr(s, "window_tokens", 0)
    max_window_s = max_window_s if max_window_s is not None else getattr(s, "max_window_s", 5.0)
    clock = [0.0]
    stats = BackendStats(clock=lambda: clock[0])
    if scrape_interval_s:
        stats.stale_after_s = 3 * scrape_interval_s
    run = SimRun()
    rng = random.Random(seed)
    queued: list[float] = []  # proxy queue: each client's arrival time, FIFO
    sent: dict[str, tuple[float, float]] = {}  # rid -> (t_arrive at proxy, t_send upstream)
    last_tok: dict[str, float] = {}
    in_flight = 0
    counter = 0
    sched: Scheduler

    def dispatch(now: float) -> None:
        nonlocal in_flight, counter
        while queued and in_flight < limit.limit:
            arrive = queued.pop(0)
            counter += 1
            rid = f"r{counter}"
            sent[rid] = (arrive, now)
            in_flight += 1
            stats.observe_in_flight(in_flight, limit.limit, now)
            n_out = output_len if isinstance(output_len, int) else rng.randint(*output_len)
            sched.submit(GenRequest(rid, input_len, n_out, ignore_eos=True), now)

    def emit(req: Req, ids: list[int], finish: Finish | None) -> None:
        nonlocal in_flight
        now = sched._now
        clock[0] = now
        if ids:
            n = len(ids)
            arrive, t_send = sent[req.rid]
            prev = last_tok.get(req.rid)
            if prev is None:
                stats.observe_ttft(now - t_send)
                run.ttfts.append((now, now - arrive))
            else:
                stats.observe_itl((now - prev) / n, n)
            last_tok[req.rid] = now
            stats.observe_tokens(n, now)
            run.tokens_at.append((now, n))
        if finish is not None:
            ok = finish.type != "abort"
            stats.observe_completion(ok, None if ok else "abort", output_tokens=req.generated)
            sent.pop(req.rid, None)
            last_tok.pop(req.rid, None)
            in_flight -= 1
            stats.observe_in_flight(in_flight, limit.limit, now)
            run.completed += 1
            queued.append(now)  # the closed-loop client sends its next request at once
            dispatch(now)

    sched = Scheduler(p, seed=seed, emit=emit, make_ids=False)
    queued.extend([0.0] * clients)
    dispatch(0.0)
    next_tick = tick_s
    next_scrape = scrape_interval_s or float("inf")
    while True:
        t_eng = sched.next_time()
        t = min(x for x in (t_eng, next_tick, next_scrape) if x is not None)
        if t >= duration_s:
            break
        clock[0] = t
        if t_eng is not None and t_eng <= t:
            sched.advance(t)
            continue
        if next_scrape <= t:
            lg = sched.logged_stats()
            stats.observe_scrape(
                ok=True,
                queue_reqs=float(lg.num_queue_reqs),
                running_reqs=float(lg.num_running_reqs),
                token_usage=float(lg.token_usage),
                now=t,
            )
            next_scrape = t + (scrape_interval_s or float("inf"))
        if next_tick <= t:
            age = t - stats.window_started
            if age >= window_s and (stats.window_tokens() >= window_tokens or age >= max_window_s):
                w = stats.take_window(t)
                limit.update(w)
                stats.observe_in_flight(in_flight, limit.limit, t)
                run.limit_trace.append((t, limit.limit, w.in_flight, w.tokens_per_s))
                dispatch(t)
            next_tick = t + tick_s
    return run
