"""Fill any pipeline: the adaptive limit on backends that are not the calibrated pp8/tp8/ep8.

    .venv/bin/python benchmarks/fill_any.py                     # every section, ~7.5 min on 2 cores
    .venv/bin/python benchmarks/fill_any.py --only single --out # one section, results written

Simulator profiles from benchmarks/profiles/ (synthetic shapes, see each file's header):
pp4 (4 stages, cap 64), pp8-cap128 (8 stages, cap 128), tp-kvbound (its KV pool binds at ~96
running, before its cap of 256), tp-cap24 and tp-cap32 (TP capped at 24 / 32 running).
Workload everywhere: 1024-token prompts, 128-token answers (ignore_eos), chat API, streamed;
--warmup modelled s, then a --duration window; --time-scale 1 by default (modelled = wall s).
Every arm gets fresh `loadtest sim` processes (one per backend); the arms of a comparison run
back to back, and with --repeats N every section's arms run once per round (medians judged).

- single: for pp4 (96 clients), pp8-cap128 (128), tp-kvbound (128), closed loop: direct to one
  simulator vs through pipefill (adaptive limit, one backend, policy latency, the profile's
  parallelism and pp_size as hints) in front of another. Verdict: via / direct tok/s >= 0.95.
- pair: pp4 + tp-cap24, 96 closed-loop clients: sglang-router round_robin vs pipefill adaptive
  vs pipefill with fixed limits at each backend's capacity (64, 24; the issue's reference:
  1.14x the router's tok/s, TTFT p99 0.53x). Verdict (adaptive): >= 1.10x the router's tok/s
  and TTFT p99 <= 0.6x the router's.
- open: pp4 + tp-cap32, Poisson arrivals at --overload (1.1) x their combined capacity:
  sglang-router round_robin vs pipefill adaptive (queue bounded: --queue-length, --deadline).
  Capacity is derived, not measured over HTTP: each profile's closed-loop output tok/s in the
  simulator's engine model in virtual time (loadtest.sim.calibrate.closed_loop at 1.5x its
  running cap, the same workload, clients resubmitting 2-4 ms after a finish as over HTTP)
  divided by the answer length; so every run offers the same load. tp-cap32 is ~1.5x pp4, so
  round robin's even split overloads pp4 while tp-cap32 has room. The window opens after
  --open-warmup (15 s: a pp4 answer takes ~11 s) and requests sent in it may finish for --drain
  s after it; TTFT is over those served (loadtest's own TTFT counts only requests that finished
  in the window, which leaves out the ones queued longest). Verdict: pipefill served req/s
  (completions in the window) >= the router's, TTFT p99 <= the router's, and excess shed
  (429/503 > 0).

Printed: per section a table and ratios (the median over repeats of each repeat's ratio) and a
verdict; the proxy's limit and knee at the end of each run and how the limit moved. Times are
modelled seconds. --out writes benchmarks/results/fill_any.{md,json} (or --out BASE).
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from harness import (
    Harness,
    Poller,
    backends_by_name,
    get_text,
    length_arg,
    level_row,
    load_cpu,
    out_argument,
    positive_int,
    proxy_toml,
    sglang_defaults_argument,
    sim_surface,
    write_results,
)

from loadtest.sim.profiles import load_profile
from loadtest.stats import percentile
from loadtest.workload import LengthDist

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"
PROFILES = ["pp4", "pp8-cap128", "tp-kvbound", "tp-cap24", "tp-cap32"]
SECTIONS = ["single", "pair", "open"]

#: single: (profile, closed-loop clients)
SINGLE = [("pp4", 96), ("pp8-cap128", 128), ("tp-kvbound", 128)]
PAIR = ["pp4", "tp-cap24"]
PAIR_CLIENTS = 96
PAIR_FIXED = {"pp4": 64, "tp-cap24": 24}  # each backend's capacity in requests
OPEN = ["pp4", "tp-cap32"]

INPUT_LEN = 1024
OUTPUT_LEN = 128

#: targets
SINGLE_MIN_RATIO = 0.95
PAIR_MIN_TOK = 1.10
PAIR_MAX_TTFT = 0.6
REFERENCE_FIXED = {"tok_s": 1.14, "ttft_p99": 0.53}  # the issue's fixed-limit reference


def profile_file(name: str) -> str:
    """A profile of benchmarks/profiles/ by name, or a .toml path as it is."""
    return name if name.endswith(".toml") else str(PROFILE_DIR / f"{name}.toml")


def backend_name(profile: str) -> str:
    return Path(profile).stem


# -- verdicts (pure; tests/test_fill_any.py) ---------------------------------------------------
def ratio(a: float | None, b: float | None) -> float | None:
    """a / b; None when either is missing or b is not positive."""
    if a is None or b is None or not b > 0:
        return None
    return a / b


def median_ratio(num: list[dict], den: list[dict], key: str) -> tuple[float | None, list]:
    """The median over repeats of each repeat's num[key] / den[key] (arms paired by repeat), and
    every repeat's ratio. None if a repeat measured nothing: a gap must not pass a target."""
    per = [ratio(a.get(key), b.get(key)) for a, b in zip(num, den, strict=True)]
    if not per or any(r is None for r in per):
        return None, per
    return statistics.median(per), per  # type: ignore[type-var]


def median_of(rows: list[dict], key: str) -> float | None:
    vals = [r.get(key) for r in rows]
    if not vals or any(v is None for v in vals):
        return None
    return statistics.median(vals)  # type: ignore[type-var]


def single_verdict(direct: list[dict], proxy: list[dict]) -> dict[str, Any]:
    """via-proxy / direct tok/s (median of the per-repeat ratios) >= SINGLE_MIN_RATIO."""
    r, per = median_ratio(proxy, direct, "output_tok_s")
    return {"ratio": r, "per_repeat": per, "met": r is not None and r >= SINGLE_MIN_RATIO}


def pair_verdict(router: list[dict], other: list[dict]) -> dict[str, Any]:
    """tok/s and TTFT p99 of `other` over the router's; met: tok >= 1.10, TTFT p99 <= 0.6."""
    tok, tok_per = median_ratio(other, router, "output_tok_s")
    ttft, ttft_per = median_ratio(other, router, "ttft_p99")
    met = tok is not None and ttft is not None and tok >= PAIR_MIN_TOK and ttft <= PAIR_MAX_TTFT
    return {"tok_s": tok, "ttft_p99": ttft, "tok_s_per_repeat": tok_per,
            "ttft_p99_per_repeat": ttft_per, "met": met}  # fmt: skip


def open_verdict(router: list[dict], proxy: list[dict]) -> dict[str, Any]:
    """Served req/s >= the router's, TTFT p99 (of the requests sent in the window and served)
    <= the router's, and the proxy shed (429/503 > 0)."""
    served, served_per = median_ratio(proxy, router, "request_throughput")
    ttft, ttft_per = median_ratio(proxy, router, "ttft_sent_p99")
    shed = median_of(proxy, "shed")
    met = (
        served is not None
        and ttft is not None
        and shed is not None
        and served >= 1.0
        and ttft <= 1.0
        and shed > 0
    )
    return {"served": served, "ttft_p99": ttft, "shed": shed, "served_per_repeat": served_per,
            "ttft_p99_per_repeat": ttft_per, "met": met}  # fmt: skip


def sent_in_window(result: dict[str, Any]) -> dict[str, Any]:
    """Every request scheduled in the window (open loop, drained after it): outcome counts (ok,
    an HTTP status, or an error kind such as cancelled: unfinished when the drain ran out) and
    the TTFT p50/p99 of those served. Unlike loadtest's own TTFT (requests that *finished* in the
    window) this keeps the requests that queued longest, which finish after the window."""
    lv = result["levels"][0]
    w0, w1 = lv["window"]
    c: Counter[str] = Counter()
    ttfts: list[float] = []
    for r in result.get("records") or []:
        if not (w0 <= r["t_scheduled"] < w1):
            continue
        if r["error"] is None:
            c["ok"] += 1
            if r["t_first"] is not None:
                ttfts.append(r["t_first"] - r["t_scheduled"])
        elif r["status"] and r["status"] != 200:
            c[str(r["status"])] += 1
        else:
            c[r["error"]] += 1
    ttfts.sort()
    q = (lambda x: percentile(ttfts, x)) if ttfts else (lambda x: None)
    return {"statuses": dict(c), "sent": sum(c.values()), "shed": c["429"] + c["503"],
            "ttft_sent_p50": q(0.5), "ttft_sent_p99": q(0.99)}  # fmt: skip


def limit_trace(samples: list[tuple[float, dict]], ts: float) -> dict[str, list[list]]:
    """Every change of each backend's limit: [modelled s since the run started, limit, knee]."""
    out: dict[str, list[list]] = {}
    for t, bs in samples:
        for name, b in bs.items():
            row = [round(t / ts, 1), b["limit"], (b.get("limit_state") or {}).get("knee")]
            rows = out.setdefault(name, [])
            if not rows or rows[-1][1:] != row[1:]:
                rows.append(row)
    return out


# -- arms -------------------------------------------------------------------------------------
def entries(
    urls: list[str], profiles: list[str], fixed: dict[str, int] | None = None, hints: bool = True
) -> list:
    """[[backends]] entries, with each profile's own parallelism and pp_size as hints unless
    ``hints`` is off (backends listed by URL alone, as a user may: the proxy learns the rest
    from each server's ``/server_info``)."""
    out = []
    for url, name in zip(urls, profiles, strict=True):
        p = load_profile(profile_file(name))
        e: dict[str, Any] = {"name": backend_name(name), "url": url}
        if hints:
            e["parallelism"] = p.parallelism
            e["pp_size"] = p.pp_size if p.parallelism == "pp" else None
        if fixed:
            e["limits"] = {"algorithm": "fixed", "initial": fixed[name]}
        out.append(e)
    return out


def sim_served(url: str) -> int | None:
    """Requests the simulator finished (its own counter): who got the traffic (None when it
    serves no metrics)."""
    text = get_text(f"{url}/metrics")
    if not text:
        return None
    return int(
        sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("sglang:num_requests_total")
        )
    )


def workload(
    args: argparse.Namespace, open_loop: bool = False, lengths: tuple[str, str] | None = None
) -> list[str]:
    """Closed loop: --warmup, no drain (what runs at the window's end is cut); open loop:
    --open-warmup, and requests sent in the window may finish for --drain s after it.
    ``lengths``: loadtest's --input-len and --output-len (default: this benchmark's)."""
    warmup, drain = (args.open_warmup, args.drain) if open_loop else (args.warmup, 0)
    inp, out = lengths or (str(INPUT_LEN), args.output_len)
    return ["--warmup", str(warmup), "--duration", str(args.duration),
            "--input-len", inp, "--output-len", out, "--ignore-eos",
            "--seed", str(args.seed), "--drain-timeout", str(drain),
            "--request-timeout", "600"]  # fmt: skip


def run_arm(
    args: argparse.Namespace,
    label: str,
    profiles: list[str],
    front: str,
    load: list[str],
    *,
    open_loop: bool = False,
    lengths: tuple[str, str] | None = None,
) -> dict[str, Any]:
    """Fresh simulators (one process each), the front end (direct | proxy | fixed | router |
    nginx, which relays to the first),
    one `loadtest run` level; the proxy's /admin/backends polled throughout. ``profiles``:
    names in benchmarks/profiles/ or .toml paths; ``lengths`` as in ``workload``."""
    ts = args.time_scale
    sim_extra = sim_surface(args)
    print(f"-- {label}: {front} ...", flush=True)
    with Harness(f"fill_any-{label}-{front}", time_scale=ts) as h:
        urls = [
            h.sim([profile_file(p)], name=f"sim-{backend_name(p)}", seed=1 + i, extra=sim_extra).url
            for i, p in enumerate(profiles)
        ]
        proxied = front in ("proxy", "fixed")
        if front == "direct":
            url = urls[0]
        elif front == "router":
            url = h.router(urls, "round_robin").url
        elif front == "nginx":
            url = h.nginx(urls[0]).url
        else:
            sections: dict[str, Any] = {}
            if open_loop:
                sections["queue"] = {"max_length": args.queue_length,
                                     "deadline_s": args.deadline * ts}  # fmt: skip
            fixed = PAIR_FIXED if front == "fixed" else None
            listed = entries(urls, profiles, fixed, hints=not args.no_hints)
            cfg = proxy_toml(listed, policy="latency", time_scale=ts, **sections)
            url = h.proxy(cfg).url
        fetch = backends_by_name(url) if proxied else (lambda: None)
        t0 = time.monotonic()
        with Poller(fetch, interval=0.5 * ts) as poll:
            work = workload(args, open_loop, lengths)
            res = h.loadtest(url, load + work, name=f"loadtest-{front}")
        wall = time.monotonic() - t0
        served = {backend_name(p): sim_served(u) for p, u in zip(profiles, urls, strict=True)}
    lv = res["levels"][0]
    row: dict[str, Any] = {"front": front, **level_row(lv),
                           "request_throughput": lv.get("request_throughput"),
                           "errors": lv.get("errors") or {}, "sim_served": served,
                           "wall_s": round(wall, 1)}  # fmt: skip
    if poll.samples:
        last = poll.samples[-1][1]
        row["limits"] = {n: b["limit"] for n, b in last.items()}
        row["knees"] = {n: (b.get("limit_state") or {}).get("knee") for n, b in last.items()}
        row["limit_trace"] = limit_trace(poll.samples, ts)
    if open_loop:
        row.update(sent_in_window(res))
    return row


def _n(count: int | None) -> str:
    """A simulator's count, or n/a where it serves no metrics to count from."""
    return "n/a" if count is None else str(count)


def closed(clients: int) -> list[str]:
    return ["--concurrency", str(clients)]


def run_single(args: argparse.Namespace, r: int) -> dict[str, Any]:
    out = {}
    for prof, clients in SINGLE:
        out[prof] = {
            front: run_arm(args, f"single-{prof}-r{r}", [prof], front, closed(clients))
            for front in ("direct", "proxy")
        }
    return out


def run_pair(args: argparse.Namespace, r: int) -> dict[str, Any]:
    return {
        front: run_arm(args, f"pair-r{r}", PAIR, front, closed(PAIR_CLIENTS))
        for front in ("router", "proxy", "fixed")
    }


def open_capacity(output_len: str) -> dict[str, Any]:
    """Each OPEN profile's closed-loop capacity in the engine model (virtual time), req/s, at
    the answers' mean length."""
    from loadtest.sim.calibrate import closed_loop

    answer = round(LengthDist.parse(output_len).mean)
    caps = {}
    for prof in OPEN:
        p = load_profile(profile_file(prof))
        res = closed_loop(p, int(1.5 * p.max_running_requests), input_len=INPUT_LEN,
                          output_len=answer, think_s=0.002, jitter_s=0.002)  # fmt: skip
        caps[prof] = {"tok_s": res.aggregate_tok_s, "req_s": res.aggregate_tok_s / answer}
    return caps


def run_open(args: argparse.Namespace, r: int, rate: float) -> dict[str, Any]:
    load = ["--rate", f"{rate:.3f}", "--save-records"]
    return {
        front: run_arm(args, f"open-r{r}", OPEN, front, load, open_loop=True)
        for front in ("router", "proxy")
    }


# -- report -----------------------------------------------------------------------------------
def f(x: float | None, fmt: str = ".2f") -> str:
    return "n/a" if x is None else format(x, fmt)


def per(xs: list) -> str:
    return ", ".join(f(x) for x in xs)


def trace_text(tr: dict[str, list[list]], limit: int = 12) -> str:
    """'pp4: 8@0.5 16@3.0 ...' (limit@modelled s), the first `limit` changes."""
    parts = []
    for name, rows in tr.items():
        s = " ".join(f"{lim}@{t:g}" for t, lim, _ in rows[:limit])
        parts.append(
            f"{name}: {s}" + (f" (+{len(rows) - limit} more)" if len(rows) > limit else "")
        )
    return "; ".join(parts)


def limits_text(r: dict[str, Any]) -> str:
    """'pp4 64 (knee 60), tp-cap24 24' for a proxied arm's limits at the end, else '-'."""
    if not r.get("limits"):
        return "-"
    knees = r.get("knees") or {}
    return ", ".join(
        f"{k} {v}" + (f" (knee {knees[k]})" if knees.get(k) is not None else "")
        for k, v in r["limits"].items()
    )


def arm_cells(r: dict[str, Any]) -> str:
    errs = sum(r["errors"].values()) if r.get("errors") else 0
    return (
        f"{f(r['output_tok_s'], '.0f')} | {f(r['ttft_p50'])} | {f(r['ttft_p99'])} | "
        f"{r['completed']} | {errs} |"
    )


def report(args: argparse.Namespace, rounds: list[dict], caps: dict | None, rate: float | None,
           wall: float) -> tuple[str, dict[str, Any]]:  # fmt: skip
    n = len(rounds)
    verdicts: dict[str, Any] = {}
    listing = (
        "each backend by URL alone (no hints)"
        if args.no_hints
        else "each profile's parallelism and pp_size as hints"
    )
    lines = [
        "## fill_any: the adaptive limit on backends that are not the calibrated profiles",
        "",
        f"Command: `{args.command}`",
        "",
        f"Simulator time scale {args.time_scale} (times in modelled seconds); every arm: fresh "
        f"simulators (one process per backend), warmup {args.warmup:g} s, window "
        f"{args.duration:g} s; {INPUT_LEN}-token prompts, answers of {args.output_len} tokens "
        f"(ignore_eos), streamed chat. Proxy: policy latency, {listing}. "
        f"Profiles: benchmarks/profiles/*.toml. Repeats: {n} (ratios are the "
        f"median of each repeat's ratio; per-repeat values in brackets). Wall time "
        f"{wall:.0f} s, {load_cpu()}.",
    ]
    if "single" in rounds[0]:
        lines += [
            "",
            f"### single: one backend, direct vs through pipefill (target ratio >= "
            f"{SINGLE_MIN_RATIO})",
            "",
            "| profile | clients | arm | tok/s | TTFT p50 s | TTFT p99 s | completed | errors | "
            "limit at end |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        vs = {}
        for prof, clients in SINGLE:
            for front in ("direct", "proxy"):
                rows = [rd["single"][prof][front] for rd in rounds]
                for i, r in enumerate(rows):
                    lim = "-"
                    if r.get("limits"):
                        lim = limits_text(r).removeprefix(f"{prof} ")
                    tag = f" r{i + 1}" if n > 1 else ""
                    lines.append(f"| {prof} | {clients} | {front}{tag} | {arm_cells(r)} {lim} |")
            v = single_verdict([rd["single"][prof]["direct"] for rd in rounds],
                               [rd["single"][prof]["proxy"] for rd in rounds])  # fmt: skip
            vs[prof] = v
        lines += ["", "| profile | via / direct tok/s | verdict |", "|---|---|---|"]
        for prof, v in vs.items():
            lines.append(
                f"| {prof} | **{f(v['ratio'], '.3f')}** [{per(v['per_repeat'])}] | "
                f"{'met' if v['met'] else 'NOT met'} |"
            )
        lines += ["", "How the proxy's limit moved (limit@modelled s since the load started):", ""]
        for prof, _ in SINGLE:
            for i, rd in enumerate(rounds):
                tr = rd["single"][prof]["proxy"].get("limit_trace") or {}
                lines.append(f"- {trace_text(tr)}{f' (r{i + 1})' if n > 1 else ''}")
        verdicts["single"] = vs
    if "pair" in rounds[0]:
        lines += [
            "",
            f"### pair: {' + '.join(PAIR)}, {PAIR_CLIENTS} closed-loop clients",
            "",
            "| arm | tok/s | TTFT p50 s | TTFT p99 s | completed | errors | limits at end "
            "| requests each backend served (whole run) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        fixed_name = "pipefill fixed " + "/".join(str(v) for v in PAIR_FIXED.values())
        names = {"router": "sglang-router round_robin", "proxy": "pipefill adaptive",
                 "fixed": fixed_name}  # fmt: skip
        for front in ("router", "proxy", "fixed"):
            for i, rd in enumerate(rounds):
                r = rd["pair"][front]
                lim = limits_text(r)
                served = ", ".join(f"{k} {_n(v)}" for k, v in r["sim_served"].items())
                tag = f" r{i + 1}" if n > 1 else ""
                lines.append(f"| {names[front]}{tag} | {arm_cells(r)} {lim} | {served} |")
        router = [rd["pair"]["router"] for rd in rounds]
        va = pair_verdict(router, [rd["pair"]["proxy"] for rd in rounds])
        vf = pair_verdict(router, [rd["pair"]["fixed"] for rd in rounds])
        lines += [
            "",
            "| vs router | tok/s ratio | TTFT p99 ratio | verdict |",
            "|---|---|---|---|",
            f"| pipefill adaptive | **{f(va['tok_s'], '.3f')}** [{per(va['tok_s_per_repeat'])}] "
            f"| **{f(va['ttft_p99'], '.3f')}** [{per(va['ttft_p99_per_repeat'])}] | "
            f"{'met' if va['met'] else 'NOT met'} (target >= {PAIR_MIN_TOK}, "
            f"<= {PAIR_MAX_TTFT}) |",
            f"| pipefill fixed (reference) | {f(vf['tok_s'], '.3f')} "
            f"[{per(vf['tok_s_per_repeat'])}] | {f(vf['ttft_p99'], '.3f')} "
            f"[{per(vf['ttft_p99_per_repeat'])}] | the issue quotes "
            f"{REFERENCE_FIXED['tok_s']} / {REFERENCE_FIXED['ttft_p99']} |",
            "",
            "Adaptive limits over time: "
            + " | ".join(trace_text(rd["pair"]["proxy"].get("limit_trace") or {}) for rd in rounds),
        ]
        verdicts["pair"] = {"adaptive": va, "fixed": vf}
    if "open" in rounds[0] and caps is not None and rate is not None:
        total = sum(c["req_s"] for c in caps.values())
        lines += [
            "",
            f"### open: {' + '.join(OPEN)}, Poisson arrivals at {args.overload:g} x capacity",
            "",
            "Capacity derived in the engine model (virtual time, closed loop at 1.5x each running "
            "cap, output tok/s / answer length): "
            + ", ".join(
                f"{k} {c['tok_s']:.0f} tok/s = {c['req_s']:.2f} req/s" for k, c in caps.items()
            )
            + f"; combined **{total:.2f} req/s**, offered **{rate:.2f} req/s** (same seed, so "
            f"the same arrivals, in both arms). Proxy queue: max {args.queue_length}, deadline "
            f"{args.deadline:g} s.",
            "",
            "Served req/s and tok/s: completions and tokens in the window per s. TTFT: of the "
            "requests sent in the window and served (drained up to "
            f"{args.drain:g} s after it; loadtest's own TTFT, of requests that finished in the "
            "window, leaves out the longest queued and is in the JSON).",
            "",
            "| arm | served req/s | tok/s | TTFT p50 s | TTFT p99 s | sent in window | ok | 429 "
            "| 503 | other (cancelled = unfinished after the drain) | limits at end | "
            "requests each backend served (whole run) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        names = {"router": "sglang-router round_robin", "proxy": "pipefill adaptive"}
        for front in ("router", "proxy"):
            for i, rd in enumerate(rounds):
                r = rd["open"][front]
                st = r["statuses"]
                other = {k: v for k, v in st.items() if k not in ("ok", "429", "503")}
                lim = limits_text(r)
                served = ", ".join(f"{k} {_n(v)}" for k, v in r["sim_served"].items())
                tag = f" r{i + 1}" if n > 1 else ""
                lines.append(
                    f"| {names[front]}{tag} | {f(r['request_throughput'])} | "
                    f"{f(r['output_tok_s'], '.0f')} | {f(r['ttft_sent_p50'])} | "
                    f"{f(r['ttft_sent_p99'])} | {r['sent']} | {st.get('ok', 0)} | "
                    f"{st.get('429', 0)} | {st.get('503', 0)} | {other or '-'} | {lim} | {served} |"
                )
        vo = open_verdict([rd["open"]["router"] for rd in rounds],
                          [rd["open"]["proxy"] for rd in rounds])  # fmt: skip
        lines += [
            "",
            f"pipefill / router: served req/s **{f(vo['served'], '.3f')}** "
            f"[{per(vo['served_per_repeat'])}] (target >= 1), TTFT p99 "
            f"**{f(vo['ttft_p99'], '.3f')}** [{per(vo['ttft_p99_per_repeat'])}] (target <= 1), "
            f"shed {f(vo['shed'], 'g')} (target > 0): **{'met' if vo['met'] else 'NOT met'}**.",
            "",
            "Adaptive limits over time: "
            + " | ".join(trace_text(rd["open"]["proxy"].get("limit_trace") or {}) for rd in rounds),
        ]
        verdicts["open"] = vo
    lines += ["", "Verdicts: " + ", ".join(f"{k} {_met(v)}" for k, v in verdicts.items()) + "."]
    data = {"command": args.command, "args": {k: v for k, v in vars(args).items()
                                              if k != "out"},
            "wall_s": round(wall, 1), "capacity": caps, "rate": rate, "rounds": rounds,
            "verdicts": verdicts}  # fmt: skip
    return "\n".join(lines), data


def _met(v: dict[str, Any]) -> str:
    """'met' / 'NOT met' for a section (every entry of it met)."""
    if "met" in v:
        ok = v["met"]
    elif "adaptive" in v:
        ok = v["adaptive"]["met"]
    else:
        ok = all(x["met"] for x in v.values())
    return "met" if ok else "NOT met"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(SECTIONS), help="sections, e.g. single,open")
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--warmup", type=float, default=5.0, help="modelled s before each window")
    ap.add_argument("--duration", type=float, default=25.0, help="modelled s measured per arm")
    ap.add_argument(
        "--open-warmup",
        type=float,
        default=15.0,
        help="open: modelled s before the window (pp4 answers take ~11 s: its first "
        "completions and the queues need that long)",
    )
    ap.add_argument(
        "--drain", type=float, default=90.0, help="open: modelled s requests may finish after"
    )
    ap.add_argument("--overload", type=float, default=1.1, help="open: offered / capacity")
    ap.add_argument("--queue-length", type=int, default=64, help="open: proxy queue max length")
    ap.add_argument("--deadline", type=float, default=5.0, help="open: queue deadline, modelled s")
    ap.add_argument("--seed", type=int, default=7, help="loadtest seed (prompts, arrivals)")
    ap.add_argument(
        "--output-len",
        type=length_arg,
        default=str(OUTPUT_LEN),
        help="answer tokens, as loadtest's --output-len (e.g. uniform:64-192); ignore_eos keeps "
        "each to its drawn length (default %(default)s: closed-loop clients that start together "
        "then finish in waves)",
    )
    ap.add_argument("--repeats", type=positive_int, default=1, help="rounds of every section")
    ap.add_argument(
        "--no-hints",
        action="store_true",
        help="list each backend by URL alone, without its parallelism and pp_size",
    )
    sglang_defaults_argument(ap)
    out_argument(ap, "fill_any")
    args = ap.parse_args()
    only = [s for s in args.only.split(",") if s]
    bad = [s for s in only if s not in SECTIONS]
    if bad or not only:
        ap.error(f"--only takes {','.join(SECTIONS)}; got {args.only!r}")
    args.command = "python benchmarks/fill_any.py " + shlex.join(sys.argv[1:])
    args.command = args.command.rstrip()
    t0 = time.monotonic()
    caps = rate = None
    if "open" in only:
        caps = open_capacity(args.output_len)
        rate = args.overload * sum(c["req_s"] for c in caps.values())
        print(f"open: capacity {sum(c['req_s'] for c in caps.values()):.2f} req/s -> "
              f"offering {rate:.2f} req/s", flush=True)  # fmt: skip
    rounds: list[dict[str, Any]] = []
    try:
        for r in range(1, args.repeats + 1):
            if args.repeats > 1:
                print(f"== repeat {r} of {args.repeats}", flush=True)
            rd: dict[str, Any] = {}
            if "single" in only:
                rd["single"] = run_single(args, r)
            if "pair" in only:
                rd["pair"] = run_pair(args, r)
            if "open" in only:
                rd["open"] = run_open(args, r, rate)  # type: ignore[arg-type]
            rounds.append(rd)
    except KeyboardInterrupt:
        print("interrupted; children stopped")
        return 130
    text, data = report(args, rounds, caps, rate, time.monotonic() - t0)
    print(text)
    if args.out:
        write_results("fill_any", text, data, Path(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
