"""Prefix-cache-aware routing: 4 simulators with a radix cache, side by side behind each front end.

    .venv/bin/python benchmarks/prefix_routing.py             # ~20 min on 2 cores
    .venv/bin/python benchmarks/prefix_routing.py --quick     # smoke, ~8 min

Front ends, each against fresh simulators (four `tp-prefix` backends, one `loadtest sim`
process each, with ``--enable-cache-report``, so cached tokens show in every response's usage):
pipefill's latency policy with prefix affinity, the same without (``prefix_affinity = false``),
sglang-router ``cache_aware`` (its defaults: cache_threshold 0.3, balance thresholds 64 / 1.5x)
and ``round_robin``.

Workloads (closed loop, chat API, one level of ``--concurrency`` clients):

- ``shared-prefix``: ``GROUPS`` system prompts of ``PREFIX_TOKENS`` tokens, each request one of
  them (uniformly) plus a unique question: together about twice the prefix one backend's KV
  pool holds beside its running requests (benchmarks/profiles/tp-prefix.toml), about half of
  what four hold (with 24 groups, barely more than one: routing without affinity hit 63%);
- ``multi-turn``: every client keeps a conversation of up to ``TURNS`` turns (each turn re-sends
  the history and the answer it got, then a question of ``TURN_WORDS``), then starts a new one.
  Sized as ``shared-prefix`` is: at 96 clients the histories (~720 tokens on average with
  128-token answers) together are about twice what one backend's pool holds beside its
  running requests, about half of what four hold. Where histories outgrow even four pools
  (questions of 256 tokens: the running requests alone nearly fill each pool) every router hit
  ~40% and affinity gained 1.04x (results/history/2026-12-06/prefix_routing-c6871fa.md).
  Each client sends its next turn at once unless ``--turn-delay`` gives it a think time: at
  once, the slot its answer freed is still free, so routing by load alone keeps a conversation
  on the backend that holds its history (results/prefix_routing-multi-turn-think.md);
- ``skewed``: ``shared-prefix`` with one group carrying ``SKEW`` of the traffic.

The simulators run in real time (``--time-scale 1.0``): sped up (0.25), four simulators, the
load generator and a Python front end overcommit two cores (load average ~2.5), and whatever CPU
a front end takes shows as backend latency (pool96k shared-prefix: pipefill's TTFT p50 0.33 s
at 0.25, the median of two runs, against 0.07 s at 1.0 in one run; sglang-router
``cache_aware``'s 0.27 s against 0.10 s; load average ~1.1 at 1.0).

Reported per (workload, front end): output tok/s, TTFT p50/p99, E2E p99 (modelled seconds, the
loadtest window), and the cache hit rate twice: what the responses said (the loadtest's
cached / prompt tokens over the window) and what the servers counted
(``sglang:cached_tokens_total`` / ``sglang:prompt_tokens_total`` over the whole run), with the
requests each backend served. Targets (issue 16): shared-prefix and multi-turn: affinity >= 1.0x
``cache_aware`` tok/s with TTFT p99 <= 0.7x its and >= 1.3x pipefill without affinity; skewed:
>= 1.2x ``cache_aware`` tok/s with TTFT p99 <= 0.5x its.
Results: benchmarks/results/prefix_routing.{md,json}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from harness import (
    Harness,
    backend_entries,
    get_json,
    get_text,
    level_row,
    load_cpu,
    positive_int,
    proxy_toml,
    write_results,
)

PROFILE = str(Path(__file__).resolve().parent / "profiles" / "tp-prefix.toml")
BACKENDS = 4
FRONTS = ["affinity", "no-affinity", "router:cache_aware", "router:round_robin"]
GROUPS = 48
PREFIX_TOKENS = 2048
TURNS = 8
TURN_WORDS = 32
SKEW = 0.8
WORKLOADS: dict[str, list[str]] = {
    "shared-prefix": ["--workload", "shared-prefix", "--prefix-groups", str(GROUPS),
                      "--prefix-tokens", str(PREFIX_TOKENS), "--input-len", "256"],
    "multi-turn": ["--workload", "multi-turn", "--turns", str(TURNS),
                   "--input-len", str(TURN_WORDS)],
    "skewed": ["--workload", "shared-prefix", "--prefix-groups", str(GROUPS),
               "--prefix-tokens", str(PREFIX_TOKENS), "--prefix-skew", str(SKEW),
               "--input-len", "256"],
}  # fmt: skip


def server_counts(urls: list[str]) -> dict[str, dict[str, float]]:
    """Per backend: requests served, prompt and cached tokens (the simulator's own counters)."""
    out = {}
    for i, url in enumerate(urls):
        totals = {"requests": 0.0, "prompt": 0.0, "cached": 0.0}
        for line in get_text(f"{url}/metrics").splitlines():
            for key, name in (("requests", "sglang:num_requests_total"),
                              ("prompt", "sglang:prompt_tokens_total"),
                              ("cached", "sglang:cached_tokens_total")):  # fmt: skip
                if line.startswith(name):
                    totals[key] += float(line.rsplit(" ", 1)[1])
        out[f"b{i}"] = totals
    return out


def run_one(workload: str, front: str, args: argparse.Namespace, tag: str) -> dict[str, Any]:
    """One front end on one workload, against fresh simulators."""
    ts = args.time_scale
    with Harness(f"prefix-{workload}-{front.replace(':', '-')}{tag}", time_scale=ts) as h:
        report = [] if args.no_cache_report else ["--enable-cache-report"]
        urls = h.sims([args.profile] * BACKENDS, extra=report, seed=args.seed)
        if front.startswith("router:"):
            fe = h.router(urls, front.split(":", 1)[1])
        else:
            entries = backend_entries(urls, ["tp"] * BACKENDS)
            for i, e in enumerate(entries):
                e["name"] = f"b{i}"
            routing = {"policy": "latency", "prefix_affinity": front == "affinity"}
            if args.load_factor is not None:
                routing["prefix_load_factor"] = args.load_factor
            if args.lookahead is not None:
                routing["prefix_lookahead"] = args.lookahead
            limits = {"algorithm": "fixed", "initial": args.fixed} if args.fixed else {}
            fe = h.proxy(proxy_toml(entries, time_scale=ts, routing=routing, limits=limits))
        cmd = ["--api", "chat", "--concurrency", str(args.concurrency)]
        cmd += ["--warmup", str(args.warmup), "--duration", str(args.duration)]
        cmd += ["--drain-timeout", "0", "--output-len", args.output_len, "--seed", "7"]
        cmd += WORKLOADS[workload]
        if workload == "multi-turn" and args.turn_delay:
            cmd += ["--turn-delay", str(args.turn_delay)]
        t0 = time.monotonic()
        result = h.loadtest(fe.url, cmd, name=f"loadtest-{workload}-{front}")
        wall = time.monotonic() - t0
        servers = server_counts(urls)
        proxy_view = None
        if not front.startswith("router:"):
            backends = get_json(f"{fe.url}/admin/backends").get("backends", [])
            proxy_view = {
                "limits": {b["name"]: b["limit"] for b in backends},
                "queue": get_json(f"{fe.url}/admin/queue"),
                "prefix": get_json(f"{fe.url}/admin/prefix"),
            }
    level = result["levels"][0]
    prompt = sum(s["prompt"] for s in servers.values())
    cached = sum(s["cached"] for s in servers.values())
    return {
        "workload": workload,
        "front": front,
        **level_row(level),
        "hit_rate_reported": (level.get("cache") or {}).get("hit_rate"),
        "hit_rate_servers": cached / prompt if prompt else None,
        "served": {n: int(s["requests"]) for n, s in servers.items()},
        "proxy": proxy_view,
        "wall_s": wall,
    }


KEYS = ["output_tok_s", "ttft_p50", "ttft_p99", "e2e_p99", "hit_rate_reported",
        "hit_rate_servers", "completed", "failed"]  # fmt: skip


def median_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (workload, front end): the median of each number over the repeats."""
    by: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in runs:
        by.setdefault((r["workload"], r["front"]), []).append(r)
    out = []
    for (wl, front), rows in by.items():
        med = {}
        for k in KEYS:
            vals = [r[k] for r in rows if r[k] is not None]
            med[k] = statistics.median(vals) if vals else None
        out.append({"workload": wl, "front": front, **med,
                    "per_repeat": [r["output_tok_s"] for r in rows],
                    "served": [r["served"] for r in rows]})  # fmt: skip
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def verdicts(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's bars, on the median rows, per workload."""
    by = {(r["workload"], r["front"]): r for r in rows}
    out = []
    for wl in WORKLOADS:
        aff, ca = by.get((wl, "affinity")), by.get((wl, "router:cache_aware"))
        off = by.get((wl, "no-affinity"))
        if aff is None or ca is None:
            continue
        tok = _ratio(aff["output_tok_s"], ca["output_tok_s"])
        ttft = _ratio(aff["ttft_p99"], ca["ttft_p99"])
        vs_off = _ratio(aff["output_tok_s"], off["output_tok_s"]) if off else None
        if wl == "skewed":
            met = tok is not None and ttft is not None and tok >= 1.2 and ttft <= 0.5
            bar = ">= 1.2x cache_aware tok/s, TTFT p99 <= 0.5x"
        else:
            met = (tok is not None and ttft is not None and vs_off is not None
                   and tok >= 1.0 and ttft <= 0.7 and vs_off >= 1.3)  # fmt: skip
            bar = ">= 1.0x cache_aware tok/s, TTFT p99 <= 0.7x, >= 1.3x no-affinity tok/s"
        out.append({"workload": wl, "tok_vs_cache_aware": tok, "ttft_p99_vs_cache_aware": ttft,
                    "tok_vs_no_affinity": vs_off, "bar": bar, "met": met})  # fmt: skip
    return out


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def report(args: argparse.Namespace, rows: list[dict[str, Any]], wall: float) -> str:
    lines = [
        f"## prefix routing: {BACKENDS} `{Path(args.profile).stem}` simulators (radix cache, "
        f"{PREFIX_TOKENS}-token prefixes), {args.concurrency} closed-loop clients",
        "",
        f"Command: `{' '.join(['python benchmarks/prefix_routing.py', *sys.argv[1:]])}`. "
        f"Simulator time scale "
        f"{args.time_scale} (times in modelled seconds); warmup {args.warmup:g} s, window "
        f"{args.duration:g} s; chat API, questions of 256 tokens (multi-turn: {TURN_WORDS} per "
        f"turn), output {args.output_len} tokens. shared-prefix: {GROUPS} groups; multi-turn: "
        f"up to {TURNS} turns; skewed: one "
        f"of {GROUPS} groups carries {SKEW:.0%}. Wall time {wall:.0f} s, {load_cpu()}.",
        "",
        f"Medians over {args.repeats} repeat(s). Hit rate: cached / prompt tokens, as the "
        "responses reported them in the window, and as the servers counted them over the run.",
        "",
        "| workload | front end | output tok/s | TTFT p50 s | TTFT p99 s | E2E p99 s | hit rate "
        "(responses) | hit rate (servers) | requests per backend | failed |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (list(WORKLOADS).index(r["workload"]),
                                         FRONTS.index(r["front"]))):  # fmt: skip
        served = " / ".join(str(v) for v in r["served"][-1].values())
        lines.append(
            f"| {r['workload']} | {r['front']} | {fmt(r['output_tok_s'], '.0f')} | "
            f"{fmt(r['ttft_p50'])} | {fmt(r['ttft_p99'])} | {fmt(r['e2e_p99'])} | "
            f"{fmt(r['hit_rate_reported'], '.1%')} | {fmt(r['hit_rate_servers'], '.1%')} | "
            f"{served} | {fmt(r['failed'], 'g')} |"
        )
    lines += [
        "",
        "| workload | affinity / cache_aware tok/s | TTFT p99 ratio | "
        "affinity / no-affinity tok/s | bar | met |",
        "|---|---|---|---|---|---|",
    ]
    for v in verdicts(rows):
        lines.append(
            f"| {v['workload']} | {fmt(v['tok_vs_cache_aware'])} | "
            f"{fmt(v['ttft_p99_vs_cache_aware'])} | {fmt(v['tok_vs_no_affinity'])} | {v['bar']} "
            f"| {'yes' if v['met'] else 'NO'} |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-scale", type=float, default=1.0,
                    help="modelled s per wall s (see the module docstring)")  # fmt: skip
    ap.add_argument("--concurrency", type=positive_int, default=96)
    ap.add_argument("--warmup", type=float, default=30.0, help="modelled s before the window")
    ap.add_argument("--duration", type=float, default=60.0, help="modelled s measured")
    ap.add_argument("--output-len", default="128")
    ap.add_argument("--turn-delay", type=float, default=0.0,
                    help="multi-turn: mean modelled s a client thinks between turns")  # fmt: skip
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--fronts", default=",".join(FRONTS))
    ap.add_argument("--repeats", type=positive_int, default=1)
    ap.add_argument("--seed", type=int, default=1, help="simulator seed")
    ap.add_argument("--fixed", type=positive_int, default=None,
                    help="pipefill with a fixed limit per backend instead of adaptive")  # fmt: skip
    ap.add_argument("--load-factor", type=float, default=None,
                    help="pipefill's [routing] prefix_load_factor (default: its own)")  # fmt: skip
    ap.add_argument("--no-cache-report", action="store_true",
                    help="simulators without --enable-cache-report (SGLang's default): responses "
                    "carry no cached_tokens, so the proxy cannot correct its index")  # fmt: skip
    ap.add_argument("--lookahead", type=positive_int, default=None,
                    help="pipefill's [routing] prefix_lookahead (1: FIFO, no holding)")  # fmt: skip
    ap.add_argument("--profile", default=PROFILE,
                    help="simulator profile of the four backends (default: tp-prefix)")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="short smoke run")
    ap.add_argument("--out", type=Path, help="results path without suffix (.md and .json)")
    ap.add_argument("--no-save", action="store_true", help="print only")
    ap.add_argument("--verbose", action="store_true", help="print the proxy's view of each run")
    args = ap.parse_args()
    for name, known in ((args.workloads, WORKLOADS), (args.fronts, FRONTS)):
        bad = [x for x in name.split(",") if x not in known]
        if bad:
            ap.error(f"unknown {', '.join(bad)}; choose from {', '.join(known)}")
    profile = Path(args.profile)
    if profile.suffix == ".toml":
        if not profile.is_file():
            ap.error(f"no profile file {args.profile}")
        args.profile = str(profile.resolve())  # the simulators run in another directory
    if args.quick:
        args.warmup, args.duration = 10.0, 20.0
    t0 = time.monotonic()
    runs = []
    try:
        for i in range(args.repeats):
            for wl in args.workloads.split(","):
                for front in args.fronts.split(","):
                    print(f"-- {wl} / {front} (repeat {i + 1})", flush=True)
                    runs.append(run_one(wl, front, args, f"-r{i + 1}"))
    except KeyboardInterrupt:
        print("interrupted; children stopped")
        return 130
    rows = median_rows(runs)
    text = report(args, rows, time.monotonic() - t0)
    print(text)
    if args.verbose:
        for r in runs:
            print(r["workload"], r["front"], r["proxy"])
    if not args.no_save:
        write_results(
            "prefix_routing" + ("-quick" if args.quick else ""),
            text,
            {"args": vars(args), "runs": runs, "median_rows": rows, "verdicts": verdicts(rows)},
            args.out,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
