"""Traces of the adaptive limit on the simulator's engine model, in virtual time (seconds to run).

    .venv/bin/python benchmarks/limit_trace.py            # prints markdown
    .venv/bin/python benchmarks/limit_trace.py --out benchmarks/results/limit_trace.md

No sockets: closed-loop clients go through the proxy's queue and the limit (real
proxy/limits.py, proxy/stats.py, proxy/policies.py objects on a virtual clock) into the
simulator's scheduler (tests/limit_sim.py). It prints (1) the limit converging on pp8 with 64 and
128 clients, next to a sweep of fixed limits, (2) the limit's decisions, (3) routing policies on
pp8 + tp8 + ep8 at C = 4, 32, 128. The HTTP benchmarks (benchmarks/adaptive_fill.py, ...) measure
the same through real sockets; this one shows the algorithm's behaviour exactly and repeatably.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from limit_sim import closed_loop_through_limit, closed_loop_through_proxy

from proxy.limits import LimitSettings, make_limit
from proxy.policies import make_policy

OUT = (256, 768)
DURATION = 180.0
STEADY = (60.0, DURATION)


def adaptive(profile: str):
    return make_limit(LimitSettings(), parallelism=profile[:2], pp_size=8)


def fixed(n: int):
    return make_limit(LimitSettings(algorithm="fixed", initial=n))


def convergence(profile: str, clients: int, sweep: list[int]) -> list[str]:
    lim = adaptive(profile)
    run = closed_loop_through_limit(profile, clients, lim, duration_s=DURATION, output_len=OUT)
    lines = [
        f"### {profile}, {clients} closed-loop clients (1024-token prompts, 256-768 output)",
        "",
        "Limit after each window (t in simulated seconds):",
        "",
        "```",
        "   t   limit  in-flight  tokens/s(window)",
    ]
    last = None
    for t, limit, in_flight, tps in run.limit_trace:
        if limit != last or t >= DURATION - 1:
            lines.append(f"{t:6.1f}  {limit:5d}  {in_flight:9.1f}  {tps:8.0f}")
            last = limit
        if t > 60 and limit == last and t < DURATION - 1:
            continue
    lines += ["```", "", "Decisions:", "", "```"]
    lines += [f"{d.at:6.1f}  -> {d.after:4d}  {d}" for d in lim.history]
    lines += ["```", ""]
    rows = []
    a_tps = run.throughput(*STEADY)
    a_ttft = run.ttft_pct(*STEADY, 0.99)
    best = None
    for n in sweep:
        r = closed_loop_through_limit(
            profile, clients, fixed(n), duration_s=DURATION, output_len=OUT
        )
        tps, ttft = r.throughput(*STEADY), r.ttft_pct(*STEADY, 0.99)
        rows.append((f"fixed {n}", tps, ttft))
        if best is None or tps > best[1]:
            best = (n, tps, ttft)
    reached = run.first_time_at(0.9 * (lim.knee or 0)) if lim.knee else None
    lines += [
        f"Steady state ({STEADY[0]:.0f}-{STEADY[1]:.0f} s): adaptive {a_tps:.0f} tok/s, "
        f"TTFT p99 {a_ttft:.2f} s (clients' TTFT: includes the wait in the proxy's queue); "
        f"knee {lim.knee}, limit {lim.limit}, reached 90% of the knee at "
        f"{reached if reached is None else round(reached, 1)} s.",
        "",
        "| limit | tok/s | TTFT p99 s |",
        "|---|---|---|",
        f"| adaptive | {a_tps:.0f} | {a_ttft:.2f} |",
    ]
    lines += [f"| {name} | {tps:.0f} | {ttft:.2f} |" for name, tps, ttft in rows]
    assert best is not None
    lines += [
        "",
        f"Adaptive / best fixed ({best[0]}): throughput {a_tps / best[1]:.3f}, "
        f"TTFT p99 {a_ttft / best[2] if best[2] else float('nan'):.2f}x.",
        "",
    ]
    return lines


def routing() -> list[str]:
    profiles = ["pp8", "tp8", "ep8"]
    lines = [
        "### Routing: pp8 + tp8 + ep8, adaptive limits, steady state 60-180 s",
        "",
        "| C | policy | tok/s | E2E p99 s | TTFT p99 s | served pp/tp/ep | final limits |",
        "|---|---|---|---|---|---|---|",
    ]
    for clients in (4, 32, 128):
        base = None
        for name in ("latency", "p2c_peak_ewma", "least_in_flight", "round_robin"):
            limits = [adaptive(p) for p in profiles]
            r = closed_loop_through_proxy(
                profiles,
                clients,
                limits,
                make_policy(name, seed=1),
                duration_s=DURATION,
                output_len=OUT,
            )
            tps = r.throughput(*STEADY)
            base = base or tps
            served = "/".join(str(v) for v in r.served.values())
            lines.append(
                f"| {clients} | {name} | {tps:.0f} ({tps / base:.2f}) | "
                f"{r.e2e_pct(*STEADY, 0.99):.1f} | {r.ttft_pct(*STEADY, 0.99):.2f} | {served} | "
                f"{[lim.limit for lim in limits]} |"
            )
    lines.append("")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="also write the markdown here")
    args = ap.parse_args()
    lines = ["## Adaptive limit traces (virtual time, simulator engine model)", ""]
    lines += convergence("pp8", 64, [16, 32, 48, 64, 96])
    lines += convergence("pp8", 128, [32, 48, 64, 80, 96])
    lines += convergence("tp8", 48, [16, 32, 48, 64])
    lines += routing()
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
