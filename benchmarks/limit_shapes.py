"""Does the adaptive limit generalise? Adaptive vs the best fixed limit on generated backend shapes.

    .venv/bin/python benchmarks/limit_shapes.py --split tune      # 60 shapes, ~550 CPU-s
    .venv/bin/python benchmarks/limit_shapes.py --split accept    # 200 other shapes: the verdict
    .venv/bin/python benchmarks/limit_shapes.py --split accept --seed-base 2000 \
        --out benchmarks/results/limit_shapes-accept2   # 200 fresh ones, once the first were seen
    .venv/bin/python benchmarks/limit_shapes.py --split tune --shapes 5 --no-save   # a smoke run
    .venv/bin/python benchmarks/limit_shapes.py --trace 8251:14 --evidence none  # one case's
                                                                   # limit decisions, to read

An acceptance set whose failures have been read while changing the algorithm is spent: judge
the change on accept seeds nobody has looked at (``--seed-base``; the split holds seeds up to
10^9), and say which set a result comes from.

The adaptive limit (proxy/limits.py) must, with more demand than a backend can run, never
deliver less throughput than sending straight to it, at the backend's capacity. It was tuned on
three profiles; this judges it on shapes it was not tuned on: ``loadtest.sim.shapes`` draws
random but plausible engines and workloads (pipeline stages 1-16, step costs from fixed to
per-request, running caps 8-1024, KV pools binding before or after the cap, prefill-heavy and
-light, short and long answers, step-time noise), seeded, in two disjoint splits: tune on
``--split tune``, accept on ``--split accept``.

For every shape and every client count in ``CLIENT_FACTORS`` x its estimated capacity (the
running cap, the KV pool's bound or the prefill budget's, whichever binds first;
``loadtest.sim.shapes.estimate``),
closed-loop clients go through the proxy's queue and one limit into the simulator's scheduler
in virtual time (tests/limit_sim.py, no sockets):

- fixed limits on a geometric grid around the capacity (``GRID_FACTORS``, plus the pp stage
  count, plus ``clients`` itself: no limit, i.e. sending straight to the backend; limits above
  ``clients`` are the same run), extended downwards by ``EXTEND`` while its lowest limit is
  the best, then the geometric midpoints either side of the best: the best fixed limit is the
  one with the most output tokens/s in the measurement window (the smallest of equals);
- the adaptive limit, as ``adaptive_limit(profile)`` builds it.

Durations follow the shape's estimated time for one request at capacity, ``r`` (prefill +
answer; ``Durations``): the measurement window lasts ``max(measure_min_s, measure_requests *
r, measure_completions * r / running)`` (``running`` = clients or capacity, whichever is
smaller), so at least ~``measure_completions`` requests and several request lifetimes complete
in it. It starts after ``max(adaptive_warmup_min_s, adaptive_warmup_requests * r)`` for the
adaptive limit (time to climb from its floor: it needs seconds of windows per level whatever
the shape), and after ``max(fixed_warmup_min_s, fixed_warmup_requests * r)`` for a fixed limit,
which has nothing to learn: only the start-up wave of prefills must pass. The sweep picks the
best fixed limit in its early window, on the shape's own seed. The case is then judged on
``EVAL_SEEDS`` other workload seeds (answer lengths, step noise; ``--eval-seeds``): on each,
the adaptive limit, the selected fixed limit and the direct run, measured in the adaptive run's
window of modelled time (an engine's throughput and TTFT drift over minutes: pp micro-batch
regimes, KV pressure); the ratios compare their means. Judging the selected limit on the seed
that selected it would compare the adaptive limit with the luckiest of ~10 noisy runs (one
seed moves a pp or KV-bound engine's throughput by ~10% between neighbouring limits).

Per case (means over the evaluation seeds): throughput ratio adaptive / best fixed, TTFT p99
ratio (clients' TTFT: includes the wait in the proxy's queue), adaptive / direct (limit =
clients), the adaptive limit at the end and when it first reached ``REACHED`` x the best fixed
limit, and the *window noise*: how much the direct run's throughput changed in the window after
its sweep window (on pp and KV-bound shapes a few % even over 4 request lifetimes; a ratio that
misses the bar by less is within what one window says). Printed and written (markdown + json,
``--out``): the distribution of the ratios, how many shapes pass the bar on every client
count, the worst ``WORST`` cases (smallest margin to the bar), and a verdict line (the bar:
``MIN_THROUGHPUT`` on every case and ``MIN_MEDIAN_THROUGHPUT`` on the median, ``MAX_TTFT_P99``
on every case).
Exit status 0 whatever the verdict (it is a measurement).

Cost: simulated tokens and passes, not modelled seconds, take the time. ``Durations`` and the
generator's affordability bounds (``loadtest.sim.shapes.MAX_TOKENS_PER_S``, ...) are set so
that the accept split (~3.3x the tune split's work) takes about 34 minutes on 2 idle cores
judged on the default two seeds (seeds 4000-4199: 2019 s wall, 4035 CPU-s; ~15 minutes when
each case was judged on its own seed); long answers at high capacity cost most (the window is
counted in request lifetimes).
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from harness import RESULTS, commit, load_cpu, positive_int, write_results
from limit_sim import SimRun, closed_loop_through_limit

from loadtest.sim.profiles import Profile
from loadtest.sim.shapes import SPLITS, Shape, generate_shape, split_seeds
from loadtest.sim.tokens import stable_seed
from proxy.limits import AdaptiveLimit, Decision, Limit, LimitSettings, make_limit

CLIENT_FACTORS = (0.5, 1.0, 2.0)  # x capacity
GRID_FACTORS = (0.5, 0.7, 1.0, 1.4, 2.0)  # fixed limits, x capacity (extended below if best)
EXTEND = 1 / math.sqrt(2)  # ...by this factor while the lowest limit is still the best

# the acceptance bar
MIN_THROUGHPUT = 0.95  # adaptive / best fixed, every case
MIN_MEDIAN_THROUGHPUT = 0.98  # ...and on the median case
MAX_TTFT_P99 = 1.2  # adaptive / best fixed's, every case

#: workload seeds each case is judged on (apart from the one the best fixed limit is selected on)
EVAL_SEEDS = 2
#: what the proxy hears from the backend (``--evidence``), as deployments decide: SGLang's
#: gauges need ``--enable-metrics`` (off by default), and a server that is not SGLang may not
#: say its ``max_running_requests`` either. Only the adaptive runs change: a fixed limit hears
#: nothing.
EVIDENCE = {
    "full": {"gauges": "metrics", "word": True},
    "loads": {"gauges": "loads", "word": True},
    "word": {"gauges": "none", "word": True},
    "none": {"gauges": "none", "word": False},
}
#: each as the results say it
EVIDENCE_TEXT = {
    "full": "SGLang's gauges and `/server_info`",
    "loads": "SGLang's load report `/v1/loads` and `/server_info` (SGLang without "
    "`--enable-metrics`)",
    "word": "`/server_info` but no gauges (SGLang without `--enable-metrics` or `/v1/loads`)",
    "none": "neither gauges nor `/server_info`: only its own requests",
}
REACHED = 0.9  # report when the adaptive limit first reached this x the best fixed limit
WORST = 15  # cases in the table of the worst


def adaptive_limit(profile: Profile) -> Limit:
    """The adaptive limit under test, built as the proxy builds it for this backend.

    The one place that decides what the algorithm is told about a backend (its parallelism
    hint); change it here and every case uses the change.
    """
    return make_limit(LimitSettings(), parallelism=profile.parallelism, pp_size=profile.pp_size)


def fixed_limit(n: int) -> Limit:
    return make_limit(LimitSettings(algorithm="fixed", initial=n))


@dataclass(frozen=True, slots=True)
class Durations:
    """How long to run, in request lifetimes ``r`` of the shape (see the module docstring)."""

    measure_min_s: float = 20.0
    measure_requests: float = 4.0
    measure_completions: float = 120.0
    adaptive_warmup_min_s: float = 120.0
    adaptive_warmup_requests: float = 2.0
    fixed_warmup_min_s: float = 5.0
    fixed_warmup_requests: float = 2.0


@dataclass(frozen=True, slots=True)
class Plan:
    """One case's timing: warmups and the measurement window's length, in modelled seconds."""

    fixed_warmup_s: float
    adaptive_warmup_s: float
    measure_s: float


def plan(shape: Shape, clients: int, d: Durations) -> Plan:
    return timing(shape.est.request_s, max(1, min(clients, shape.est.capacity)), d)


def timing(request_s: float, running: int, d: Durations) -> Plan:
    """The plan for requests that last ``request_s`` at capacity, ``running`` at once."""
    r = request_s
    measure = max(d.measure_min_s, d.measure_requests * r, d.measure_completions * r / running)
    return Plan(
        fixed_warmup_s=max(d.fixed_warmup_min_s, d.fixed_warmup_requests * r),
        adaptive_warmup_s=max(d.adaptive_warmup_min_s, d.adaptive_warmup_requests * r),
        measure_s=measure,
    )


def client_levels(shape: Shape) -> list[int]:
    """Client counts from below capacity to twice above it (at least 1)."""
    return sorted({max(1, round(f * shape.est.capacity)) for f in CLIENT_FACTORS})


def fixed_grid(shape: Shape, clients: int) -> list[int]:
    """Fixed limits to sweep: a grid around capacity, the pp stage count, and ``clients`` (the
    direct baseline); a limit above ``clients`` never binds, so it is ``clients``."""
    levels = {round(f * shape.est.capacity) for f in GRID_FACTORS}
    levels |= {shape.profile.stages, clients}
    return sorted({min(max(1, n), clients) for n in levels})


@dataclass(frozen=True, slots=True)
class Measured:
    tokens_per_s: float
    ttft_p99: float
    completed: int  # requests completed in the window


def measure(run: SimRun, t0: float, t1: float) -> Measured:
    done = sum(1 for t, _ in run.e2es if t0 <= t < t1)
    return Measured(run.throughput(t0, t1), run.ttft_pct(t0, t1, 0.99), done)


def _run(
    shape: Shape,
    clients: int,
    limit: Limit,
    duration_s: float,
    seed: int | None = None,
    evidence: str = "full",
) -> SimRun:
    return closed_loop_through_limit(
        shape.profile,
        clients,
        limit,
        duration_s=duration_s,
        input_len=shape.input_len,
        output_len=shape.output_len,
        seed=shape.seed if seed is None else seed,
        **EVIDENCE[evidence],
    )


def eval_seeds(shape: Shape, n: int = EVAL_SEEDS) -> list[int]:
    """Workload seeds (answer lengths, step noise) for judging a case, apart from the shape's
    own seed, on which the best fixed limit is selected."""
    return [stable_seed(shape.seed, f"eval-{k}") for k in range(n)]


def _ratio(a: float, b: float) -> float:
    if math.isnan(a) or math.isnan(b):
        return math.nan
    return a / b if b > 0 else (1.0 if a == 0 else math.inf)


@dataclass(frozen=True, slots=True)
class _Judged:
    """One evaluation seed of a case: the three runs measured in the adaptive run's window."""

    adaptive: Measured
    best: Measured
    direct: Measured
    final_limit: int
    mean_limit: float
    reached_s: float | None


def _judge(shape: Shape, clients: int, best_n: int, p: Plan, seed: int, evidence: str) -> _Judged:
    t0 = p.adaptive_warmup_s
    t1 = t0 + p.measure_s
    limit = adaptive_limit(shape.profile)
    run = _run(shape, clients, limit, t1, seed, evidence)
    direct = measure(_run(shape, clients, fixed_limit(clients), t1, seed), t0, t1)
    best = (
        direct
        if best_n == clients
        else measure(_run(shape, clients, fixed_limit(best_n), t1, seed), t0, t1)
    )
    return _Judged(
        measure(run, t0, t1),
        best,
        direct,
        limit.limit,
        run.mean_limit(t0, t1),
        run.first_time_at(REACHED * best_n),
    )


def run_case(
    shape: Shape,
    clients: int,
    d: Durations | None = None,
    seeds: int = EVAL_SEEDS,
    evidence: str = "full",
) -> dict[str, Any]:
    """One shape at one client count: the fixed sweep, the adaptive limit (hearing
    ``evidence``), their ratios.

    The sweep selects the best fixed limit on the shape's own seed; the adaptive limit, that
    limit and the direct run are then judged on ``seeds`` other workload seeds, each in the
    adaptive run's window (an engine's throughput and TTFT drift over minutes: pp micro-batch
    regimes, KV pressure), and the ratios compare their means. Judged on the seed it was
    selected on, the best of a noisy sweep is its luckiest run (a winner's curse): one
    workload seed moves a pp or KV-bound engine's throughput by ~10% between neighbouring
    limits, more than the bar's margin.
    """
    started = time.perf_counter()
    p = plan(shape, clients, d or Durations())
    fixed_t0 = p.fixed_warmup_s
    fixed_end = fixed_t0 + p.measure_s
    sweep: dict[int, Measured] = {}
    # the direct run goes on for a second window: how much one configuration's throughput
    # moves from one window to the next (the noise any single ratio here carries)
    direct_run = _run(shape, clients, fixed_limit(clients), fixed_end + p.measure_s)
    sweep[clients] = measure(direct_run, fixed_t0, fixed_end)
    direct_next = measure(direct_run, fixed_end, fixed_end + p.measure_s)

    def sweep_at(n: int) -> None:
        if n not in sweep:
            run = _run(shape, clients, fixed_limit(n), fixed_end)
            sweep[n] = measure(run, fixed_t0, fixed_end)

    def best() -> int:  # the smallest of equally good limits
        return max(sorted(sweep), key=lambda n: sweep[n].tokens_per_s)

    for n in fixed_grid(shape, clients):
        sweep_at(n)
    while best() == min(sweep) and best() > 1:  # the capacity estimate was too high
        sweep_at(max(1, round(best() * EXTEND)))
    grid = sorted(sweep)
    i = grid.index(best())
    for nb in grid[max(i - 1, 0) : i] + grid[i + 1 : i + 2]:  # refine between the neighbours
        sweep_at(round(math.sqrt(grid[i] * nb)))
    best_n = best()

    judged = [
        _judge(shape, clients, best_n, p, seed, evidence) for seed in eval_seeds(shape, seeds)
    ]

    def mean(get: Any) -> float:
        return statistics.fmean(get(j) for j in judged)

    ad_tps, ad_ttft = mean(lambda j: j.adaptive.tokens_per_s), mean(lambda j: j.adaptive.ttft_p99)
    bf_tps, bf_ttft = mean(lambda j: j.best.tokens_per_s), mean(lambda j: j.best.ttft_p99)
    direct_tps, direct_ttft = (
        mean(lambda j: j.direct.tokens_per_s),
        mean(lambda j: j.direct.ttft_p99),
    )
    tps_ratio = _ratio(ad_tps, bf_tps)
    ttft_ratio = _ratio(ad_ttft, bf_ttft)
    reached = [j.reached_s for j in judged]
    return {
        "shape": shape.name,
        "seed": shape.seed,
        "clients": clients,
        "capacity": shape.est.capacity,
        "kv_bound": shape.est.kv_bound,
        "parallelism": shape.profile.parallelism,
        "stages": shape.profile.stages,
        "plan": asdict(p),
        "fixed": {n: asdict(m) for n, m in sorted(sweep.items())},
        "best_fixed": best_n,
        "eval_seeds": len(judged),
        "best_tps": bf_tps,
        "best_ttft_p99": bf_ttft,
        "direct_tps": direct_tps,
        "direct_ttft_p99": direct_ttft,
        "adaptive_tps": ad_tps,
        "adaptive_ttft_p99": ad_ttft,
        "adaptive_completed": min(j.adaptive.completed for j in judged),
        "tps_ratios": [_ratio(j.adaptive.tokens_per_s, j.best.tokens_per_s) for j in judged],
        "tps_ratio": tps_ratio,
        "ttft_ratio": ttft_ratio,
        "vs_direct": _ratio(ad_tps, direct_tps),
        "window_noise": abs(_ratio(direct_next.tokens_per_s, sweep[clients].tokens_per_s) - 1),
        "ttft_noise": abs(_ratio(direct_next.ttft_p99, sweep[clients].ttft_p99) - 1),
        "final_limit": judged[0].final_limit,
        "mean_limit": mean(lambda j: j.mean_limit),
        "reached_s": None if None in reached else max(r for r in reached if r is not None),
        "passes": passes(tps_ratio, ttft_ratio),
        "wall_s": time.perf_counter() - started,
    }


def trace_case(
    shape: Shape, clients: int, d: Durations | None = None, evidence: str = "full"
) -> tuple[Plan, list[Decision]]:
    """The adaptive limit's decisions in one case's first judged run (what ``_judge`` measures
    first: the same workload seed, duration and evidence), to read why a case fails."""
    p = plan(shape, clients, d or Durations())
    limit = adaptive_limit(shape.profile)
    assert isinstance(limit, AdaptiveLimit), "adaptive_limit builds the adaptive algorithm"
    _run(shape, clients, limit, p.adaptive_warmup_s + p.measure_s, eval_seeds(shape)[0], evidence)
    return p, list(limit.history)


def run_shape(shape: Shape, d: Durations | None = None) -> list[dict[str, Any]]:
    """Every client count of one shape (``run_case`` each)."""
    return [run_case(shape, c, d) for c in client_levels(shape)]


def passes(tps_ratio: float, ttft_ratio: float) -> bool:
    """The per-case bar (NaN fails: a ratio that could not be measured is not a pass)."""
    return tps_ratio >= MIN_THROUGHPUT and ttft_ratio <= MAX_TTFT_P99


def distribution(xs: list[float]) -> dict[str, float]:
    """min, p5, p25, median, mean, p75, p95, max (nearest rank) of the finite values."""
    v = sorted(x for x in xs if math.isfinite(x))
    if not v:
        return {}

    def pct(q: float) -> float:
        return v[min(len(v) - 1, max(0, math.ceil(q * len(v)) - 1))]

    return {
        "min": v[0],
        "p5": pct(0.05),
        "p25": pct(0.25),
        "median": statistics.median(v),
        "mean": statistics.fmean(v),
        "p75": pct(0.75),
        "p95": pct(0.95),
        "max": v[-1],
    }


def verdict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The bar over all cases: shapes whose every case passes, and the median throughput."""
    shapes: dict[str, bool] = {}
    for r in rows:
        shapes[r["shape"]] = shapes.get(r["shape"], True) and r["passes"]
    tps = [r["tps_ratio"] for r in rows]
    median = statistics.median(x if math.isfinite(x) else 0.0 for x in tps) if tps else math.nan
    ok = all(shapes.values()) and median >= MIN_MEDIAN_THROUGHPUT
    return {
        "shapes": len(shapes),
        "shapes_passing": sum(shapes.values()),
        "cases": len(rows),
        "cases_passing": sum(r["passes"] for r in rows),
        "median_tps_ratio": median,
        "accepted": ok,
    }


def margin(r: dict[str, Any]) -> float:
    """How far a case is from failing the bar (< 1: it fails; 0: not measured); ranks the
    worst."""
    t, q = r["tps_ratio"], r["ttft_ratio"]
    if math.isnan(t) or math.isnan(q):
        return 0.0
    return min(t / MIN_THROUGHPUT, MAX_TTFT_P99 / q if q > 0 else math.inf)


def beyond_noise(r: dict[str, Any]) -> bool:
    """Misses the throughput bar by more than the case's window noise (or is unmeasured)."""
    return not r["tps_ratio"] >= MIN_THROUGHPUT - r["window_noise"]


def ttft_beyond_noise(r: dict[str, Any]) -> bool:
    """Misses the TTFT p99 bar by more than the case's TTFT p99 window noise (or is
    unmeasured; results from before this was measured count as no noise)."""
    return not r["ttft_ratio"] <= MAX_TTFT_P99 * (1.0 + r.get("ttft_noise", 0.0))


def verdict_line(v: dict[str, Any]) -> str:
    word = "ACCEPTED" if v["accepted"] else "REJECTED"
    return (
        f"VERDICT: {word}: {v['shapes_passing']}/{v['shapes']} shapes pass on every client "
        f"count (throughput >= {MIN_THROUGHPUT}x best fixed, TTFT p99 <= {MAX_TTFT_P99}x); "
        f"{v['cases_passing']}/{v['cases']} cases; median throughput ratio "
        f"{v['median_tps_ratio']:.3f} (bar {MIN_MEDIAN_THROUGHPUT})"
    )


def _f(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    v = verdict(rows)
    lines = [
        f"## Adaptive limit on generated shapes: split `{meta['split']}`",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"Commit {meta['commit']}; {meta['shapes']} shapes (seeds {meta['seeds']}), "
        f"{len(rows)} cases; {meta['wall_s']:.0f} s wall with {meta['jobs']} worker(s) "
        f"({meta['cpu_s']:.0f} s of runs); {meta['load']}.",
        "",
        "Virtual time (tests/limit_sim.py); durations and the bar in "
        "benchmarks/limit_shapes.py's docstring. The adaptive limit hears "
        f"{EVIDENCE_TEXT[meta.get('evidence', 'full')]}.",
        "",
        "| ratio | min | p5 | p25 | median | mean | p75 | p95 | max |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, label in (
        ("tps_ratio", "throughput adaptive / best fixed"),
        ("ttft_ratio", "TTFT p99 adaptive / best fixed"),
        ("vs_direct", "throughput adaptive / direct"),
        ("window_noise", "window noise (direct, next window)"),
        ("ttft_noise", "TTFT p99 window noise (direct, next window)"),
    ):
        if not all(key in r for r in rows):
            continue
        d = distribution([r[key] for r in rows])
        cells = " | ".join(_f(d.get(k)) for k in ("min", "p5", "p25", "median", "mean"))
        cells += " | " + " | ".join(_f(d.get(k)) for k in ("p75", "p95", "max"))
        lines.append(f"| {label} | {cells} |")
    unmeasured = [r for r in rows if not math.isfinite(r["ttft_ratio"] * r["tps_ratio"])]
    lines += [
        "",
        f"Cases failing throughput (< {MIN_THROUGHPUT}): "
        f"{sum(1 for r in rows if not r['tps_ratio'] >= MIN_THROUGHPUT)}; "
        f"failing TTFT p99 (> {MAX_TTFT_P99}): "
        f"{sum(1 for r in rows if not r['ttft_ratio'] <= MAX_TTFT_P99)}; "
        f"with a ratio that could not be measured: {len(unmeasured)}. Throughput failures by "
        f"more than their case's window noise: {sum(1 for r in rows if beyond_noise(r))}; "
        f"TTFT p99 failures by more than their case's TTFT p99 window noise: "
        f"{sum(1 for r in rows if ttft_beyond_noise(r))}.",
        "",
        "Throughput ratios above 1 measure the comparison's own noise: the adaptive limit can "
        "only beat the best fixed limit by being measured in another window or engine state "
        "(a pp engine's micro-batch occupancy can settle differently after a different start "
        "and switch regimes after minutes). Window noise: the direct run's throughput (and "
        "TTFT p99) in the window after its measurement window, relative.",
        "",
        f"### The {WORST} worst cases (smallest margin to the bar)",
        "",
        "| shape | clients | capacity est. | tput ratio | TTFT p99 ratio | vs direct | noise | "
        "TTFT noise | best fixed | adaptive final (mean) | reached 90% at s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=margin)[:WORST]:
        reached = "never" if r["reached_s"] is None else f"{r['reached_s']:.0f}"
        lines.append(
            f"| {r['shape']} | {r['clients']} | {r['capacity']} | {_f(r['tps_ratio'])} | "
            f"{_f(r['ttft_ratio'], '.2f')} | {_f(r['vs_direct'])} | {_f(r['window_noise'])} | "
            f"{_f(r.get('ttft_noise'), '.2f')} | {r['best_fixed']} | "
            f"{r['final_limit']} ({_f(r['mean_limit'], '.0f')}) | {reached} |"
        )
    lines += ["", verdict_line(v), ""]
    return "\n".join(lines)


def _case(task: tuple[int, int, int, str]) -> dict[str, Any]:
    seed, clients, seeds, evidence = task
    return run_case(generate_shape(seed), clients, seeds=seeds, evidence=evidence)


def _cost(shape: Shape, clients: int, seeds: int) -> float:
    """Rough simulated tokens of a case judged on ``seeds`` seeds: to start the longest cases
    first."""
    p = plan(shape, clients, Durations())
    rate = shape.est.tokens_per_s * min(1.0, clients / shape.est.capacity)
    judged = 3 * seeds * (p.adaptive_warmup_s + p.measure_s)
    return rate * (judged + 8 * (p.fixed_warmup_s + p.measure_s))


def shape_set_arguments(ap: argparse.ArgumentParser) -> None:
    """Which generated shapes to run, on how many workers, and where the results go (the
    benchmarks on generated shapes share these)."""
    ap.add_argument("--split", choices=sorted(SPLITS), default="tune")
    ap.add_argument("--shapes", type=positive_int, help="shapes (default: the split's default)")
    ap.add_argument("--seed-base", type=int, help="first seed (default: the split's first)")
    ap.add_argument("--jobs", type=positive_int, default=2, help="worker processes")
    ap.add_argument("--out", type=Path, help="results path without suffix (.md and .json)")
    ap.add_argument("--no-save", action="store_true", help="print only")


def shape_set_meta(
    script: str, args: argparse.Namespace, argv: list[str] | None, seeds: list[int], started: float
) -> dict[str, Any]:
    """What every benchmark on a shape set records of its run (extended by each)."""
    argv_text = " ".join(sys.argv[1:] if argv is None else argv)
    return {
        "split": args.split,
        "command": f"python benchmarks/{script} {argv_text}".strip(),
        "commit": commit(),
        "seeds": f"{seeds[0]}-{seeds[-1]}",
        "jobs": args.jobs,
        "wall_s": time.perf_counter() - started,
        "load": load_cpu(),
    }


def save_shape_set(name: str, args: argparse.Namespace, text: str, data: dict[str, Any]) -> None:
    """Print the markdown and, unless ``--no-save``, write it and ``data`` to ``--out`` or
    benchmarks/results/<name>-<split>."""
    print(text)
    if not args.no_save:
        out = args.out or RESULTS / f"{name}-{args.split}"
        write_results(out.name, text, data, out)
        print(f"wrote {out.with_suffix('.md')} and .json", file=sys.stderr)


def chosen_seeds(ap: argparse.ArgumentParser, args: argparse.Namespace) -> list[int]:
    """The seeds ``shape_set_arguments`` chose (a clear error for a range outside the split)."""
    try:
        return split_seeds(args.split, args.shapes, args.seed_base)
    except ValueError as exc:
        ap.error(str(exc))


def _print_trace(ap: argparse.ArgumentParser, spec: str, evidence: str) -> int:
    seed_text, _, clients_text = spec.partition(":")
    try:
        seed, clients = int(seed_text), int(clients_text)
    except ValueError:
        ap.error(f"--trace {spec!r}: expected SEED:CLIENTS, two integers")
    if clients < 1:
        ap.error(f"--trace {spec!r}: CLIENTS must be at least 1")
    shape = generate_shape(seed)
    p, decisions = trace_case(shape, clients, evidence=evidence)
    t0 = p.adaptive_warmup_s
    print(f"{shape.name}, {clients} clients, hearing {EVIDENCE_TEXT[evidence]}")
    print(f"measured window {t0:.1f}-{t0 + p.measure_s:.1f} s (modelled); decisions:")
    for d in decisions:
        print(f"{d.at:8.1f}  {d}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    shape_set_arguments(ap)
    ap.add_argument(
        "--eval-seeds",
        type=positive_int,
        default=EVAL_SEEDS,
        help="workload seeds each case is judged on (default %(default)s)",
    )
    ap.add_argument(
        "--evidence",
        choices=list(EVIDENCE),
        default="full",
        help="what the adaptive limit hears: "
        + "; ".join(f"{k}: {v.replace('`', '')}" for k, v in EVIDENCE_TEXT.items()),
    )
    ap.add_argument(
        "--trace",
        metavar="SEED:CLIENTS",
        help="print the adaptive limit's decisions in that case's first judged run, and exit",
    )
    args = ap.parse_args(argv)
    if args.trace is not None:
        return _print_trace(ap, args.trace, args.evidence)
    seeds = chosen_seeds(ap, args)
    shapes = {s: generate_shape(s) for s in seeds}
    tasks = [
        (s, c, args.eval_seeds, args.evidence) for s in seeds for c in client_levels(shapes[s])
    ]
    tasks.sort(key=lambda t: _cost(shapes[t[0]], t[1], t[2]), reverse=True)
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    with multiprocessing.Pool(args.jobs) if args.jobs > 1 else _Inline() as pool:
        for row in pool.imap_unordered(_case, tasks):
            rows.append(row)
            print(
                f"[{len(rows)}/{len(tasks)}] {row['shape']} C={row['clients']}: throughput "
                f"{row['tps_ratio']:.3f}, TTFT p99 {row['ttft_ratio']:.2f}, limit "
                f"{row['final_limit']} (best fixed {row['best_fixed']}) {row['wall_s']:.1f} s",
                file=sys.stderr,
                flush=True,
            )
    rows.sort(key=lambda r: (r["seed"], r["clients"]))
    meta = shape_set_meta("limit_shapes.py", args, argv, seeds, started)
    meta.update(
        shapes=len(seeds),
        cpu_s=sum(r["wall_s"] for r in rows),
        durations=asdict(Durations()),
        eval_seeds=args.eval_seeds,
        evidence=args.evidence,
    )
    text = markdown(rows, meta)
    save_shape_set(
        "limit_shapes", args, text, {"meta": meta, "verdict": verdict(rows), "cases": rows}
    )
    return 0


class _Inline:
    """``--jobs 1``: the pool's interface, in this process."""

    def __enter__(self) -> _Inline:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def imap_unordered(self, fn: Any, tasks: list[tuple[int, int, int, str]]) -> Any:
        return map(fn, tasks)


if __name__ == "__main__":
    raise SystemExit(main())
