"""Closed-loop sweeps of the engine model in virtual time: synchronous, fast, deterministic.

`closed_loop(profile, concurrency, ...)` keeps `concurrency` requests in the engine at all
times (a finished request is replaced at the same instant, as a closed-loop client with zero
think time does) and measures, in modelled seconds, what the load generator would measure.
Used by tests/test_sim_calibration.py, docs/simulator-engine.md, and

    python -m loadtest.sim.calibrate [tp8 pp8 ep8] [--concurrency 1,4,32]
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
import sys
from dataclasses import asdict, dataclass

from loadtest.sim.profiles import Profile, load_profile
from loadtest.sim.scheduler import Finish, GenRequest, Req, Scheduler

# The workload the calibration targets refer to (output tok/s; see docs/simulator-engine.md).
DEFAULT_INPUT_LEN = 1024
DEFAULT_OUTPUT_LEN = 512

# The measured deployment (DESIGN.md): (profile, concurrency) -> (metric, value)
TARGETS: dict[tuple[str, int], tuple[str, float]] = {
    ("tp8", 1): ("per_request_tok_s", 26.6),
    ("tp8", 32): ("aggregate_tok_s", 578.0),
    ("pp8", 1): ("per_request_tok_s", 24.7),
    ("pp8", 4): ("aggregate_tok_s", 68.0),
}


@dataclass(slots=True)
class LoopResult:
    profile: str
    concurrency: int
    input_len: int
    output_len: int
    duration_s: float  # measurement window (after warmup)
    aggregate_tok_s: float  # output tokens whose emission falls in the window / window
    per_request_tok_s: float  # decode rate 1/TPOT of a request (median over requests)
    e2e_tok_s: float  # output tokens / E2E of a request (median)
    ttft_p50: float
    tpot_p50: float
    e2e_p50: float
    completed: int
    mean_running: float  # time-average requests in running batches
    mean_queued: float
    retractions: int

    def to_dict(self) -> dict:
        return asdict(self)

    def __getitem__(self, key: str) -> object:  # r["aggregate_tok_s"] works too
        return getattr(self, key)


def closed_loop(
    profile: Profile | str,
    concurrency: int,
    input_len: int = DEFAULT_INPUT_LEN,
    output_len: int = DEFAULT_OUTPUT_LEN,
    duration_s: float | None = None,
    *,
    warmup_s: float | None = None,
    ignore_eos: bool = True,
    seed: int = 0,
    think_s: float = 0.0,
    jitter_s: float = 0.0,
) -> LoopResult:
    """Run `concurrency` closed-loop clients against a fresh engine in virtual time.

    duration_s defaults to long enough for ~4 generations of each client after a warmup of
    about one generation, so the window sees requests at every stage of their life.
    A client sends its next request `think_s` + uniform(0, `jitter_s`) after the previous
    one finished (and its first one after uniform(0, jitter_s)); 0/0 = the same instant.
    """
    p = load_profile(profile) if isinstance(profile, str) else profile
    done: list[Req] = []
    tokens_at: list[tuple[float, int]] = []
    counter = 0
    sched: Scheduler

    def emit(req: Req, ids: list[int], finish: Finish | None) -> None:
        if ids:
            tokens_at.append((sched._now, len(ids)))
        if finish is not None:
            done.append(req)
            schedule_client(sched._now + think_s)

    def schedule_client(t: float) -> None:
        if think_s == 0.0 and jitter_s == 0.0:
            new_client()
        else:
            heapq.heappush(arrivals, t + rng.uniform(0.0, jitter_s))

    def new_client() -> None:
        nonlocal counter
        counter += 1
        g = GenRequest(f"c{counter}", input_len, output_len, ignore_eos=ignore_eos)
        sched.submit(g, sched._now)

    rng = random.Random(seed)
    arrivals: list[float] = []
    sched = Scheduler(p, seed=seed, emit=emit, make_ids=False)
    for _ in range(concurrency):
        if jitter_s == 0.0:
            new_client()
        else:
            heapq.heappush(arrivals, rng.uniform(0.0, jitter_s))
    running_area = queued_area = 0.0
    t_prev = 0.0
    t_start = t_end = None
    while True:
        t = sched.next_time()
        if arrivals and (t is None or arrivals[0] <= t):
            t = heapq.heappop(arrivals)
            sched.advance(t)
            new_client()
        if t is None:
            break
        if t_start is not None and t_end is not None:  # time-average over the window only
            lo, hi = max(t_prev, t_start), min(t, t_end)
            if hi > lo:
                running_area += (hi - lo) * sched.num_running
                queued_area += (hi - lo) * len(sched.waiting)
        t_prev = t
        if t_end is not None and t >= t_end:
            break
        sched.advance(t)
        if t_start is None and done:
            # one generation at this concurrency, from the first request's own timing
            first = done[0]
            est_gen = (first.t_last or t) - first.arrival
            t_start = est_gen * 1.2 if warmup_s is None else warmup_s
            t_end = t_start + (duration_s if duration_s is not None else 4 * est_gen)
    assert t_start is not None and t_end is not None, "no request finished"
    window = t_end - t_start
    agg = sum(n for t, n in tokens_at if t_start <= t < t_end) / window
    in_window = [r for r in done if r.t_last is not None and t_start <= r.t_last < t_end]
    if not in_window:
        in_window = done
    tpots = [
        (r.t_last - r.t_first) / (r.generated - 1)
        for r in in_window
        if r.generated >= 2 and r.t_last is not None and r.t_first is not None
    ]
    ttfts = [r.t_first - r.arrival for r in in_window if r.t_first is not None]
    e2es = [r.t_last - r.arrival for r in in_window if r.t_last is not None]
    tpot = statistics.median(tpots) if tpots else float("nan")
    e2e_rates = [r.generated / (r.t_last - r.arrival) for r in in_window if r.t_last is not None]
    span = window
    return LoopResult(
        profile=p.name,
        concurrency=concurrency,
        input_len=input_len,
        output_len=output_len,
        duration_s=window,
        aggregate_tok_s=agg,
        per_request_tok_s=1.0 / tpot if tpot > 0 else float("nan"),
        e2e_tok_s=statistics.median(e2e_rates) if e2e_rates else float("nan"),
        ttft_p50=statistics.median(ttfts) if ttfts else float("nan"),
        tpot_p50=tpot,
        e2e_p50=statistics.median(e2es) if e2es else float("nan"),
        completed=len(in_window),
        mean_running=running_area / span,
        mean_queued=queued_area / span,
        retractions=sched.counters.retractions_total,
    )


def sweep(profile: Profile | str, concurrencies: list[int], **kwargs: object) -> list[LoopResult]:
    return [closed_loop(profile, c, **kwargs) for c in concurrencies]  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.sim.calibrate", description=__doc__)
    ap.add_argument("profiles", nargs="*", default=["tp8", "pp8", "ep8"])
    ap.add_argument("--concurrency", default="1,2,4,8,16,32,48,64,96,128")
    ap.add_argument("--input-len", type=int, default=DEFAULT_INPUT_LEN)
    ap.add_argument("--output-len", type=int, default=DEFAULT_OUTPUT_LEN)
    args = ap.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",") if c]
    print(
        f"{'profile':8} {'C':>4} {'agg tok/s':>10} {'1/TPOT':>8} {'e2e tok/s':>9} "
        f"{'TTFT p50':>9} {'TPOT ms':>8} {'running':>8} {'queued':>7} {'retract':>7}  target"
    )
    for name in args.profiles:
        for r in sweep(name, levels, input_len=args.input_len, output_len=args.output_len):
            tgt = TARGETS.get((r.profile, r.concurrency))
            note = ""
            if tgt is not None:
                got = getattr(r, tgt[0])
                note = f"{tgt[0]}={tgt[1]:g} ({(got / tgt[1] - 1) * 100:+.1f}%)"
            print(
                f"{r.profile:8} {r.concurrency:>4} {r.aggregate_tok_s:>10.1f} "
                f"{r.per_request_tok_s:>8.2f} {r.e2e_tok_s:>9.2f} {r.ttft_p50:>9.3f} "
                f"{r.tpot_p50 * 1000:>8.2f} {r.mean_running:>8.1f} {r.mean_queued:>7.1f} "
                f"{r.retractions:>7}  {note}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
