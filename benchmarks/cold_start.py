"""A real cold start in virtual time: the server's word first, then every client at once.

    .venv/bin/python benchmarks/cold_start.py --seeds 8832,8842 --out /tmp/cold   # seconds

A real proxy reads each backend's ``/server_info`` when it starts, before any client comes, so
the limit is set with nothing in flight and the clients then arrive together. For each generated
shape (loadtest/sim/shapes.py; twice its capacity in closed-loop clients, its own workload),
the adaptive limit and sending straight (a fixed limit at the client count) run in virtual time
(tests/limit_sim.py) with the clients ``--at`` s after the word. Reported per shape: output tok/s
through the limit over sending straight in the window from ``WARMUP_S`` to ``WARMUP_S +
WINDOW_S`` after the clients came (fill_any's and fill_shapes' real-socket window) and in the
first 10 s, and the limit's first decisions (code, limit, seconds after the clients came).
benchmarks/limit_shapes.py judges after two minutes with the clients at t = 0; this is the
start it does not see.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from fill_shapes import seed_list
from harness import commit, out_argument, write_results
from limit_shapes import adaptive_limit, fixed_limit
from limit_sim import SimRun, closed_loop_through_limit

from loadtest.sim.shapes import Shape, generate_shape

WARMUP_S = 5.0  # after the clients came
WINDOW_S = 25.0
FIRST_S = 10.0  # "a cold start reaches capacity within ~10 s of demand arriving"
DECISIONS = 4  # first decisions shown


def run_shape(shape: Shape, at: float) -> dict:
    clients = 2 * shape.est.capacity
    end = at + WARMUP_S + WINDOW_S

    def run(limit) -> SimRun:
        return closed_loop_through_limit(
            shape.profile, clients, limit, duration_s=end, input_len=shape.input_len,
            output_len=shape.output_len, seed=shape.seed, clients_at_s=at,
        )  # fmt: skip

    lim = adaptive_limit(shape.profile)
    adaptive, direct = run(lim), run(fixed_limit(clients))

    def ratio(t0: float, t1: float) -> float:
        d = direct.throughput(t0, t1)
        return adaptive.throughput(t0, t1) / d if d > 0 else float("nan")

    return {
        "shape": shape.name,
        "clients": clients,
        "window_ratio": ratio(at + WARMUP_S, end),
        "first_ratio": ratio(at, at + FIRST_S),
        "decisions": [
            [d.code.value, d.after, round(d.at - at, 1)] for d in lim.history if d.at > 0
        ][:DECISIONS],
    }


def report(rows: list[dict], args: argparse.Namespace) -> str:
    lines = [
        "## Cold start: the server's word first, then the clients (virtual time)",
        "",
        f"Command: `{args.command}` at {commit()}",
        "",
        f"Clients {args.at:g} s after the word; tok/s through the adaptive limit over sending "
        f"straight, {WARMUP_S:g}-{WARMUP_S + WINDOW_S:g} s and 0-{FIRST_S:g} s after they came.",
        "",
        "| shape | clients | window ratio | first 10 s ratio | first decisions (s after) |",
        "|---|---:|---:|---:|---|",
    ]
    for r in rows:
        dec = ", ".join(f"{c} {n} @{t}" for c, n, t in r["decisions"])
        lines.append(
            f"| {r['shape']} | {r['clients']} | {r['window_ratio']:.3f} | "
            f"{r['first_ratio']:.3f} | {dec} |"
        )
    ratios = [r["window_ratio"] for r in rows]
    lines += ["", f"Window ratio: min {min(ratios):.3f}, median {statistics.median(ratios):.3f}."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--seeds",
        type=seed_list,
        required=True,
        help="shape seeds (acceptance split), e.g. 8832,8842",
    )
    ap.add_argument("--at", type=float, default=2.0, help="clients this many s after the word")
    out_argument(ap, "cold_start")
    args = ap.parse_args(argv)
    given = sys.argv[1:] if argv is None else argv
    args.command = " ".join(["python benchmarks/cold_start.py", *given])
    rows = [run_shape(generate_shape(s), args.at) for s in args.seeds]
    md = report(rows, args)
    print(md)
    if args.out:
        write_results("cold_start", md, {"command": args.command, "rows": rows}, Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
