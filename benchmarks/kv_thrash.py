"""Would a limit set by the KV pool beat sending straight? Oracles and models on KV-bound shapes.

    .venv/bin/python benchmarks/kv_thrash.py                      # tune split's KV-bound shapes
    .venv/bin/python benchmarks/kv_thrash.py --shapes 10 --no-save   # a smoke run

The adaptive limit does not cut on SGLang's retractions (proxy/limits.py, AdaptiveLimit's
docstring). This asks whether the principle behind such a cut holds at all, before any online
rule is built on it: "the backend's capacity is the most it runs without thrashing its KV cache",
read as the most requests in flight at which the engine retracts (almost) none.

For every KV-bound shape of a split (``loadtest.sim.shapes``; the pool binds before the running
cap) at twice its estimated capacity in clients, fixed limits on a fine grid (limit_shapes'
grid plus 0.6-1.2x the capacity and two steps below it) run in virtual time
(tests/limit_sim.py) on the shape's own seed, each measured in limit_shapes' fixed-limit window:
output tokens/s, and requests the engine retracted in the window. Per case, against the best of
those limits (the most tokens/s):

- *retraction-free*: the largest limit whose window retracted at most ``eps`` x its completions
  (an oracle: it knows every limit's outcome, as no online rule could);
- *direct*: the limit equal to the client count (sending straight to the backend);
- *never retracted*: the largest limit whose run retracted nothing at all, warmup included.
  One retraction leaves SGLang's admission conservative long after it (the reserve ratio is
  re-estimated high and decays by ``(init - min) / decay_steps`` per decode step; with an
  ``init`` of 0 it stays), so a window without retractions may follow a warmup that had one.

- *footprint*: the limit nearest (in ratio) to the pool's tokens over a running request's mean
  footprint, its prompt plus half its answer (requests at evenly spread progress), and
  *whole*: over its prompt plus its whole answer (every request carried to its end). The proxy
  could compute both (``/server_info``'s ``max_total_num_tokens``; the prompt and answer
  tokens of the requests it relays); here they come from the shape itself, so they are exact.

All are judged on the same runs as the best, so the best's luck (it is the maximum of ~10
noisy runs) weighs on them alike. If none does better than sending straight, a rule that cuts
on retractions, or a limit modelled on token footprints, has nothing to find. Exit status 0 (a
measurement).
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from limit_shapes import (
    EXTEND,
    MIN_THROUGHPUT,
    Durations,
    _run,
    chosen_seeds,
    fixed_grid,
    fixed_limit,
    measure,
    plan,
    save_shape_set,
    shape_set_arguments,
    shape_set_meta,
)
from limit_sim import SimRun

from loadtest.sim.shapes import Shape, generate_shape

EPSILONS = (0.0, 0.01, 0.03, 0.1)  # retracted / completed in the window
FINE = (0.6, 0.8, 0.9, 1.1, 1.2)  # extra limits, x the capacity estimate


def retracted(run: SimRun, t0: float, t1: float) -> int:
    xs = [n for t, n in run.retractions_at if t0 <= t <= t1]
    return xs[-1] - xs[0] if len(xs) > 1 else 0


def limits_for(shape: Shape, clients: int) -> list[int]:
    grid = set(fixed_grid(shape, clients))
    low = min(grid)
    grid |= {round(shape.est.capacity * f) for f in FINE}
    grid |= {round(low * EXTEND), round(low * EXTEND * EXTEND)}
    return sorted(n for n in grid if 1 <= n <= clients)


def case(seed: int) -> dict[str, Any]:
    shape = generate_shape(seed)
    clients = max(1, round(2 * shape.est.capacity))
    p = plan(shape, clients, Durations())
    t0, t1 = p.fixed_warmup_s, p.fixed_warmup_s + p.measure_s
    runs: dict[int, tuple[float, int, int]] = {}
    ever: dict[int, int] = {}  # limit -> requests retracted over the whole run, warmup included
    for n in limits_for(shape, clients):
        run = _run(shape, clients, fixed_limit(n), t1)
        m = measure(run, t0, t1)
        runs[n] = (m.tokens_per_s, retracted(run, t0, t1), m.completed)
        ever[n] = retracted(run, 0.0, t1)
    best = max(sorted(runs), key=lambda n: runs[n][0])
    out: dict[str, Any] = {
        "shape": shape.name,
        "clients": clients,
        "best": best,
        "direct_ratio": runs[clients][0] / runs[best][0],
        "direct_retracted": runs[clients][1],
        "direct_completed": runs[clients][2],
        "runs": runs,
    }
    for eps in EPSILONS:
        n = retraction_free(runs, eps)
        out[f"free_{eps}"] = (n, runs[n][0] / runs[best][0])
    calm = [n for n in runs if ever[n] == 0]
    n = max(calm) if calm else min(runs)
    out["never"] = (n, runs[n][0] / runs[best][0])
    out["direct_ever"] = ever[clients]
    answer = sum(shape.output_len) / 2
    for model, tokens in (("footprint", answer / 2), ("whole", answer)):
        n = nearest(runs, shape.profile.max_total_tokens / (shape.input_len + tokens))
        out[model] = (n, runs[n][0] / runs[best][0])
    return out


def retraction_free(runs: dict[int, tuple[float, int, int]], eps: float) -> int:
    """The largest limit whose run retracted at most ``eps`` x its completions (the smallest
    limit if every run retracted more). ``runs``: limit -> (tokens/s, retracted, completed)."""
    calm = [n for n, (_, taken_back, done) in runs.items() if taken_back <= eps * max(done, 1)]
    return max(calm) if calm else min(runs)


def nearest(runs: dict[int, tuple[float, int, int]], level: float) -> int:
    """The limit run closest to ``level`` in ratio."""
    return min(runs, key=lambda n: abs(math.log(n / level)))


def summary(xs: list[float]) -> str:
    xs = sorted(xs)
    return (
        f"{xs[0]:.3f} | {xs[len(xs) // 20]:.3f} | {statistics.median(xs):.3f} | "
        f"{sum(x < MIN_THROUGHPUT for x in xs)}"
    )


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        f"## KV thrash oracle: split `{meta['split']}`, {len(rows)} KV-bound shapes",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"Commit {meta['commit']}; seeds {meta['seeds']}; {meta['wall_s']:.0f} s wall with "
        f"{meta['jobs']} worker(s); {meta['load']}. Virtual time, each shape at twice its "
        "capacity in clients, judged on its own seed (benchmarks/kv_thrash.py's docstring).",
        "",
        f"Direct runs that retracted anything in the window: "
        f"{sum(r['direct_retracted'] > 0 for r in rows)} of {len(rows)}.",
        "",
        "| choice (x the best fixed limit's tokens/s) | min | p5 | median | "
        f"cases < {MIN_THROUGHPUT} |",
        "|---|---|---|---|---|",
        f"| direct (limit = clients) | {summary([r['direct_ratio'] for r in rows])} |",
    ]
    for eps in EPSILONS:
        xs = [r[f"free_{eps}"][1] for r in rows]
        lines.append(f"| retraction-free, eps {eps} | {summary(xs)} |")
    never = summary([r["never"][1] for r in rows])
    lines.append(f"| never retracted (warmup included) | {never} |")
    for model, text in (("footprint", "prompt + half the answer"), ("whole", "prompt + answer")):
        xs = [r[model][1] for r in rows]
        lines.append(f"| pool / ({text}) | {summary(xs)} |")
    lines += [
        "",
        "| shape | clients | best | direct / best | retracted / completed (direct) | "
        "retraction-free (eps 0.01) | its ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        n, ratio = r["free_0.01"]
        lines.append(
            f"| {r['shape']} | {r['clients']} | {r['best']} | {r['direct_ratio']:.3f} | "
            f"{r['direct_retracted']} / {r['direct_completed']} | {n} | {ratio:.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    shape_set_arguments(ap)
    args = ap.parse_args(argv)
    seeds = chosen_seeds(ap, args)
    kv = [s for s in seeds if generate_shape(s).est.kv_bound]
    if not kv:
        ap.error(f"no KV-bound shape among seeds {seeds[0]}-{seeds[-1]}: ask for more --shapes")
    started = time.perf_counter()
    with multiprocessing.Pool(args.jobs) as pool:
        rows = pool.map(case, kv, chunksize=1)
    meta = shape_set_meta("kv_thrash.py", args, argv, seeds, started)
    save_shape_set("kv_thrash", args, markdown(rows, meta), {"meta": meta, "cases": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
