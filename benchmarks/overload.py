"""Overload: open-loop arrivals at twice the measured capacity, with and without admission control.

    .venv/bin/python benchmarks/overload.py            # ~1.5 min on 2 cores
    .venv/bin/python benchmarks/overload.py --quick

One run, three phases, each on fresh `loadtest sim` backends (pp8 and tp8, one process each):

1. capacity: closed-loop clients (--capacity-clients, well above the backends' knees) through
   the proxy; capacity = completed requests per second of the window.
2. proxy: open-loop Poisson arrivals (`loadtest run --rate`) at 2 x capacity through the proxy
   (adaptive limits, queue bounded by --queue-length, queue deadline --deadline modelled s).
   /admin/backends is sampled every ~0.5 modelled s: in flight vs limit, SGLang's scraped queue.
3. direct: the same arrivals through sglang-router `round_robin` (no admission control: every
   request goes to a backend, which queues it). The simulators' /get_load is sampled for their
   running and waiting requests.

Printed side by side: served requests, their TTFT p99, requests shed (by HTTP status) and the
backends' queues. Times are modelled seconds. Results: benchmarks/results/overload.{md,json}.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from typing import Any

from harness import (
    Harness,
    Poller,
    argument_parser,
    backend_entries,
    backends_by_name,
    get_json,
    length_arg,
    level_row,
    load_cpu,
    proxy_toml,
    window_wall,
    write_results,
)

PROFILES = ["pp8", "tp8"]


def workload(args: argparse.Namespace) -> list[str]:
    return ["--input-len", "1024", "--output-len", args.output_len, "--seed", "11",
            "--drain-timeout", "0", "--request-timeout", "600"]  # fmt: skip


def statuses(result: dict[str, Any]) -> dict[str, int]:
    """HTTP status (or error kind) of every request sent in the window."""
    lv = result["levels"][0]
    w0, w1 = lv["window"]
    c: Counter[str] = Counter()
    for r in result.get("records") or []:
        if not (w0 <= r["t_scheduled"] < w1):
            continue
        if r["error"] is None:
            c["ok"] += 1
        elif r["status"] and r["status"] != 200:
            c[str(r["status"])] += 1
        else:
            c[r["error"]] += 1
    return dict(c)


def proxy_cfg(urls: list[str], args: argparse.Namespace) -> str:
    ts = args.time_scale
    return proxy_toml(
        backend_entries(urls, PROFILES),
        time_scale=ts,
        queue={"max_length": args.queue_length, "deadline_s": args.deadline * ts},
    )


def phase_capacity(args: argparse.Namespace, via: str) -> dict[str, Any]:
    """Closed-loop capacity through the proxy (its limits decide) or sglang-router (none)."""
    with Harness(f"overload-capacity-{via}", time_scale=args.time_scale) as h:
        urls = h.sims(PROFILES)
        if via == "proxy":
            fe = h.proxy(proxy_cfg(urls, args))
        else:
            fe = h.router(urls, "round_robin")
        cmd = ["--concurrency", str(args.capacity_clients), "--warmup", str(args.warmup),
               "--duration", str(args.duration), *workload(args)]  # fmt: skip
        fetch = backends_by_name(fe.url) if via == "proxy" else (lambda: None)
        with Poller(fetch, interval=args.time_scale) as poll:
            res = h.loadtest(fe.url, cmd, name=f"capacity-{via}")
    lv = res["levels"][0]
    limits = {n: b["limit"] for n, b in poll.samples[-1][1].items()} if poll.samples else {}
    return {"via": via, "request_throughput": lv["request_throughput"], **level_row(lv),
            "limits": limits}  # fmt: skip


def phase_open(args: argparse.Namespace, rate: float, via: str) -> dict[str, Any]:
    ts = args.time_scale
    with Harness(f"overload-{via}", time_scale=ts) as h:
        urls = h.sims(PROFILES)
        if via == "proxy":
            fe = h.proxy(proxy_cfg(urls, args))
        else:
            fe = h.router(urls, "round_robin")
        cmd = ["--rate", f"{rate:.3f}", "--warmup", str(args.warmup), "--duration",
               str(args.duration), "--save-records", *workload(args)]  # fmt: skip

        def sample() -> dict[str, Any]:
            out: dict[str, Any] = {}
            for prof, url in zip(PROFILES, urls, strict=True):
                load = get_json(f"{url}/get_load", timeout=1.0)
                if isinstance(load, list):
                    out[prof] = {"reqs": sum(x["num_reqs"] for x in load),
                                 "waiting": sum(x["num_waiting_reqs"] for x in load)}  # fmt: skip
            if via == "proxy":
                bs = backends_by_name(fe.url)() or {}
                for n, b in bs.items():
                    st = b.get("limit_state") or {}
                    d = out.setdefault(n, {})
                    d.update(in_flight=b["in_flight"], limit=b["limit"], knee=st.get("knee"),
                             reason=st.get("reason"))  # fmt: skip
                q = get_json(f"{fe.url}/admin/queue", timeout=1.0)
                out["_queue"] = q
            return out

        with Poller(sample, interval=0.5 * ts) as poll:
            res = h.loadtest(fe.url, cmd, name=f"open-{via}")
    lv = res["levels"][0]
    w0, w1 = window_wall(res)  # samples inside the window (the poller's clock)
    inside = [(t, s) for t, s in poll.samples if w0 <= t + poll.t0 <= w1]
    backends = {}
    for prof in PROFILES:
        ss = [s[prof] for _, s in inside if prof in s]
        if not ss:
            continue
        d: dict[str, Any] = {
            "backend_reqs_mean": statistics.fmean(x["reqs"] for x in ss),
            "backend_reqs_max": max(x["reqs"] for x in ss),
            "backend_waiting_mean": statistics.fmean(x["waiting"] for x in ss),
            "backend_waiting_max": max(x["waiting"] for x in ss),
        }
        if via == "proxy":
            d["in_flight_mean"] = statistics.fmean(x["in_flight"] for x in ss)
            d["limit_mean"] = statistics.fmean(x["limit"] for x in ss)
            d["at_limit_share"] = sum(x["in_flight"] >= x["limit"] for x in ss) / len(ss)
            d["knee_last"] = ss[-1].get("knee")
        backends[prof] = d
    # Every change of a backend's limit or of its limit's reason, over the whole phase (modelled
    # s since the poller started): how the limit got where it was in the window.
    trace: dict[str, list[tuple[float, int, str]]] = {}
    if via == "proxy":
        for t, smp in poll.samples:
            for prof in PROFILES:
                x = smp.get(prof) or {}
                if "limit" not in x:
                    continue
                row = (round(t / ts, 1), x["limit"], x.get("reason") or "")
                rows = trace.setdefault(prof, [])
                if not rows or rows[-1][1:] != row[1:]:
                    rows.append(row)
    return {
        "limit_trace": trace,
        "via": via,
        **level_row(lv),
        "request_throughput": lv["request_throughput"],
        "errors": lv.get("errors"),
        "statuses": statuses(res),
        "backends": backends,
        "samples": len(inside),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argument_parser(__doc__)
    ap.add_argument("--time-scale", type=float, default=0.25)
    ap.add_argument("--capacity-clients", type=int, default=192)
    ap.add_argument("--warmup", type=float, default=20.0, help="modelled s")
    ap.add_argument("--duration", type=float, default=40.0, help="modelled s")
    ap.add_argument("--output-len", type=length_arg, default="uniform:64-256")
    ap.add_argument("--overload", type=float, default=2.0, help="offered / capacity")
    ap.add_argument("--queue-length", type=int, default=64)
    ap.add_argument("--deadline", type=float, default=5.0, help="queue deadline, modelled s")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.warmup, args.duration = 10.0, 15.0
    t0 = time.monotonic()
    try:
        caps = [phase_capacity(args, "proxy"), phase_capacity(args, "router_round_robin")]
        cap = max(caps, key=lambda c: c["request_throughput"])
        rate = args.overload * cap["request_throughput"]
        print(f"capacity {cap['request_throughput']:.2f} req/s -> offering {rate:.2f} req/s")
        px = phase_open(args, rate, "proxy")
        direct = phase_open(args, rate, "router_round_robin")
    except KeyboardInterrupt:
        print("interrupted; children stopped")
        return 130

    def fmt(r: dict[str, Any]) -> str:
        shed = {k: v for k, v in r["statuses"].items() if k not in ("ok", "cancelled")}
        return (
            f"| {r['via']} | {r['request_throughput']:.2f} | {r['output_tok_s']:.0f} | "
            f"{r['ttft_p50'] or 0:.2f} | {r['ttft_p99'] or 0:.2f} | {r['e2e_p99'] or 0:.1f} | "
            f"{r['statuses'].get('ok', 0)} | {shed or '-'} | {r['statuses'].get('cancelled', 0)} |"
        )

    lines = [
        f"## overload: open-loop arrivals at {args.overload:g} x capacity, pp8 + tp8 simulators",
        "",
        f"Time scale {args.time_scale} (modelled seconds); 1024-token prompts, output "
        f"{args.output_len}; warmup {args.warmup:g} s, window {args.duration:g} s per phase. "
        f"Capacity measured first in the same run, {args.capacity_clients} closed-loop clients: "
        + "; ".join(
            f"via {c['via']} {c['request_throughput']:.2f} req/s ({c['output_tok_s']:.0f} tok/s"
            + (f", limits {c['limits']})" if c["limits"] else ")")
            for c in caps
        )
        + f"; capacity = the larger, **{cap['request_throughput']:.2f} req/s**. Offered: Poisson "
        f"**{rate:.2f} req/s**. Proxy queue: max {args.queue_length}, deadline "
        f"{args.deadline:g} s. 'direct' = the same arrivals through sglang-router round_robin "
        f"(no admission control). Wall {time.monotonic() - t0:.0f} s, {load_cpu()}.",
        "",
        "| via | served req/s | tok/s | TTFT p50 s | TTFT p99 s | E2E p99 s | ok (sent in window) "
        "| shed / failed (status: count) | in flight at window end (cancelled) |",
        "|---|---|---|---|---|---|---|---|---|",
        fmt(px),
        fmt(direct),
        "",
        "Backends during the window (sampled every 0.5 modelled s; `reqs` = running + waiting "
        "inside SGLang from /get_load):",
        "",
        "| via | backend | reqs mean / max | waiting in SGLang mean / max | proxy in flight mean "
        "| limit mean | share of samples at limit | knee |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in (px, direct):
        for prof, d in r["backends"].items():
            lines.append(
                f"| {r['via']} | {prof} | {d['backend_reqs_mean']:.0f} / {d['backend_reqs_max']} "
                f"| {d['backend_waiting_mean']:.1f} / {d['backend_waiting_max']} | "
                f"{d.get('in_flight_mean', float('nan')):.1f} | "
                f"{d.get('limit_mean', float('nan')):.1f} | "
                f"{100 * d.get('at_limit_share', 0):.0f}% | {d.get('knee_last', '-')} |"
            )
    shed = sum(v for k, v in px["statuses"].items() if k in ("429", "503"))
    bounded = (px["ttft_p99"] or 1e9) <= args.deadline + 5
    ratio = (direct["ttft_p99"] or 0) / (px["ttft_p99"] or 1e-9)
    lines += [
        "",
        f"TTFT p99 direct / proxy: **{ratio:.1f}x**. Proxy: served TTFT p99 "
        f"{px['ttft_p99'] or 0:.2f} s (queue deadline {args.deadline:g} s: "
        f"{'bounded' if bounded else 'NOT bounded'}), {shed} requests shed with 429/503; "
        f"served {px['request_throughput'] / cap['request_throughput']:.2f} x capacity.",
    ]
    if px.get("limit_trace"):
        lines += ["", "Proxy phase: each backend's limit changes (modelled s, limit, reason):", ""]
        lines.append("```")
        for prof, rows in px["limit_trace"].items():
            lines += [f"{prof:>5} {t:7.1f} {lim:4d}  {why}" for t, lim, why in rows[:40]]
            if len(rows) > 40:
                lines.append(f"{prof:>5} ... {len(rows) - 40} more")
        lines.append("```")
    text = "\n".join(lines)
    print(text)
    if not args.no_save:
        write_results(
            "overload" + ("-quick" if args.quick else ""),
            text,
            {"time_scale": args.time_scale, "capacity": cap, "capacities": caps, "rate": rate,
             "proxy": px, "direct": direct, "args": vars(args)},
        )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
