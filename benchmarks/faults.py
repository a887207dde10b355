"""Faults: a backend killed, then one stalled, mid-run; no request lost before bytes, recovery.

    .venv/bin/python benchmarks/faults.py            # ~1.5 min on 2 cores
    .venv/bin/python benchmarks/faults.py --quick

Three tp8 backends, each in its own `loadtest sim` process, behind the proxy (policy latency,
adaptive limits), under --clients closed-loop clients for the whole run. On a schedule
(modelled seconds from the start of the load):

- kill: SIGKILL backend A's simulator process; later start it again on the same port.
- stall: SIGSTOP backend B's simulator process (it accepts connections in the kernel but
  answers nothing: a hung server); later SIGCONT.

The proxy's /admin/backends and /admin/queue are sampled every --poll wall seconds (loadtest
does not record which backend served a request). From loadtest's records: every failed request
by error kind, split into "no token received" (must be 0: the proxy retries those elsewhere)
and "mid-stream" (bytes had reached the client; by design never retried). From the samples,
per event: when the victim held nothing any more, when the survivors plus the proxy's queue
held all the clients, when the survivors' token rate was back, and after the backend came back
when it was healthy again and its limit back at 90% of its pre-fault knee (the level the limit
had measured; the pre-fault limit, which also holds probes and headroom, is shown beside it;
a backend never seen full has no knee, and its pre-fault limit is the level).
The proxy's timeouts are
scaled with the time scale (first byte 1.5, idle 1.0 modelled s). Times are modelled seconds.
Results: benchmarks/results/faults.{md,json}.
"""

from __future__ import annotations

import math
import os
import signal
import statistics
import time
from collections import Counter
from typing import Any

from harness import (
    Harness,
    Poller,
    argument_parser,
    get_json,
    length_arg,
    load_cpu,
    proxy_toml,
    write_results,
)

NAMES = ["tp8-a", "tp8-b", "tp8-c"]


def main(argv: list[str] | None = None) -> int:
    ap = argument_parser(__doc__)
    ap.add_argument("--time-scale", type=float, default=0.5)
    ap.add_argument("--clients", type=int, default=48)
    ap.add_argument("--poll", type=float, default=0.1, help="wall seconds between samples")
    ap.add_argument("--output-len", type=length_arg, default="uniform:64-256")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args(argv)
    ts = args.time_scale
    # modelled seconds from the start of the load
    sched = {"kill": 25.0, "restart": 45.0, "stall": 75.0, "resume": 90.0, "end": 120.0}
    if args.quick:
        sched = {"kill": 12.0, "restart": 20.0, "stall": 32.0, "resume": 40.0, "end": 52.0}
    t_start = time.monotonic()
    try:
        with Harness("faults", time_scale=ts) as h:
            sims = {n: h.sim(["tp8"], name=n, seed=i + 1) for i, n in enumerate(NAMES)}
            backends = [{"name": n, "url": s.url, "parallelism": "tp"} for n, s in sims.items()]
            cfg = proxy_toml(
                backends,
                time_scale=ts,
                timeouts={"first_byte_s": 1.5 * ts, "idle_s": 1.0 * ts, "connect_s": 1.0 * ts},
                health={"unhealthy_threshold": 2, "healthy_threshold": 2},
            )
            px = h.proxy(cfg)

            def sample() -> dict[str, Any] | None:
                d = get_json(f"{px.url}/admin/backends", timeout=1.0)
                q = get_json(f"{px.url}/admin/queue", timeout=1.0)
                if not isinstance(d, dict):
                    return None
                out = {
                    b["name"]: {"in_flight": b["in_flight"], "limit": b["limit"],
                                "knee": (b.get("limit_state") or {}).get("knee"),
                                "state": b["state"], "tokens": b["stats"]["tokens_total"]}
                    for b in d["backends"]
                }  # fmt: skip
                out["_queue"] = (q or {}).get("depth", 0) if isinstance(q, dict) else 0
                return out

            cmd = ["--concurrency", str(args.clients), "--warmup", "0", "--duration",
                   str(sched["end"]), "--drain-timeout", "0", "--save-records",
                   "--input-len", "1024", "--output-len", args.output_len,
                   "--seed", "5"]  # fmt: skip
            events: dict[str, float] = {}
            victims: dict[str, str] = {}
            lt = h.start_loadtest(px.url, cmd, name="loadtest")
            t0 = time.monotonic()
            with Poller(sample, interval=args.poll, t0=t0) as poll:

                def at(name: str) -> None:
                    delay = t0 + sched[name] * ts - time.monotonic()
                    if delay > 0:
                        time.sleep(delay)
                    events[name] = (time.monotonic() - t0) / ts

                def busiest(exclude: str | None = None) -> str:
                    """The backend with the most requests in flight now: the victim."""
                    s = sample() or {}
                    names = [n for n in NAMES if n != exclude and n in s]
                    return max(names, key=lambda n: s[n]["in_flight"])

                at("kill")
                killed = victims["kill"] = busiest()
                os.kill(sims[killed].proc.pid, signal.SIGKILL)
                at("restart")
                sims[killed] = h.restart(sims[killed])
                events["restarted"] = (time.monotonic() - t0) / ts
                at("stall")
                stalled = victims["stall"] = busiest(exclude=killed)
                os.kill(sims[stalled].proc.pid, signal.SIGSTOP)
                at("resume")
                os.kill(sims[stalled].proc.pid, signal.SIGCONT)
                result = h.finish_loadtest(lt, timeout=sched["end"] * ts + 120)
    except KeyboardInterrupt:
        print("interrupted; children stopped")
        return 130
    wall = time.monotonic() - t_start
    samples = [(t / ts, s) for t, s in poll.samples]  # modelled seconds from t0

    # -- losses, from loadtest's records ------------------------------------------------------
    recs = result.get("records") or []
    t_base = t0  # records are on the same monotonic clock
    lost_before, mid_stream = Counter(), Counter()
    loss_times = []
    for r in recs:
        if r["error"] is None or r["error"] == "cancelled":
            continue
        kind = r["error"] + (f" ({r['status']})" if r["status"] and r["status"] != 200 else "")
        if r["t_first"] is None:
            lost_before[kind] += 1
        else:
            mid_stream[kind] += 1
        loss_times.append(round((r["t_end"] - t_base) / ts, 1) if r["t_end"] else None)
    ok = sum(1 for r in recs if r["error"] is None)

    # -- traffic, from the proxy's samples ----------------------------------------------------
    def pre(name: str, key: str, t_event: float, span: float = 8.0) -> float:
        xs = [s[name].get(key) for t, s in samples if t_event - span <= t < t_event and name in s]
        xs = [x for x in xs if x is not None]
        return statistics.fmean(xs) if xs else float("nan")

    def rate(names: list[str], t: float, span: float = 2.0) -> float:
        """Tokens/s (modelled) of `names` over [t - span, t]."""
        win = [(u, s) for u, s in samples if t - span <= u <= t]
        if len(win) < 2:
            return float("nan")
        (u0, s0), (u1, s1) = win[0], win[-1]
        tok = sum(s1[n]["tokens"] - s0[n]["tokens"] for n in names if n in s0 and n in s1)
        return tok / (u1 - u0) if u1 > u0 else float("nan")

    def first(after: float, cond) -> float | None:
        for t, s in samples:
            if t >= after and cond(t, s):
                return t - after
        return None

    def event_report(te: float, victim: str, tb: float) -> dict[str, Any]:
        others = [n for n in NAMES if n != victim]
        base_rate = rate(NAMES, te)
        pre_limit = pre(victim, "limit", te)
        # The knee the limit had measured: the limit itself also holds probes and headroom. A
        # backend never seen full has no knee: its limit is then the level to recover.
        pre_knee = pre(victim, "knee", te)
        level = pre_limit if math.isnan(pre_knee) else pre_knee
        d: dict[str, Any] = {
            "at": te,
            "pre_total_tok_s": base_rate,
            "pre_victim_in_flight": pre(victim, "in_flight", te),
            "pre_victim_limit": pre_limit,
            "pre_victim_knee": pre_knee,
            "victim_empty_after_s": first(te, lambda t, s: s[victim]["in_flight"] == 0),
            "clients_held_elsewhere_after_s": first(
                te,
                lambda t, s: (
                    s[victim]["in_flight"] == 0
                    and sum(s[n]["in_flight"] for n in others) + s["_queue"] >= 0.9 * args.clients
                ),
            ),
            "survivors_in_flight_at_limit_after_s": first(
                te,
                lambda t, s: (
                    s[victim]["in_flight"] == 0
                    and sum(s[n]["in_flight"] for n in others) >= 0.9 * args.clients
                ),
            ),
            "survivors_tok_s_back_after_s": first(
                te + 0.5, lambda t, s: rate(others, t) >= 0.9 * base_rate
            ),
            "victim_state_after_1s": next(
                (s[victim]["state"] for t, s in samples if t >= te + 1.0), None
            ),
        }
        d["back_at"] = tb
        d["healthy_after_s"] = first(tb, lambda t, s: s[victim]["state"] == "healthy")
        d["serving_after_s"] = first(tb, lambda t, s: s[victim]["in_flight"] > 0)
        d["limit_recovered_after_s"] = first(
            tb, lambda t, s: s[victim]["limit"] >= 0.9 * pre_limit and s[victim]["in_flight"] > 0
        )
        d["knee_recovered_after_s"] = first(
            tb, lambda t, s: s[victim]["limit"] >= 0.9 * level and s[victim]["in_flight"] > 0
        )
        d["victim_limit_end"] = samples[-1][1][victim]["limit"] if samples else None
        d["victim_in_flight_end_mean"] = statistics.fmean(
            s[victim]["in_flight"] for t, s in samples if t >= sched["end"] - 10
        ) if samples else None  # fmt: skip
        return d

    report = {
        "kill": event_report(events["kill"], victims["kill"], events["restarted"]),
        "stall": event_report(events["stall"], victims["stall"], events["resume"]),
    }

    def s_(x: float | None) -> str:
        return "never" if x is None else f"{x:.1f} s"

    lines = [
        "## faults: three tp8 simulators behind the proxy, one killed and one stalled mid-run",
        "",
        f"Time scale {ts} (modelled seconds from the start of the load); {args.clients} "
        f"closed-loop clients, 1024-token prompts, output {args.output_len}; proxy policy "
        "latency, adaptive limits, first-byte timeout 1.5 s, idle 1.0 s, health every 1 s. "
        f"Proxy state sampled every {args.poll / ts:.1f} s. Wall {wall:.0f} s, {load_cpu()}.",
        f"Schedule (victim = the backend with the most in flight at that moment): SIGKILL "
        f"{victims['kill']} at {events['kill']:.1f}, restarted (ready) at "
        f"{events['restarted']:.1f}; SIGSTOP {victims['stall']} at {events['stall']:.1f}, "
        "SIGCONT at "
        f"{events['resume']:.1f}; end {sched['end']:g}.",
        "",
        f"Requests: {ok} completed; failed **before any token: {sum(lost_before.values())}** "
        f"{dict(lost_before) or ''} (target 0); failed mid-stream (bytes already sent, not "
        f"retryable by design): {sum(mid_stream.values())} {dict(mid_stream) or ''}.",
        "",
        "| event | victim in flight / limit / knee before | victim empty after | all clients held "
        "by survivors + queue after | survivors' tok/s back to 90% of before | healthy after "
        "return | serving after return | limit back to 90% of the knee (or limit) after return "
        "| limit back to 90% of the limit after return | limit at end |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for ev, d in report.items():
        lines.append(
            f"| {ev} {victims[ev]} | {d['pre_victim_in_flight']:.1f} / "
            f"{d['pre_victim_limit']:.1f} / {d['pre_victim_knee']:.1f} | "
            f"{s_(d['victim_empty_after_s'])} | {s_(d['clients_held_elsewhere_after_s'])} | "
            f"{s_(d['survivors_tok_s_back_after_s'])} | {s_(d['healthy_after_s'])} | "
            f"{s_(d['serving_after_s'])} | {s_(d['knee_recovered_after_s'])} | "
            f"{s_(d['limit_recovered_after_s'])} | "
            f"{d['victim_limit_end']} |"
        )
    moved = all(
        d["clients_held_elsewhere_after_s"] is not None and d["clients_held_elsewhere_after_s"] <= 2
        for d in report.values()
    )
    recovered = all(
        d["healthy_after_s"] is not None and d["knee_recovered_after_s"] is not None
        for d in report.values()
    )
    lines += [
        "",
        f"No request lost before bytes: **{'met' if not lost_before else 'NOT met'}**. "
        f"Traffic moved within 2 s: **{'met' if moved else 'NOT met'}**. Health and limit "
        f"recovered (to 90% of the pre-fault knee, or limit if none): "
        f"**{'met' if recovered else 'NOT met'}**.",
        "",
        "Time series around each event (modelled s; in flight/limit/state per backend, proxy "
        "queue):",
        "",
        "```",
    ]
    for ev, d in report.items():
        lines.append(f"-- {ev} at {d['at']:.1f}")
        last = -1e9
        for t, s in samples:
            if d["at"] - 1.0 <= t <= d["at"] + 4.0 and t - last >= 0.4:
                last = t
                lines.append(
                    f"{t:7.1f}  "
                    + "  ".join(
                        f"{n}={s[n]['in_flight']:3d}/{s[n]['limit']:3d} {s[n]['state'][:4]}"
                        for n in NAMES
                    )
                    + f"  queue={s['_queue']}"
                )
    lines.append("```")
    text = "\n".join(lines)
    print(text)
    if not args.no_save:
        write_results(
            "faults" + ("-quick" if args.quick else ""),
            text,
            {"time_scale": ts, "clients": args.clients, "schedule": sched, "events": events,
             "victims": victims, "completed": ok, "lost_before_bytes": dict(lost_before),
             "mid_stream": dict(mid_stream), "report": report,
             "samples": [[round(t, 2), s] for t, s in samples]},
        )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
