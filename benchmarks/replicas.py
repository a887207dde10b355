"""Two proxy replicas in front of the same backends vs one proxy: in flight per backend.

    .venv/bin/python benchmarks/replicas.py            # ~4 min on 2 cores
    .venv/bin/python benchmarks/replicas.py --repeats 1 --quick

Phase 1: pp8 + tp8 simulators (one process), one proxy (adaptive limits), --clients closed-loop
clients (more than the backends' knees together, so the limits decide). Phase 2: fresh
simulators, two proxies configured identically, each getting half the clients (two `loadtest
run` processes started together). /admin/backends of every proxy is sampled every 0.5 modelled
s; the combined in-flight per backend (sum over the proxies) is averaged over the steady-state
window and compared with what the one proxy held; SGLang's own count (/get_load: running +
waiting) is shown beside it. The pair of phases is repeated ``--repeats`` times: which backend
the latency policy favours drifts over tens of seconds (pp8 held 12-96 in one proxy's run), so
one window's ratio varies by +-20% between runs of the same code. Target: the median ratio over
the repeats within 20% per backend (every repeat's ratio printed). Times are modelled seconds.
Results: benchmarks/results/replicas.{md,json}.
"""

from __future__ import annotations

import argparse
import math
import shlex
import statistics
import sys
import time
from typing import Any

from harness import (
    SURFACES,
    Harness,
    Poller,
    argument_parser,
    backend_entries,
    commit,
    get_json,
    length_arg,
    level_row,
    load_cpu,
    positive_int,
    proxy_toml,
    sglang_defaults_argument,
    sim_surface,
    surface_name,
    window_wall,
    write_results,
)

PROFILES = ["pp8", "tp8"]


def run_phase(args: argparse.Namespace, replicas: int, repeat: int = 1) -> dict[str, Any]:
    ts = args.time_scale
    with Harness(f"replicas-{replicas}-r{repeat}", time_scale=ts) as h:
        sim = h.sim(PROFILES, extra=sim_surface(args))
        cfg = lambda: proxy_toml(backend_entries(sim.urls, PROFILES), time_scale=ts)  # noqa: E731
        proxies = [h.proxy(cfg(), name=f"proxy{i}") for i in range(replicas)]

        def sample() -> dict[str, Any]:
            out: dict[str, Any] = {}
            for i, px in enumerate(proxies):
                d = get_json(f"{px.url}/admin/backends", timeout=1.0)
                for b in (d or {}).get("backends", []):
                    e = out.setdefault(b["name"], {"in_flight": 0, "limits": [], "capacity": []})
                    e["in_flight"] += b["in_flight"]
                    e["limits"].append(b["limit"])
                    e["capacity"].append((b.get("limit_state") or {}).get("capacity"))
                    e[f"p{i}"] = b["in_flight"]
            for prof, url in zip(PROFILES, sim.urls, strict=True):
                load = get_json(f"{url}/get_load", timeout=1.0)
                if isinstance(load, list) and prof in out:
                    out[prof]["sglang_reqs"] = sum(x["num_reqs"] for x in load)
            return out

        per = args.clients // replicas
        cmd = ["--concurrency", str(per), "--warmup", str(args.warmup), "--duration",
               str(args.duration), "--drain-timeout", "0", "--input-len", "1024",
               "--output-len", args.output_len, "--save-records"]  # fmt: skip
        with Poller(sample, interval=0.5 * ts) as poll:
            lts = [
                h.start_loadtest(px.url, [*cmd, "--seed", str(20 + i)], name=f"loadtest{i}")
                for i, px in enumerate(proxies)
            ]
            results = [h.finish_loadtest(lt) for lt in lts]
    windows = [window_wall(r) for r in results]  # on the poller's clock
    w0, w1 = max(w[0] for w in windows), min(w[1] for w in windows)
    inside = [s for t, s in poll.samples if w0 <= t + poll.t0 <= w1]
    backends = {}
    for prof in PROFILES:
        ss = [s[prof] for s in inside if prof in s]
        backends[prof] = {
            "in_flight_mean": statistics.fmean(x["in_flight"] for x in ss),
            "in_flight_p10_p90": _p10_p90([x["in_flight"] for x in ss]),
            "sglang_reqs_mean": statistics.fmean(x.get("sglang_reqs", 0) for x in ss),
            "limits_last": ss[-1]["limits"],
            "per_proxy_mean": [
                statistics.fmean(x.get(f"p{i}", 0) for x in ss) for i in range(replicas)
            ],
            "capacity_last": ss[-1]["capacity"],
        }
    series = [
        (round(t / ts, 1), {p: s[p]["in_flight"] for p in PROFILES if p in s})
        for t, s in poll.samples
    ]
    return {
        "replicas": replicas,
        "levels": [level_row(r["levels"][0]) for r in results],
        "output_tok_s": sum(r["levels"][0]["output_tok_s"] for r in results),
        "backends": backends,
        "series": series,
        "samples": len(inside),
    }


#: the target: two replicas' combined in flight within this fraction of one proxy's
TOLERANCE = 0.2


def verdict(ratios: dict[str, list[float]]) -> tuple[dict[str, float], bool]:
    """Each backend's median ratio (two replicas / one proxy) over the repeats, and whether
    every median is within ``TOLERANCE`` of 1. A repeat whose ratio is not a number (one proxy
    held nothing on that backend) fails the whole verdict: it measured nothing."""
    medians = {prof: statistics.median(rs) for prof, rs in ratios.items()}
    measured = all(not math.isnan(r) for rs in ratios.values() for r in rs)
    close = all(abs(m - 1) <= TOLERANCE for m in medians.values())
    return medians, bool(medians) and measured and close


def _p10_p90(xs: list[float]) -> list[float]:
    s = sorted(xs)
    return [s[int(0.1 * (len(s) - 1))], s[int(0.9 * (len(s) - 1))]] if s else []


def main(argv: list[str] | None = None) -> int:
    ap = argument_parser(__doc__)
    ap.add_argument("--time-scale", type=float, default=0.25)
    ap.add_argument("--clients", type=int, default=192)
    ap.add_argument("--warmup", type=float, default=90.0, help="modelled s")
    ap.add_argument("--duration", type=float, default=40.0, help="modelled s")
    ap.add_argument("--output-len", type=length_arg, default="uniform:64-256")
    ap.add_argument("--repeats", type=positive_int, default=3, help="pairs of phases")
    ap.add_argument("--quick", action="store_true")
    sglang_defaults_argument(ap)
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.warmup, args.duration = 15.0, 15.0
    t0 = time.monotonic()
    pairs = []
    try:
        for i in range(args.repeats):
            print(f"== repeat {i + 1} of {args.repeats}", flush=True)
            pairs.append((run_phase(args, 1, i + 1), run_phase(args, 2, i + 1)))
    except KeyboardInterrupt:
        print("interrupted; children stopped")
        return 130
    given = sys.argv[1:] if argv is None else argv
    lines = [
        f"## replicas: one proxy vs two replicas in front of pp8 + tp8, {args.clients} clients",
        "",
        f"Command: `python benchmarks/replicas.py {shlex.join(given)}` at {commit()}",
        "",
        f"Time scale {args.time_scale} (modelled seconds); warmup {args.warmup:g} s, window "
        f"{args.duration:g} s; 1024-token prompts, output {args.output_len}; adaptive limits; two "
        f"replicas get {args.clients // 2} closed-loop clients each"
        + (f" ({SURFACES[surface].text})" if (surface := surface_name(args)) else "")
        + ". Wall "
        f"{time.monotonic() - t0:.0f} s, {load_cpu()}.",
        "",
        "| repeat | backend | one proxy: in flight mean (p10-p90) | two replicas: combined in "
        "flight mean (p10-p90) | per replica | ratio two/one | SGLang's reqs one / two | final "
        "limits one / two | output tok/s one / two |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    ratios: dict[str, list[float]] = {prof: [] for prof in PROFILES}
    for i, (one, two) in enumerate(pairs, 1):
        for prof in PROFILES:
            a, b = one["backends"][prof], two["backends"][prof]
            mean = a["in_flight_mean"]
            ratio = b["in_flight_mean"] / mean if mean else float("nan")
            ratios[prof].append(ratio)
            lines.append(
                f"| {i} | {prof} | {a['in_flight_mean']:.1f} ({a['in_flight_p10_p90']}) | "
                f"{b['in_flight_mean']:.1f} ({b['in_flight_p10_p90']}) | "
                f"{' + '.join(f'{x:.1f}' for x in b['per_proxy_mean'])} | {ratio:.2f} | "
                f"{a['sglang_reqs_mean']:.1f} / {b['sglang_reqs_mean']:.1f} | "
                f"{a['limits_last']} / {b['limits_last']} | "
                f"{one['output_tok_s']:.0f} / {two['output_tok_s']:.0f} |"
            )
    medians, ok = verdict(ratios)
    lines += [
        "",
        "Median ratio two/one over the repeats: "
        + ", ".join(f"{prof} **{m:.2f}**" for prof, m in medians.items())
        + f"; repeats within {TOLERANCE:.0%}: "
        + ", ".join(
            f"{prof} {sum(abs(r - 1) <= TOLERANCE for r in rs)} of {len(rs)}"
            for prof, rs in ratios.items()
        )
        + ".",
        f"Target (median combined in flight within {TOLERANCE:.0%} of one proxy's, every "
        "backend): "
        f"**{'met' if ok else 'NOT met'}**.",
        "",
        "Combined in flight over time in the last repeat (modelled s from the start, every ~5 s):",
        "",
        "```",
        "     t  one proxy             two replicas",
    ]

    def buckets(series: list) -> dict[int, str]:
        out: dict[int, list] = {}
        for t, d in series:
            out.setdefault(int(t // 5) * 5, []).append(d)
        return {
            k: " ".join(f"{p}={statistics.fmean(x.get(p, 0) for x in v):.0f}" for p in PROFILES)
            for k, v in out.items()
        }

    one, two = pairs[-1]
    b1, b2 = buckets(one["series"]), buckets(two["series"])
    for t in sorted(set(b1) | set(b2)):
        lines.append(f"{t:6d}  {b1.get(t, ''):20}  {b2.get(t, '')}")
    lines.append("```")
    text = "\n".join(lines)
    print(text)
    if not args.no_save:
        write_results(
            "replicas"
            + (f"-{surface}" if (surface := surface_name(args)) else "")
            + ("-quick" if args.quick else ""),
            text,
            {"time_scale": args.time_scale, "args": vars(args),
             "repeats": [{"one": a, "two": b} for a, b in pairs], "ratios": ratios,
             "median_ratios": medians, "target_met": ok},
        )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
