"""How much load can one `loadtest run` process generate and still measure correctly?

Runs the simulator with a near-zero-cost profile (every cost 0 except a fixed step time, so
each stream receives one token every STEP ms whatever the batch) and a `loadtest run` client
against it, at increasing concurrency. For each level it prints the token events per second
the client received, the client's dispatch delay p99, event-loop lag p99 and CPU, and the
simulator's CPU, side by side. The client "sustains" a level when dispatch delay p99 < 1 ms
and it received the events the server meant to send (not coalesced because someone was slow).

    python benchmarks/loadgen_capacity.py                      # default levels
    python benchmarks/loadgen_capacity.py --levels 500,1000 --step-ms 20 --duration 8
    python benchmarks/loadgen_capacity.py --processes 2        # also try --processes 2

Both processes share this machine's cores, so the simulator's own CPU bounds what can be
reached; the table shows both. Results: benchmarks/results/loadgen_capacity.txt.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parent.parent
LOADTEST = [sys.executable, "-m", "loadtest.cli"]

PROFILE = """
name = "zero"
description = "near-zero costs: a fixed step time, nothing else (client capacity benchmark)"
model_name = "zero"
parallelism = "tp"
context_length = 1000000
max_running_requests = 100000
max_total_tokens = 1000000000
chunked_prefill_size = 1000000
num_layers = 1
step_overhead_ms = {step}
weights_ms = 0.0
expert_read_ms = 0.0
compute_ms_per_token = 0.0
prefill_ms_per_token = 0.0
comm_ops_per_layer = 0
comm_latency_us = 0.0
comm_us_per_token = 0.0
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_port(port: int, proc: subprocess.Popen, limit: float = 20.0) -> None:
    deadline = time.monotonic() + limit
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"simulator did not start: {proc.stderr.read().decode()[-500:]}")
            time.sleep(0.05)


def run_level(url: str, c: int, args: argparse.Namespace, processes: int, sim_pid: int) -> dict:
    out = Path(tempfile.mkstemp(suffix=".json")[1])
    # requests of ~request_s each: enough turnover to measure the dispatch delay
    output_len = max(int(args.request_s * 1000 / args.step_ms), 2)
    cmd = [*LOADTEST, "run", "--url", url, "-c", str(c), "--warmup", str(args.warmup),
           "--duration", str(args.duration), "--drain-timeout", "1", "--input-len", "8",
           "--output-len", str(output_len), "--processes", str(processes), "--quiet",
           "--out", str(out), "--save-records"]  # fmt: skip
    sim0 = cpu_seconds(sim_pid)
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    wall = time.monotonic() - t0
    sim_cpu = (cpu_seconds(sim_pid) - sim0) / wall
    if proc.returncode not in (0,):
        return {"c": c, "error": proc.stderr.strip().splitlines()[-1:]}
    data = orjson.loads(out.read_bytes())
    out.unlink()
    level = data["levels"][0]
    w0, w1 = level["window"]
    events = sum(1 for r in data["records"] for t in r["token_times"] if w0 <= t < w1)
    check = level["selfcheck"] or {}
    return {
        "c": c,
        "processes": processes,
        "target_events_s": c * 1000 / args.step_ms,
        "events_s": events / (w1 - w0),
        "tok_s": level["output_tok_s"],
        "achieved_c": level["achieved_concurrency"],
        "dispatch_p99_ms": (check.get("dispatch_delay_p99_s") or 0) * 1e3,
        "loop_lag_p99_ms": (check.get("loop_lag_p99_s") or 0) * 1e3,
        "client_cpu": check.get("client_cpu") or 0.0,
        "sim_cpu": sim_cpu,
        "errors": sum((level.get("errors") or {}).values()),
        "client_bound": bool(check.get("client_bound")),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--levels", default="100,250,500,1000,1500")
    ap.add_argument("--step-ms", type=float, default=20.0, help="modelled step time (ms)")
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--request-s", type=float, default=2.0, help="length of one request (s)")
    ap.add_argument("--duration", type=float, default=8.0)
    ap.add_argument("--processes", type=int, default=1, help="also run the top level with N")
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]

    profile = Path(tempfile.mkstemp(suffix=".toml")[1])
    profile.write_text(PROFILE.format(step=args.step_ms))
    port = free_port()
    sim = subprocess.Popen(
        [*LOADTEST, "sim", "--profile", str(profile), "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT,
    )  # fmt: skip
    rows = []
    try:
        wait_port(port, sim)
        url = f"http://127.0.0.1:{port}"
        runs = [(c, 1) for c in levels]
        if args.processes > 1:
            runs += [(c, args.processes) for c in levels[-2:]]
        for c, p in runs:
            row = run_level(url, c, args, p, sim.pid)
            rows.append(row)
            print(_fmt(row), flush=True)
    finally:
        sim.terminate()
        sim.wait(10)
        profile.unlink()

    print()
    per_stream = 1000 / args.step_ms
    print(f"machine: {os.cpu_count()} CPUs; step {args.step_ms:g} ms => "
          f"{per_stream:g} token events/s per stream; window {args.duration:g} s")  # fmt: skip
    ok = [r for r in rows if "error" not in r and r["dispatch_p99_ms"] < 1.0]
    print("dispatch p99 < 1 ms at: " + ", ".join(f"C={r['c']}x{r['processes']}" for r in ok))
    ok = [r for r in ok if r["events_s"] >= 0.95 * r["target_events_s"]]
    if ok:
        best = max(ok, key=lambda r: r["c"])
        print(f"highest sustained: C={best['c']} ({best['processes']} process(es)), "
              f"{best['events_s']:.0f} token events/s, "
              f"dispatch p99 {best['dispatch_p99_ms']:.2f} ms")  # fmt: skip
    else:
        print("no level sustained (dispatch p99 < 1 ms and >= 95% of the events)")


HEADER = (f"{'C':>6} {'procs':>5} {'target ev/s':>12} {'events/s':>10} {'tok/s':>10} "
          f"{'achieved C':>10} {'disp p99 ms':>11} {'lag p99 ms':>10} {'client CPU':>10} "
          f"{'sim CPU':>8} {'errors':>6}")  # fmt: skip


def _fmt(r: dict) -> str:
    if "error" in r:
        return f"{r['c']:>6}  failed: {r['error']}"
    line = (f"{r['c']:>6} {r['processes']:>5} {r['target_events_s']:>12.0f} {r['events_s']:>10.0f} "
            f"{r['tok_s']:>10.0f} {r['achieved_c']:>10.1f} {r['dispatch_p99_ms']:>11.2f} "
            f"{r['loop_lag_p99_ms']:>10.2f} {r['client_cpu']:>10.0%} {r['sim_cpu']:>8.0%} "
            f"{r['errors']:>6}")  # fmt: skip
    if not getattr(_fmt, "printed", False):
        _fmt.printed = True  # type: ignore[attr-defined]
        return HEADER + "\n" + line
    return line


if __name__ == "__main__":
    main()
