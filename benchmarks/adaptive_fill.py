"""Filling the pipeline: a pp8 simulator behind the proxy, closed-loop clients, adaptive vs fixed.

    .venv/bin/python benchmarks/adaptive_fill.py                 # ~11 min on 2 cores
    .venv/bin/python benchmarks/adaptive_fill.py --fixed 32,64 --duration 60

For the adaptive limit and each fixed limit of a sweep, in turn: a fresh `loadtest sim --profile
pp8`, a fresh `proxy` in front of it (the backend declared `parallelism = "pp"`, `pp_size = 8`),
and `loadtest run --concurrency 64` through the proxy. While it runs, /admin/backends is polled
for the limit. Printed: output tok/s and TTFT p99 of every configuration, the adaptive one's ratio
to the best fixed limit, and when the adaptive limit first reached 90% of its final knee
(modelled seconds from the proxy's start). Results: benchmarks/results/adaptive_fill.{json,md}.

Everything runs on 127.0.0.1 with free ports; the simulator runs at --time-scale (the proxy's
observation windows and scrape interval are scaled with it, i.e. they are 1 modelled second);
every process is stopped at the end of its run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

from harness import free_port, get_json, stop, wait_ready

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
RESULTS = REPO / "benchmarks" / "results"


def proxy_config(port: int, sim_port: int, ts: float, limit: int | None) -> str:
    limits = f'algorithm = "fixed"\ninitial = {limit}' if limit else 'algorithm = "adaptive"'
    return f"""
[server]
host = "127.0.0.1"
port = {port}
shutdown_grace_s = 2
drain_s = 0

[queue]
deadline_s = 3600

[scrape]
interval_s = {max(ts, 0.1)}

[limits]
{limits}
window_s = {ts}
max_window_s = {5 * ts}

[[backends]]
name = "pp8"
url = "http://127.0.0.1:{sim_port}"
parallelism = "pp"
pp_size = 8
"""


def run_one(label: str, limit: int | None, args: argparse.Namespace, workdir: Path) -> dict:
    ts = args.time_scale
    sim_port, proxy_port = free_port(), free_port()
    cfg = workdir / f"proxy-{label}.toml"
    cfg.write_text(proxy_config(proxy_port, sim_port, ts, limit))
    out = workdir / f"run-{label}.json"
    procs: list[subprocess.Popen] = []
    trace: list[tuple[float, int, int | None, int]] = []
    stop_poll = threading.Event()
    try:
        with open(workdir / f"sim-{label}.log", "wb") as log:
            procs.append(
                subprocess.Popen(
                    [
                        str(BIN / "loadtest"),
                        "sim",
                        "--profile",
                        "pp8",
                        "--port",
                        str(sim_port),
                        "--time-scale",
                        str(ts),
                        "--seed",
                        "1",
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
        wait_ready(f"http://127.0.0.1:{sim_port}/health")
        with open(workdir / f"proxy-{label}.log", "wb") as log:
            procs.append(
                subprocess.Popen(
                    [str(BIN / "proxy"), "--config", str(cfg), "--log-level", "warning"],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
        wait_ready(f"http://127.0.0.1:{proxy_port}/health")
        t0 = time.monotonic()

        def poll() -> None:
            while not stop_poll.is_set():
                d = get_json(f"http://127.0.0.1:{proxy_port}/admin/backends")
                if isinstance(d, dict) and d.get("backends"):
                    b = d["backends"][0]
                    knee = (b.get("limit_state") or {}).get("knee")
                    trace.append(((time.monotonic() - t0) / ts, b["limit"], knee, b["in_flight"]))
                stop_poll.wait(ts)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        cmd = [
            str(BIN / "loadtest"),
            "run",
            "--url",
            f"http://127.0.0.1:{proxy_port}",
            "--concurrency",
            str(args.clients),
            "--duration",
            str(args.duration),
            "--warmup",
            str(args.warmup),
            "--time-scale",
            str(ts),
            "--input-len",
            "1024",
            "--output-len",
            "uniform:256-768",
            "--drain-timeout",
            "0",
            "--out",
            str(out),
            "--quiet",
        ]
        with open(workdir / f"loadtest-{label}.log", "wb") as log:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
        stop_poll.set()
        poller.join(timeout=5)
        if rc != 0:
            raise RuntimeError(f"loadtest failed for {label} (see {workdir}/loadtest-{label}.log)")
    finally:
        stop_poll.set()
        for p in reversed(procs):
            stop(p)
    level = json.loads(out.read_text())["levels"][0]
    return {
        "label": label,
        "limit": limit,
        "output_tok_s": level["output_tok_s"],
        "ttft_p50": level["ttft"]["p50"],
        "ttft_p99": level["ttft"]["p99"],
        "e2e_p99": level["e2e"]["p99"],
        "completed": level["completed"],
        "failed": level["failed"],
        "achieved_concurrency": level["achieved_concurrency"],
        "trace": trace,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-scale", type=float, default=0.5)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--duration", type=float, default=90.0, help="modelled seconds measured")
    ap.add_argument(
        "--warmup",
        type=float,
        default=120.0,
        help="modelled seconds before the window: long enough that the requests which waited in "
        "the proxy's queue while the adaptive limit climbed (first ~25 s) have finished (up to "
        "~100 s later with 768-token answers)",
    )
    ap.add_argument("--fixed", default="16,32,48,64,96", help="fixed limits to sweep")
    ap.add_argument("--out", type=Path, default=RESULTS / "adaptive_fill")
    args = ap.parse_args()
    fixed = [int(x) for x in args.fixed.split(",") if x]
    workdir = Path("/tmp") / f"adaptive_fill-{int(time.time())}"
    workdir.mkdir(parents=True, exist_ok=True)
    runs = [run_one("adaptive", None, args, workdir)]
    for n in fixed:
        runs.append(run_one(f"fixed-{n}", n, args, workdir))
    adaptive, sweep = runs[0], runs[1:]
    best = max(sweep, key=lambda r: r["output_tok_s"])
    knee = next((k for _, _, k, _ in reversed(adaptive["trace"]) if k), None)
    reached = None
    if knee:
        reached = next((t for t, lim, _, _ in adaptive["trace"] if lim >= 0.9 * knee), None)
    tput_ratio = adaptive["output_tok_s"] / best["output_tok_s"]
    ttft_ratio = (
        adaptive["ttft_p99"] / best["ttft_p99"]
        if best["ttft_p99"] and adaptive["ttft_p99"] is not None
        else float("nan")
    )
    lines = [
        f"## adaptive_fill: pp8 simulator (time scale {args.time_scale}) behind the proxy, "
        f"{args.clients} closed-loop clients",
        "",
        f"1024-token prompts, uniform 256-768 output tokens; warmup {args.warmup:.0f} s, "
        f"window {args.duration:.0f} s (modelled). TTFT is the clients' (includes the wait in "
        "the proxy's queue). Requests still running when the window ends are cancelled (not "
        "counted).",
        "",
        "| limit | output tok/s | TTFT p50 s | TTFT p99 s | E2E p99 s | completed in window |",
        "|---|---|---|---|---|---|",
    ]

    def cell(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)  # no completion in the window

    for r in runs:
        lines.append(
            f"| {r['label']} | {cell(r['output_tok_s'], '.0f')} | {cell(r['ttft_p50'], '.2f')} | "
            f"{cell(r['ttft_p99'], '.2f')} | {cell(r['e2e_p99'], '.1f')} | {r['completed']} |"
        )
    lines += [
        "",
        f"Best fixed limit: {best['label']}. Adaptive / best fixed: throughput "
        f"**{tput_ratio:.3f}** (target >= 0.95), TTFT p99 **{ttft_ratio:.2f}x** (target <= 1.2).",
        f"Adaptive knee {knee}; the limit first reached 90% of it "
        f"{'never' if reached is None else f'at {reached:.1f} s'} (modelled, from the proxy's "
        "start; target <= 30 s).",
        "",
        "Adaptive limit over time (modelled s, limit, knee, in flight), every ~5 s:",
        "",
        "```",
    ]
    last_t = -1e9
    for t, lim, k, inf in adaptive["trace"]:
        if t - last_t >= 5:
            lines.append(f"{t:6.1f}  {lim:4d}  {k!s:>4}  {inf:4d}")
            last_t = t
    lines.append("```")
    text = "\n".join(lines)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(text + "\n")
    summary = {
        "time_scale": args.time_scale,
        "clients": args.clients,
        "duration": args.duration,
        "warmup": args.warmup,
        "runs": runs,
        "best_fixed": best["label"],
        "throughput_ratio": tput_ratio,
        "ttft_p99_ratio": ttft_ratio,
        "knee": knee,
        "reached_90pct_knee_s": reached,
    }
    args.out.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
