"""Heterogeneous backends: pp8 + tp8 + ep8 simulators behind each routing policy, C = 4, 32, 128.

    .venv/bin/python benchmarks/heterogeneous.py            # ~11 min on 2 cores
    .venv/bin/python benchmarks/heterogeneous.py --repeats 1 --quick  # smoke, ~1.5 min

For each front end in turn — the proxy with policy `latency`, `round_robin`, `least_in_flight`
(adaptive limits, the pp backend hinted `pp_size = 8`), and sglang-router 0.3.2 with
`power_of_two` — a fresh `loadtest sim` process serving pp8, tp8 and ep8, the front end, and one
`loadtest run --concurrency 4,32,128` (closed loop; the levels run in that order against the same
front end, so the proxy's limits carry over from one level to the next, as in production).
The whole comparison is repeated ``--repeats`` times (every front end once per round, so a
busy stretch of the shared machine hits them alike): at C = 4 a 40 s window holds ~25 requests,
whose p99 is their maximum, and one run's C = 128 E2E p99 varied 22-51 s on the same code.
Printed: aggregate output tok/s and E2E p99 per policy and C (the median over the repeats, each
repeat's value beside it), and the margins of `latency` over each other policy on those medians
(tok/s: latency / other - 1; E2E p99: other / latency - 1; positive = latency better), with how
many repeats `latency` won on its own. Times are modelled seconds (the simulator runs at
--time-scale; loadtest reports in modelled time).
Results: benchmarks/results/heterogeneous.{md,json}.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from harness import (
    Harness,
    Poller,
    argument_parser,
    backend_entries,
    backends_by_name,
    get_json,
    get_text,
    length_arg,
    level_row,
    load_cpu,
    positive_int,
    proxy_toml,
    write_results,
)

PROFILES = ["pp8", "tp8", "ep8"]
FRONTS = ["latency", "round_robin", "least_in_flight", "router:power_of_two"]


def sim_served(urls: list[str]) -> dict[str, float]:
    """Requests each simulator served (its own counter): who got the traffic."""
    out = {}
    for prof, url in zip(PROFILES, urls, strict=True):
        text = get_text(f"{url}/metrics")
        out[prof] = sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("sglang:num_requests_total")
        )
    return out


def run_front(front: str, args: argparse.Namespace, tag: str = "") -> dict[str, Any]:
    """One front end against fresh simulators; ``tag`` names its work directory apart from
    other repeats' (/tmp/pipefill-bench-heterogeneous-<front><tag>-<pid>)."""
    ts = args.time_scale
    router = front.startswith("router:")
    with Harness(f"heterogeneous-{front.replace(':', '-')}{tag}", time_scale=ts) as h:
        sim = h.sim(PROFILES)
        if router:
            fe = h.router(sim.urls, front.split(":", 1)[1])
        else:
            cfg = proxy_toml(backend_entries(sim.urls, PROFILES), policy=front, time_scale=ts)
            fe = h.proxy(cfg)
        levels = ",".join(str(c) for c in args.concurrency)
        cmd = ["--concurrency", levels, "--warmup", str(args.warmup)]
        cmd += ["--duration", str(args.duration), "--drain-timeout", "0"]
        cmd += ["--input-len", "1024", "--output-len", args.output_len, "--seed", "7"]
        if args.save_records:
            cmd.append("--save-records")
        t0 = time.monotonic()
        poll = Poller(backends_by_name(fe.url) if not router else (lambda: None), interval=1.0)
        with poll:
            result = h.loadtest(fe.url, cmd, name=f"loadtest-{front}")
        wall = time.monotonic() - t0
        served = sim_served(sim.urls)
        final: dict[str, Any] = {n: {"served": int(c)} for n, c in served.items()}
        queue = None
        if poll.samples:
            for n, b in poll.samples[-1][1].items():
                final[n].update(limit=b["limit"], knee=(b.get("limit_state") or {}).get("knee"))
            queue = get_json(f"{fe.url}/admin/queue")
    rows = [
        {"front": front, "concurrency": lv["concurrency"], **level_row(lv)}
        for lv in result["levels"]
    ]
    return {"front": front, "rows": rows, "final_backends": final, "queue": queue, "wall_s": wall}


#: the numbers a repeat contributes to the median row of a (front end, C) pair
MEDIAN_KEYS = ["output_tok_s", "e2e_p50", "e2e_p99", "ttft_p99", "completed", "failed"]


def median_rows(repeats: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per (front end, C): the median of each number over the repeats, and every
    repeat's tok/s and E2E p99 (``per_repeat``)."""
    by: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for runs in repeats:
        for run in runs:
            for r in run["rows"]:
                by.setdefault((r["front"], r["concurrency"]), []).append(r)
    out = []
    for (front, c), rows in by.items():
        med = {
            k: statistics.median(r[k] for r in rows if r[k] is not None)
            if any(r[k] is not None for r in rows)
            else None
            for k in MEDIAN_KEYS
        }
        per = [{"output_tok_s": r["output_tok_s"], "e2e_p99": r["e2e_p99"]} for r in rows]
        out.append({"front": front, "concurrency": c, **med, "per_repeat": per})
    return out


def margins(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Margins of ``latency`` over every other front end at every C, on the median rows; with
    ``per_repeat`` rows also in how many repeats ``latency`` was better on both."""
    by = {(r["front"], r["concurrency"]): r for r in rows}
    out = []
    for c in sorted({k[1] for k in by}):
        lat = by.get(("latency", c))
        if lat is None:
            continue
        for front in FRONTS[1:]:
            o = by.get((front, c))
            if o is None:
                continue
            tok = lat["output_tok_s"] / o["output_tok_s"] - 1 if o["output_tok_s"] else None
            e2e = o["e2e_p99"] / lat["e2e_p99"] - 1 if lat["e2e_p99"] and o["e2e_p99"] else None
            beats = bool(tok is not None and e2e is not None and tok > 0 and e2e > 0)
            wins = [
                a["output_tok_s"] > b["output_tok_s"] and b["e2e_p99"] > a["e2e_p99"]
                for a, b in zip(lat.get("per_repeat", []), o.get("per_repeat", []), strict=False)
                if a["e2e_p99"] and b["e2e_p99"]
            ]
            out.append({"concurrency": c, "vs": front, "tok_s_margin": tok,
                        "e2e_p99_margin": e2e, "beats": beats,
                        "repeats_won": sum(wins), "repeats": len(wins)})  # fmt: skip
    return out


def run_round(args: argparse.Namespace, repeat: int = 1) -> list[dict[str, Any]]:
    """Every front end once (fresh simulators for each)."""
    runs = []
    for front in args.fronts.split(","):
        if not args.fresh_per_level:
            print(f"-- {front} ...", flush=True)
            runs.append(run_front(front, args, f"-r{repeat}"))
            continue
        parts = []
        for c in args.concurrency:  # fresh simulators and front end for every level
            print(f"-- {front} C={c} ...", flush=True)
            level = argparse.Namespace(**{**vars(args), "concurrency": [c]})
            parts.append(run_front(front, level, f"-r{repeat}-c{c}"))
        runs.append(
            {
                "front": front,
                "rows": [r for p in parts for r in p["rows"]],
                "final_backends": parts[-1]["final_backends"],
                "queue": parts[-1]["queue"],
                "wall_s": sum(p["wall_s"] for p in parts),
            }
        )
    return runs


def pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:+.1f}%"


def main(argv: list[str] | None = None) -> int:
    ap = argument_parser(__doc__)
    ap.add_argument("--time-scale", type=float, default=0.25)
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")],
                    default=[4, 32, 128])  # fmt: skip
    ap.add_argument("--warmup", type=float, default=20.0, help="modelled s before each window")
    ap.add_argument("--duration", type=float, default=40.0, help="modelled s measured per level")
    ap.add_argument("--output-len", type=length_arg, default="uniform:64-256")
    ap.add_argument("--fronts", default=",".join(FRONTS))
    ap.add_argument(
        "--fresh-per-level",
        action="store_true",
        help="fresh simulators and front end for every C (limits start over)",
    )
    ap.add_argument(
        "--save-records",
        action="store_true",
        help="keep every request's record (with the backend that served it) in the loadtest "
        "results under the harness's work directory (one per front end and repeat)",
    )
    ap.add_argument("--repeats", type=positive_int, default=3, help="rounds of every front end")
    ap.add_argument("--quick", action="store_true", help="short smoke run")
    ap.add_argument("--no-save", action="store_true", help="print only")
    args = ap.parse_args(argv)
    if args.quick:
        args.warmup, args.duration = 8.0, 12.0
    t0 = time.monotonic()
    repeats = []
    try:
        for i in range(args.repeats):
            if args.repeats > 1:
                print(f"== repeat {i + 1} of {args.repeats}", flush=True)
            repeats.append(run_round(args, i + 1))
    except KeyboardInterrupt:
        print("interrupted; children stopped")
        return 130
    rows = median_rows(repeats)
    ms = margins(rows)
    lines = [
        "## heterogeneous: pp8 + tp8 + ep8 simulators, closed-loop clients at "
        + ", ".join(f"C={c}" for c in args.concurrency),
        "",
        f"Simulator time scale {args.time_scale} (all times modelled seconds); per level warmup "
        f"{args.warmup:g} s, window {args.duration:g} s; 1024-token prompts, output "
        f"{args.output_len} tokens (ignore_eos). Proxy: adaptive limits (pp8 hinted pp_size 8); "
        "sglang-router 0.3.2 `power_of_two`. "
        + (
            "Every (front end, C) pair gets fresh simulators and a fresh front end (limits start "
            "over at each C). "
            if args.fresh_per_level
            else "Each front end gets fresh "
            "simulators; the C levels run in order against it (limits carry over). "
        )
        + f"Wall time {time.monotonic() - t0:.0f} s, {load_cpu()}.",
        "",
        f"Medians over {args.repeats} repeat(s); every repeat's tok/s and E2E p99 in the last "
        "column (in the order run).",
        "",
        "| C | front end | output tok/s | E2E p50 s | E2E p99 s | TTFT p99 s | completed "
        "| failed | per repeat: tok/s @ E2E p99 s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["concurrency"], FRONTS.index(r["front"]))):
        per = ", ".join(
            f"{x['output_tok_s']:.0f} @ {x['e2e_p99'] or 0:.1f}" for x in r["per_repeat"]
        )
        lines.append(
            f"| {r['concurrency']} | {r['front']} | {r['output_tok_s']:.0f} | "
            f"{r['e2e_p50'] or 0:.1f} | {r['e2e_p99'] or 0:.1f} | {r['ttft_p99'] or 0:.2f} | "
            f"{r['completed']:g} | {r['failed']:g} | {per} |"
        )
    lines += [
        "",
        "Margins of `latency` (tok/s: latency/other - 1; E2E p99: other/latency - 1; "
        "positive = latency better):",
        "",
        "| C | vs | tok/s margin | E2E p99 margin | latency better on both | repeats won |",
        "|---|---|---|---|---|---|",
    ]
    for m in ms:
        lines.append(
            f"| {m['concurrency']} | {m['vs']} | {pct(m['tok_s_margin'])} | "
            f"{pct(m['e2e_p99_margin'])} | {'yes' if m['beats'] else 'NO'} | "
            f"{m['repeats_won']} of {m['repeats']} |"
        )
    met = bool(ms) and all(m["beats"] for m in ms)
    lines += [
        "",
        "Target (latency beats every other policy on both, at every C; on the medians): "
        f"**{'met' if met else 'NOT met'}**.",
        "",
        "Per backend at the end of each run (requests the simulator served over all levels; "
        "the proxy's final limit and knee):",
        "",
    ]
    for i, runs in enumerate(repeats, 1):
        for run in runs:
            fb = ", ".join(
                f"{n}: " + " ".join(f"{k}={v}" for k, v in d.items())
                for n, d in run["final_backends"].items()
            )
            lines.append(f"- repeat {i}, {run['front']}: {fb}")
    text = "\n".join(lines)
    print(text)
    if not args.no_save:
        write_results(
            "heterogeneous"
            + ("-fresh" if args.fresh_per_level else "")
            + ("-quick" if args.quick else ""),
            text,
            {"time_scale": args.time_scale, "warmup": args.warmup, "duration": args.duration,
             "output_len": args.output_len, "repeats": repeats, "median_rows": rows,
             "margins": ms, "target_met": met},
        )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
