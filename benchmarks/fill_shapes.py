"""Fill generated shapes over real sockets: one backend each, direct vs through pipefill.

    .venv/bin/python benchmarks/fill_shapes.py                  # 12 shapes, ~25 min on 2 cores
    .venv/bin/python benchmarks/fill_shapes.py --shapes 3 --out /tmp/x   # smoke

benchmarks/limit_shapes.py judges the adaptive limit against many generated engine shapes in
virtual time; fill_any.py judges it over real sockets on five hand-written profiles. This is
the two together, as a user would meet a backend nobody tuned on: each shape from
loadtest/sim/shapes.py (its own seeds, from ``--seed-base``, kept apart from the virtual-time
sets) becomes a `loadtest sim` process, and twice its estimated capacity in closed-loop clients
send it the shape's own workload (its prompt length, its range of answer lengths, ignore_eos,
streamed chat), first directly and then through pipefill (adaptive limit, the shape's
parallelism and pp_size as hints), each against a fresh simulator. Shapes a real-time run on two
cores cannot afford (answers longer than ``MAX_REQUEST_S`` at capacity, more than
``MAX_TOKENS_PER_S`` or ``MAX_CAPACITY`` in flight) are skipped, and the report says how many.

Each arm: warmup ``max(--warmup, WARMUP_REQUESTS x a request's time)``, then a window of
``max(--duration, WINDOW_REQUESTS x it)`` (modelled s). Verdict per shape (issue 14's real-socket
bar): via pipefill >= ``MIN_RATIO`` x direct output tok/s. Results:
benchmarks/results/fill_shapes.{md,json} with --out.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fill_any import closed, f, ratio, run_arm
from harness import (
    argument_parser,
    commit,
    load_cpu,
    out_argument,
    positive_int,
    sglang_defaults_argument,
    toml_table,
    write_results,
)

from loadtest.sim.shapes import SPLITS, Shape, generate_shape

#: what a real-time run on two cores affords (a shape beyond any of these is skipped)
MAX_REQUEST_S = 12.0  # one request at capacity, prefill included (modelled s)
MAX_TOKENS_PER_S = 2000.0  # output tokens/s at capacity: the simulator is one Python process
MAX_CAPACITY = 192  # requests it runs at once (twice that many clients)
CLIENT_FACTOR = 2  # clients per request the backend runs: more demand than it can run
WARMUP_REQUESTS = 1.5  # warmup: at least this many request times
WINDOW_REQUESTS = 3.0  # window: at least this many request times
MIN_RATIO = 0.95  # via pipefill / direct output tok/s, every shape
DEFAULT_SEED_BASE = 9000  # kept apart from limit_shapes' acceptance sets (<9000)


def affordable(shape: Shape) -> bool:
    e = shape.est
    return (
        e.request_s <= MAX_REQUEST_S
        and e.tokens_per_s <= MAX_TOKENS_PER_S
        and e.capacity <= MAX_CAPACITY
    )


def pick_shapes(base: int, n: int, parallelism: str | None = None) -> tuple[list[Shape], int]:
    """The first ``n`` affordable shapes from seed ``base`` on (acceptance split), of one
    ``parallelism`` if given, and how many were skipped on the way."""
    split = SPLITS["accept"]
    if base < split.start:
        raise ValueError(
            f"--seed-base {base}: shapes come from the acceptance split, >= {split.start}"
        )
    picked: list[Shape] = []
    skipped = 0
    seed = base
    while len(picked) < n:
        if seed >= split.stop:
            raise ValueError(f"no {n} affordable shapes from seed {base}")
        shape = generate_shape(seed)
        kind = parallelism is None or shape.profile.parallelism == parallelism
        if kind and affordable(shape):
            picked.append(shape)
        else:
            skipped += 1
        seed += 1
    return picked, skipped


def seed_list(text: str) -> list[int]:
    """argparse type for --seeds: acceptance-split seeds, e.g. 9011,9018."""
    try:
        seeds = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated seeds, got {text!r}") from None
    start = SPLITS["accept"].start
    if not seeds or min(seeds) < start:
        raise argparse.ArgumentTypeError(f"seeds come from the acceptance split, >= {start}")
    return seeds


def lengths(shape: Shape) -> tuple[str, str]:
    """loadtest's --input-len and --output-len for the shape's workload."""
    lo, hi = shape.output_len
    return str(shape.input_len), (str(lo) if lo == hi else f"uniform:{lo}-{hi}")


def meets(tok_ratio: float | None) -> bool:
    """The verdict on one shape: via / direct tok/s measured, and at least ``MIN_RATIO``."""
    return tok_ratio is not None and tok_ratio >= MIN_RATIO


def timing(shape: Shape, args: argparse.Namespace) -> tuple[float, float]:
    r = shape.est.request_s
    return max(args.warmup, WARMUP_REQUESTS * r), max(args.duration, WINDOW_REQUESTS * r)


def run_shape(args: argparse.Namespace, shape: Shape, workdir: Path) -> dict[str, Any]:
    path = workdir / f"{shape.name}.toml"
    path.write_text(toml_table(shape.profile.model_dump()))
    warmup, duration = timing(shape, args)
    arm_args = copy.copy(args)
    arm_args.warmup, arm_args.duration = warmup, duration
    clients = CLIENT_FACTOR * shape.est.capacity
    load, work = closed(clients), lengths(shape)
    label = f"s{shape.seed}"
    fronts = ("direct", "proxy", "nginx") if args.nginx else ("direct", "proxy")
    arms = {
        front: run_arm(arm_args, label, [str(path)], front, load, lengths=work) for front in fronts
    }
    d, p, ngx = arms["direct"], arms["proxy"], arms.get("nginx")
    tok = ratio(p.get("output_tok_s"), d.get("output_tok_s"))
    return {
        "shape": shape.name,
        "seed": shape.seed,
        "capacity": shape.est.capacity,
        "binding": shape.est.binding,
        "clients": clients,
        "warmup_s": warmup,
        "duration_s": duration,
        "direct": d,
        "proxy": p,
        "tok_ratio": tok,
        "nginx": ngx,
        "nginx_ratio": ratio(ngx.get("output_tok_s"), d.get("output_tok_s")) if ngx else None,
        "ttft_p99_ratio": ratio(p.get("ttft_p99"), d.get("ttft_p99")),
        "met": meets(tok),
    }


# -- report -----------------------------------------------------------------------------------
def distribution(xs: list[float]) -> str:
    if not xs:
        return "n/a"
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return (
        f"min {min(xs):.3f}, p25 {q[0]:.3f}, median {q[1]:.3f}, p75 {q[2]:.3f}, max {max(xs):.3f}"
    )


def report(args: argparse.Namespace, rows: list[dict[str, Any]], skipped: int, wall: float) -> str:
    met = sum(r["met"] for r in rows)
    toks = [r["tok_ratio"] for r in rows if r["tok_ratio"] is not None]
    lines = [
        "## Fill generated shapes over real sockets: direct vs through pipefill",
        "",
        f"Command: `{args.command}` at {commit()}",
        "",
        f"{len(rows)} {args.parallelism or 'any'}-parallel shapes from seed {args.seed_base} "
        f"(loadtest/sim/shapes.py, acceptance split; {skipped} other or unaffordable in real "
        f"time skipped), {CLIENT_FACTOR}x each shape's "
        f"estimated capacity in closed-loop clients, its own workload; simulator time scale "
        f"{args.time_scale}; wall {wall:.0f} s, {load_cpu()}.",
        "",
        "| shape | binds | capacity | clients | window s | direct tok/s | via tok/s | ratio | "
        + ("nginx tok/s (/ direct) | " if args.nginx else "")
        + "TTFT p99 direct / via s | failed | limit at end | met |",
        "|---|---|---:|---:|---:|---:|---:|---:|"
        + ("---:|" if args.nginx else "")
        + "---|---:|---:|---|",
    ]
    for r in rows:
        d, p = r["direct"], r["proxy"]
        lim = ", ".join(str(v) for v in (p.get("limits") or {}).values()) or "n/a"
        ngx = ""
        if args.nginx:
            n = r.get("nginx") or {}
            ngx = f"{f(n.get('output_tok_s'), '.0f')} ({f(r.get('nginx_ratio'), '.3f')}) | "
        lines.append(
            f"| {r['shape']} | {r['binding']} | {r['capacity']} | {r['clients']} | "
            f"{r['duration_s']:.0f} | {f(d.get('output_tok_s'), '.0f')} | "
            f"{f(p.get('output_tok_s'), '.0f')} | {f(r['tok_ratio'], '.3f')} | {ngx}"
            f"{f(d.get('ttft_p99'))} / {f(p.get('ttft_p99'))} | "
            f"{(d.get('failed') or 0) + (p.get('failed') or 0)} | {lim} | "
            f"{'yes' if r['met'] else 'NO'} |"
        )
    lines += [
        "",
        f"via / direct tok/s: {distribution(toks)}.",
        "",
        f"VERDICT: {met}/{len(rows)} shapes at >= {MIN_RATIO}x direct tok/s"
        + (" (met)" if met == len(rows) else " (NOT met)"),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argument_parser(__doc__)
    ap.add_argument("--shapes", type=positive_int, default=12, help="affordable shapes to run")
    ap.add_argument("--seed-base", type=int, default=DEFAULT_SEED_BASE, help="first shape seed")
    ap.add_argument(
        "--parallelism", choices=["pp", "tp", "ep"], default=None, help="only shapes of this kind"
    )
    ap.add_argument(
        "--seeds",
        type=seed_list,
        default=None,
        help="these shapes (comma-separated seeds, affordable or not) instead of picking",
    )
    ap.add_argument(
        "--nginx",
        action="store_true",
        help="also relay each shape through nginx (a reference: what any relay's timing does)",
    )
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--warmup", type=float, default=5.0, help="least modelled s before a window")
    ap.add_argument("--duration", type=float, default=25.0, help="least modelled s measured")
    ap.add_argument("--seed", type=int, default=7, help="loadtest seed (prompts)")
    sglang_defaults_argument(ap)
    out_argument(ap, "fill_shapes")
    args = ap.parse_args(argv)
    given = sys.argv[1:] if argv is None else argv
    args.command = " ".join(["python benchmarks/fill_shapes.py", *given])
    try:
        if args.seeds:
            shapes, skipped = [generate_shape(seed) for seed in args.seeds], 0
        else:
            shapes, skipped = pick_shapes(args.seed_base, args.shapes, args.parallelism)
    except ValueError as exc:
        ap.error(str(exc))
    started = time.monotonic()
    rows = []
    with tempfile.TemporaryDirectory(prefix="fill_shapes-") as tmp:
        for shape in shapes:
            rows.append(run_shape(args, shape, Path(tmp)))
            r = rows[-1]
            print(f"   {r['shape']}: via / direct {f(r['tok_ratio'], '.3f')}", flush=True)
    md = report(args, rows, skipped, time.monotonic() - started)
    print(md)
    if args.out:
        write_results("fill_shapes", md, {"command": args.command, "rows": rows}, Path(args.out))
    return 0 if all(r["met"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
