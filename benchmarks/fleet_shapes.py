"""Fleets of two unlike generated backends: the adaptive limits against fixed ones, virtual time.

    .venv/bin/python benchmarks/fleet_shapes.py --split tune                  # 60 fleets
    .venv/bin/python benchmarks/fleet_shapes.py --split accept --seed-base 30000 \\
        --out benchmarks/results/fleet_shapes-accept                          # other fleets
    .venv/bin/python benchmarks/fleet_shapes.py --shapes 4 --no-save          # a smoke run

benchmarks/limit_shapes.py judges the adaptive limit on one backend. With several unlike ones,
what one limit does decides where the others' requests wait: a limit above what its backend
runs (a cold start, a probe) sends requests into that backend's own queue while another may
free a slot first, and a limit below it sends them elsewhere. Issue 14's fleet bar compares the
adaptive limits with fixed limits at each backend's capacity, and with a router sending
straight; this does so on generated fleets.

A fleet, for seed ``s``: two generated backends (``loadtest.sim.shapes``: the shape of seed
``s`` and the engine of another seed drawn from ``s``), both serving the first shape's workload
(clients send one workload to the whole fleet; a second engine whose KV pool cannot hold twice
that workload's longest request is drawn again). Closed-loop clients at ``CLIENT_FACTORS`` x
the fleet's estimated capacity go through the proxy's queue and policy into the schedulers
(tests/limit_sim.py), on one workload seed, three ways:

- ``adaptive``: the latency policy, one adaptive limit per backend hearing only its own
  requests (no gauges, no ``/server_info``: the case where the limits learn most slowly);
- ``fixed``: the latency policy, fixed limits at each backend's estimated capacity (the
  reference the issue names; not an optimum: the estimate is a model's);
- ``straight``: round robin with no limit, as a router that sends every request at once.

Measured in two windows: ``whole`` from ``START_S`` (the cold start included: what a user meets
after a deploy) and ``steady`` after the limits' warmup (limit_shapes' ``Durations``, over the
slower backend's request time): output tokens/s and the clients' TTFT p99 (the wait in the
proxy's queue included). Exit status 0 (a measurement).
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from limit_shapes import (
    Durations,
    chosen_seeds,
    save_shape_set,
    shape_set_arguments,
    shape_set_meta,
    timing,
)
from limit_sim import SimRun, closed_loop_through_proxy

from loadtest.sim.shapes import Estimate, Shape, estimate, generate_shape
from loadtest.sim.tokens import stable_seed
from proxy.limits import LimitSettings, make_limit
from proxy.policies import make_policy

#: clients, x the fleet's estimated capacity
CLIENT_FACTORS = (0.7, 1.2, 2.0)
#: the ``whole`` window starts here (modelled s): the first requests' prefill is not a latency
START_S = 5.0
#: draws of a second engine before a fleet's seed is given up
SECOND_DRAWS = 20
ARMS = ("adaptive", "fixed", "straight")
#: cases listed: the adaptive limits under this x the fixed ones' tokens/s (steady window)
LOW = 0.95
#: the ratios reported: (numerator arm, denominator arm)
RATIOS = (("adaptive", "fixed"), ("adaptive", "straight"), ("fixed", "straight"))


@dataclass(frozen=True, slots=True)
class Fleet:
    seed: int
    first: Shape
    second: Shape  # its engine serves ``first``'s workload
    second_est: Estimate  # ...and this is what it does with it

    @property
    def capacity(self) -> int:
        return self.first.est.capacity + self.second_est.capacity

    @property
    def name(self) -> str:
        return f"{self.first.name} + {self.second.profile.name}"


def generate_fleet(seed: int) -> Fleet | None:
    first = generate_shape(seed)
    longest = first.input_len + first.output_len[1] + 1
    for k in range(SECOND_DRAWS):
        second = generate_shape(stable_seed(seed, f"fleet-second-{k}"))
        if second.profile.max_total_tokens < 2 * longest:
            continue  # its pool cannot hold this workload's requests
        est = estimate(second.profile, first.input_len, first.output_len)
        if est.capacity >= 1:
            return Fleet(seed, first, second, est)
    return None


def _run(fleet: Fleet, clients: int, arm: str, duration_s: float) -> SimRun:
    profiles = [fleet.first.profile, fleet.second.profile]
    if arm == "adaptive":
        limits = [make_limit(LimitSettings()) for _ in profiles]
    else:
        caps = (fleet.first.est.capacity, fleet.second_est.capacity)
        if arm == "straight":
            caps = (clients, clients)
        limits = [make_limit(LimitSettings(algorithm="fixed", initial=n)) for n in caps]
    return closed_loop_through_proxy(
        profiles,
        clients,
        limits,
        make_policy("round_robin" if arm == "straight" else "latency"),
        duration_s=duration_s,
        input_len=fleet.first.input_len,
        output_len=fleet.first.output_len,
        seed=fleet.seed,
        gauges="none",
        word=False,
    )


def windows(fleet: Fleet, clients: int, d: Durations) -> dict[str, tuple[float, float]]:
    """The two windows a case is measured in (modelled s)."""
    r = max(fleet.first.est.request_s, fleet.second_est.request_s)
    p = timing(r, max(1, min(clients, fleet.capacity)), d)
    end = p.adaptive_warmup_s + p.measure_s
    return {"whole": (START_S, end), "steady": (p.adaptive_warmup_s, end)}


def run_case(seed: int, factor: float) -> dict[str, Any] | None:
    fleet = generate_fleet(seed)
    if fleet is None:
        return None
    return run_fleet(fleet, max(2, round(factor * fleet.capacity)))


def run_fleet(fleet: Fleet, clients: int, d: Durations | None = None) -> dict[str, Any]:
    """One case: the three arms on one workload seed, each measured in both windows."""
    spans = windows(fleet, clients, d or Durations())
    end = max(t1 for _, t1 in spans.values())
    out: dict[str, Any] = {"fleet": fleet.name, "seed": fleet.seed, "clients": clients}
    for arm in ARMS:
        run = _run(fleet, clients, arm, end)
        for w, (t0, t1) in spans.items():
            out[f"{arm}_{w}_tps"] = run.throughput(t0, t1)
            out[f"{arm}_{w}_ttft99"] = run.ttft_pct(t0, t1, 0.99)
    for w in spans:
        for a, b in RATIOS:
            out[f"{w}_{a}_{b}_tps"] = _ratio(out[f"{a}_{w}_tps"], out[f"{b}_{w}_tps"])
            out[f"{w}_{a}_{b}_ttft"] = _ratio(out[f"{a}_{w}_ttft99"], out[f"{b}_{w}_ttft99"])
    return out


def _ratio(a: float, b: float) -> float:
    if math.isnan(a) or math.isnan(b) or b <= 0:
        return math.nan
    return a / b


def _quantiles(xs: list[float]) -> str:
    xs = sorted(x for x in xs if not math.isnan(x))
    if not xs:
        return "- | - | - | - | -"
    q = [xs[min(len(xs) - 1, int(f * len(xs)))] for f in (0.05, 0.25)]
    hi = [xs[min(len(xs) - 1, int(f * len(xs)))] for f in (0.75, 0.95)]
    return f"{xs[0]:.3f} | {q[0]:.3f} | {q[1]:.3f} | {statistics.median(xs):.3f} | " + (
        f"{hi[0]:.3f} | {hi[1]:.3f} | {xs[-1]:.3f}"
    )


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        f"## Fleets of two unlike generated backends: split `{meta['split']}`",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"Commit {meta['commit']}; {meta['fleets']} fleets (seeds {meta['seeds']}), "
        f"{len(rows)} cases; {meta['wall_s']:.0f} s wall with {meta['jobs']} worker(s); "
        f"{meta['load']}. Virtual time; the adaptive limits hear only their own requests; how "
        "the fleets, arms and windows are drawn: benchmarks/fleet_shapes.py's docstring.",
        "",
        "| ratio | min | p5 | p25 | median | p75 | p95 | max |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for w in ("whole", "steady"):
        for a, b in RATIOS:
            tps = _quantiles([r[f"{w}_{a}_{b}_tps"] for r in rows])
            ttft = _quantiles([r[f"{w}_{a}_{b}_ttft"] for r in rows])
            lines += [
                f"| {w}: {a} / {b}, tokens/s | {tps} |",
                f"| {w}: {a} / {b}, TTFT p99 | {ttft} |",
            ]
    low = [r for r in rows if r["steady_adaptive_fixed_tps"] < LOW]
    lines += [
        "",
        f"Cases where the adaptive limits deliver under {LOW}x the fixed ones' tokens/s in the "
        f"steady window: {len(low)} of {len(rows)}.",
        "",
        "| fleet | clients | steady tok/s adaptive / fixed | TTFT p99 | whole tok/s | TTFT p99 |",
        "|---|---|---|---|---|---|",
    ]
    for r in sorted(low, key=lambda r: r["steady_adaptive_fixed_tps"]):
        lines.append(
            f"| {r['fleet']} | {r['clients']} | {r['steady_adaptive_fixed_tps']:.3f} | "
            f"{r['steady_adaptive_fixed_ttft']:.2f} | {r['whole_adaptive_fixed_tps']:.3f} | "
            f"{r['whole_adaptive_fixed_ttft']:.2f} |"
        )
    return "\n".join(lines)


def _case(task: tuple[int, float]) -> dict[str, Any] | None:
    return run_case(*task)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    shape_set_arguments(ap)
    args = ap.parse_args(argv)
    seeds = chosen_seeds(ap, args)
    started = time.perf_counter()
    tasks = [(s, f) for s in seeds for f in CLIENT_FACTORS]
    with multiprocessing.Pool(args.jobs) as pool:
        rows = [r for r in pool.map(_case, tasks, chunksize=1) if r is not None]
    if not rows:
        ap.error("no fleet could be drawn from these seeds")
    meta = shape_set_meta("fleet_shapes.py", args, argv, seeds, started)
    meta["fleets"] = len({r["seed"] for r in rows})
    save_shape_set("fleet_shapes", args, markdown(rows, meta), {"meta": meta, "cases": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
