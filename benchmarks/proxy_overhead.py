"""What a proxy costs: direct vs pipefill vs nginx vs sglang-router, on the same simulator.

    .venv/bin/python benchmarks/proxy_overhead.py            # full run, ~5-6 minutes
    .venv/bin/python benchmarks/proxy_overhead.py --quick    # smoke run, ~1 minute
    ... --out benchmarks/results/proxy_overhead                   # also write .md and .json

One simulator backend (a custom fixed-cost profile, written to the temp dir: 20 ms per decode
step + 0.05 ms per running request, real time, so the HTTP path and not the model is what varies)
is reached four ways: directly, through ``proxy`` (pipefill), through nginx (Debian package,
``proxy_buffering off``, keepalive upstream) and through sglang-router (round_robin). Targets are
measured interleaved (every level visits all four targets; repeated rounds reverse the order) with
``loadtest run`` as the client, and the script prints, relative to direct: aggregate output tok/s
at C = 1, 32 and 256 streams, the TTFT and ITL p50/p99 each proxy adds, and non-streamed
max_tokens=1 requests per second with each proxy's CPU (utime+stime from /proc/<pid>/stat,
summed over the proxy's process tree, inside the measured window).

CPU pinning (2 cores): the simulator and the load generator share CPU 0; the proxy under test gets
CPU 1 to itself (nginx: one worker; the router's threads and pipefill's event loop are pinned
there with taskset). Everything binds 127.0.0.1 on free ports, every run is bounded, and every
child is killed on exit, error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness import NGINX, free_port, nginx_argv  # a script beside this one

ROOT = Path(__file__).resolve().parent.parent
MODEL = "bench/fast"
CLIENT_CPU = "0"  # simulator + load generator
PROXY_CPU = "1"  # the proxy under test
TARGETS = ("direct", "pipefill", "nginx", "sglang-router")

PROFILE = f"""\
name = "bench-fast"
description = "proxy benchmark: fixed-cost steps (20 ms + 0.05 ms per running request)"
model_name = "{MODEL}"
parallelism = "tp"
context_length = 32768
max_running_requests = 1024
max_total_tokens = 4000000
chunked_prefill_size = 65536
new_token_ratio = 0.3
num_layers = 1
step_overhead_ms = 20.0
weights_ms = 0.0
num_experts = 8
effective_experts = 8
experts_per_token = 1
expert_read_ms = 0.0
compute_ms_per_token = 0.05
prefill_ms_per_token = 0.001
comm_ops_per_layer = 0
comm_latency_us = 0.0
comm_us_per_token = 0.0
"""

PIPEFILL_CONFIG = """\
[server]
host = "127.0.0.1"
port = {port}
log_level = "warning"
drain_s = 0

[routing]
policy = "round_robin"

[limits]            # no adaptive limit: measure forwarding, not admission control
algorithm = "fixed"
initial = 4096
max_limit = 4096

[queue]
max_length = 4096

[[backends]]
name = "sim"
url = "{backend}"
"""

# (concurrency, warmup s, window s, rounds)
STREAM_LEVELS = {
    "full": [(1, 1.0, 8.0, 1), (32, 3.0, 8.0, 1), (256, 4.5, 10.0, 2)],
    "quick": [(1, 0.5, 2.0, 1), (32, 0.5, 2.0, 1), (256, 1.0, 3.0, 1)],
}
RPS = {"full": (64, 2.0, 8.0), "quick": (64, 0.5, 2.0)}  # (concurrency, warmup s, window s)
STREAM_WORKLOAD = ["--input-len", "128", "--output-len", "uniform:16-112", "--seed", "7"]
RPS_WORKLOAD = ["--no-stream", "--input-len", "16", "--output-len", "1", "--seed", "7"]


class BenchError(Exception):
    """A one-line, user-facing failure."""


# ---- child processes --------------------------------------------------------------------


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(3)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(3)


class Children:
    """Every process this benchmark started; ``stop_all`` kills them (their process groups)."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.items: list[Child] = []
        self.taskset = shutil.which("taskset")

    def start(
        self, name: str, argv: list[str], *, cpu: str | None, env: dict | None = None
    ) -> Child:
        if cpu is not None and self.taskset:
            argv = [self.taskset, "-c", cpu, *argv]
        log = self.tmp / f"{name}.log"
        with open(log, "wb") as fh:
            proc = subprocess.Popen(
                argv,
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=ROOT,
                env={**os.environ, **(env or {})},
                start_new_session=True,  # its own process group: killed with everything it spawns
            )
        child = Child(name, proc, log)
        self.items.append(child)
        return child

    def stop_all(self) -> None:
        for c in reversed(self.items):
            c.stop()


def tool(name: str) -> str:
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if not found:
        raise BenchError(f"{name!r} not found (install pipefill into this Python's venv)")
    return found


def tail(path: Path, n: int = 5) -> str:
    with contextlib.suppress(OSError):
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-n:])
    return ""


def wait_ready(child: Child, url: str, timeout: float = 40.0) -> None:
    """Until a tiny chat request through ``url`` answers 200."""
    body = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    ).encode()
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if not child.alive():
            raise BenchError(f"{child.name} exited during start-up: {tail(child.log)}")
        req = urllib.request.Request(
            url + "/v1/chat/completions", body, {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=3) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError) as e:
            last = str(e)
        time.sleep(0.25)
    raise BenchError(f"{child.name} not ready at {url} after {timeout:g} s ({last})")


# ---- CPU accounting ---------------------------------------------------------------------

TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[int, float] | None:
    """(ppid, utime+stime seconds) of one process."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK


def tree_cpu(roots: dict[str, int]) -> dict[str, float]:
    """CPU seconds of each root process and its live descendants (all threads included)."""
    stats: dict[int, tuple[int, float]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            s = _stat(int(d))
            if s is not None:
                stats[int(d)] = s
    kids: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        kids.setdefault(ppid, []).append(pid)
    out = {}
    for name, root in roots.items():
        total, todo = 0.0, [root]
        while todo:
            pid = todo.pop()
            total += stats.get(pid, (0, 0.0))[1]
            todo += kids.get(pid, [])
        out[name] = total
    return out


class CpuSampler(threading.Thread):
    """Samples each watched process tree's CPU seconds every 0.1 s (monotonic timestamps: the
    same clock as the load generator's windows)."""

    def __init__(self, pids: dict[str, int]) -> None:
        super().__init__(daemon=True)
        self.pids = pids
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()

    def run(self) -> None:
        while not self._stop.is_set():
            t = time.monotonic()
            self.samples.append((t, tree_cpu(self.pids)))
            self._stop.wait(0.1)

    def stop(self) -> None:
        self._stop.set()

    def busy(self, name: str, w0: float, w1: float) -> float | None:
        """Fraction of one core used by ``name`` over [w0, w1]."""
        inside = [(t, s[name]) for t, s in self.samples if w0 <= t <= w1 and name in s]
        if len(inside) < 2 or inside[-1][0] - inside[0][0] <= 0:
            return None
        (t0, c0), (t1, c1) = inside[0], inside[-1]
        return (c1 - c0) / (t1 - t0)


# ---- measurements -----------------------------------------------------------------------


@dataclass
class Run:
    target: str
    concurrency: int
    stream: bool
    level: dict[str, Any]
    proxy_cpu: float | None
    sim_cpu: float | None

    def metric(self, name: str, q: str = "p50") -> float | None:
        v = self.level.get(name) or {}
        return v.get(q) if isinstance(v, dict) else None

    @property
    def warnings(self) -> list[str]:
        out = list((self.level.get("selfcheck") or {}).get("warnings") or [])
        # requests still running after the window are cancelled on purpose (--drain-timeout 1)
        return [w for w in out if not (w.startswith("error rate") and "(cancelled=" in w)]


@dataclass
class Bench:
    children: Children
    sampler: CpuSampler
    urls: dict[str, str]
    tmp: Path
    runs: list[Run] = field(default_factory=list)

    def loadtest(self, target: str, c: int, warmup: float, window: float, stream: bool) -> Run:
        out = self.tmp / f"lt-{target}-{c}-{'s' if stream else 'n'}-{len(self.runs)}.json"
        argv = [
            tool("loadtest"), "run", "--url", self.urls[target], "--model", MODEL,
            "--concurrency", str(c), "--warmup", str(warmup), "--duration", str(window),
            "--drain-timeout", "1", "--time-scale", "1", "--request-timeout", "60",
            *(STREAM_WORKLOAD if stream else RPS_WORKLOAD), "--out", str(out), "--quiet",
        ]  # fmt: skip
        if self.children.taskset:
            argv = [self.children.taskset, "-c", CLIENT_CPU, *argv]
        budget = warmup + window + 40
        try:
            res = subprocess.run(
                argv, cwd=ROOT, capture_output=True, text=True, timeout=budget,
                start_new_session=True,
            )  # fmt: skip
        except subprocess.TimeoutExpired as e:
            raise BenchError(f"loadtest against {target} at C={c} ran over {budget:.0f} s") from e
        if res.returncode != 0 or not out.exists():
            msg = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["?"]
            raise BenchError(f"loadtest against {target} at C={c} failed: {msg[0]}")
        level = json.loads(out.read_text())["levels"][0]
        w0, w1 = level["window"]
        run = Run(
            target, c, stream, level,
            self.sampler.busy(target, w0, w1) if target != "direct" else None,
            self.sampler.busy("sim", w0, w1),
        )  # fmt: skip
        self.runs.append(run)
        tps = level.get("output_tok_s") or 0.0
        rps = level.get("request_throughput") or 0.0
        what = f"{tps:8.0f} tok/s" if stream else f"{rps:8.0f} req/s"
        cpu = f"  proxy CPU {run.proxy_cpu:.0%}" if run.proxy_cpu is not None else ""
        errs = sum((level.get("errors") or {}).values())
        print(
            f"  {'stream' if stream else 'no-stream'} C={c:<4} {target:<14} {what}{cpu}"
            + (f"  ERRORS {errs}" if errs else ""),
            flush=True,
        )
        return run

    def select(self, target: str, c: int, stream: bool) -> list[Run]:
        return [
            r for r in self.runs if r.target == target and r.concurrency == c and r.stream == stream
        ]


def med(values: list[float | None]) -> float | None:
    vs = [v for v in values if v is not None]
    return statistics.median(vs) if vs else None


# ---- report -------------------------------------------------------------------------------


def fmt(v: float | None, spec: str = ".0f", unit: str = "") -> str:
    return "—" if v is None else f"{v:{spec}}{unit}"


def summarize(bench: Bench, mode: str, targets: list[str], meta: dict) -> dict[str, Any]:
    levels = [c for c, *_ in STREAM_LEVELS[mode]]
    rps_c = RPS[mode][0]
    out: dict[str, Any] = {"metadata": meta, "stream": {}, "rps": {}}
    for t in targets:
        out["stream"][t] = {}
        for c in levels:
            rs = bench.select(t, c, True)
            out["stream"][t][c] = {
                "runs": len(rs),
                "output_tok_s": med([r.level.get("output_tok_s") for r in rs]),
                "ttft_p50": med([r.metric("ttft", "p50") for r in rs]),
                "ttft_p99": med([r.metric("ttft", "p99") for r in rs]),
                "itl_p50": med([r.metric("itl", "p50") for r in rs]),
                "itl_p99": med([r.metric("itl", "p99") for r in rs]),
                "errors": sum(sum((r.level.get("errors") or {}).values()) for r in rs),
                "proxy_cpu": med([r.proxy_cpu for r in rs]),
                "sim_cpu": med([r.sim_cpu for r in rs]),
                "client_warnings": sorted({w for r in rs for w in r.warnings}),
                "each_output_tok_s": [r.level.get("output_tok_s") for r in rs],
            }
        rs = bench.select(t, rps_c, False)
        rps = med([r.level.get("request_throughput") for r in rs])
        cpu = med([r.proxy_cpu for r in rs])
        out["rps"][t] = {
            "concurrency": rps_c,
            "req_s": rps,
            "proxy_cpu": cpu,
            "proxy_cpu_ms_per_req": (cpu / rps * 1e3) if cpu is not None and rps else None,
            "sim_cpu": med([r.sim_cpu for r in rs]),
            "e2e_p50": med([r.metric("e2e", "p50") for r in rs]),
            "errors": sum(sum((r.level.get("errors") or {}).values()) for r in rs),
            "client_warnings": sorted({w for r in rs for w in r.warnings}),
        }
    d = out["stream"].get("direct", {})
    p = out["stream"].get("pipefill", {}).get(256)
    if d.get(256) and p and d[256]["output_tok_s"] and p["output_tok_s"] is not None:
        ratio = p["output_tok_s"] / d[256]["output_tok_s"]
        added = (p["ttft_p50"] - d[256]["ttft_p50"]) * 1e3
        out["target"] = {
            "tok_s_ratio_c256": ratio,
            "added_ttft_p50_ms_c256": added,
            "met": ratio >= 0.98 and added < 2.0,
        }
    return out


def render(s: dict[str, Any]) -> str:
    st, rp = s["stream"], s["rps"]
    targets = list(st)
    levels = list(next(iter(st.values())))
    d = st["direct"]
    lines = ["## Streaming: aggregate output tok/s (ratio to direct)", ""]
    lines.append("| target | " + " | ".join(f"C={c}" for c in levels) + " | errors |")
    lines.append("|---|" + "---:|" * len(levels) + "---:|")
    for t in targets:
        cells = []
        for c in levels:
            v, base = st[t][c]["output_tok_s"], d[c]["output_tok_s"]
            ratio = f" ({v / base:.3f})" if v is not None and base else ""
            cells.append(fmt(v) + ratio)
        errs = sum(st[t][c]["errors"] for c in levels)
        lines.append(f"| {t} | " + " | ".join(cells) + f" | {errs} |")
    lines += ["", "## Streaming latency (ms; + what the proxy adds vs direct)", ""]
    lines.append("| C | target | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | proxy CPU (1 core) |")
    lines.append("|---:|---|---:|---:|---:|---:|---:|")
    for c in levels:
        for t in targets:
            row = st[t][c]
            cells = []
            for k in ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99"):
                v, base = row[k], d[c][k]
                if v is None:
                    cells.append("—")
                elif t == "direct" or base is None:
                    cells.append(f"{v * 1e3:.2f}")
                else:
                    cells.append(f"{v * 1e3:.2f} ({(v - base) * 1e3:+.2f})")
            cpu = fmt(row["proxy_cpu"] * 100 if row["proxy_cpu"] is not None else None, ".0f", "%")
            lines.append(f"| {c} | {t} | " + " | ".join(cells) + f" | {cpu} |")
    c_rps = rp["direct"]["concurrency"]
    lines += [
        "",
        f"## Non-streamed max_tokens=1 requests, C={c_rps} closed loop",
        "",
        "| target | req/s (ratio to direct) | proxy CPU (1 core) | proxy CPU ms / request "
        "| simulator CPU | E2E p50 ms | errors |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    base = rp["direct"]["req_s"]
    for t in targets:
        r = rp[t]
        ratio = f" ({r['req_s'] / base:.3f})" if r["req_s"] is not None and base else ""
        lines.append(
            f"| {t} | {fmt(r['req_s'])}{ratio} | "
            f"{fmt(r['proxy_cpu'] * 100 if r['proxy_cpu'] is not None else None, '.0f', '%')} | "
            f"{fmt(r['proxy_cpu_ms_per_req'], '.3f')} | "
            f"{fmt(r['sim_cpu'] * 100 if r['sim_cpu'] is not None else None, '.0f', '%')} | "
            f"{fmt(r['e2e_p50'] * 1e3 if r['e2e_p50'] is not None else None, '.2f')} | "
            f"{r['errors']} |"
        )
    tgt = s.get("target")
    if tgt:
        lines += [
            "",
            f"**Target (issue 4)**: at C=256 streaming pipefill delivers "
            f"{tgt['tok_s_ratio_c256']:.1%} of direct tok/s (target >= 98%) and adds "
            f"{tgt['added_ttft_p50_ms_c256']:+.2f} ms to TTFT p50 (target < 2 ms): "
            f"**{'met' if tgt['met'] else 'NOT met'}**.",
        ]
    warn = sorted(
        {f"{t} C={c}: {w}" for t in targets for c in levels for w in st[t][c]["client_warnings"]}
        | {f"{t} no-stream: {w}" for t in targets for w in rp[t]["client_warnings"]}
    )
    if warn:
        lines += ["", "Load-generator self-check warnings:", ""] + [f"- {w}" for w in warn]
    return "\n".join(lines) + "\n"


# ---- main ---------------------------------------------------------------------------------


def versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0]}
    with contextlib.suppress(Exception):
        r = subprocess.run([NGINX, "-v"], capture_output=True, text=True, timeout=5)
        out["nginx"] = (r.stderr or r.stdout).strip().split("/")[-1]
    for mod in ("aiohttp", "sglang-router", "pipefill", "uvloop"):
        with contextlib.suppress(Exception):
            from importlib.metadata import version

            out[mod] = version(mod)
    return out


def start_nginx(ch: Children, tmp: Path, backend_port: int, cpu: str) -> tuple[Child, int]:
    """nginx (one worker, its files in ``tmp``) relaying to 127.0.0.1:``backend_port``; the
    child and the port it listens on."""
    port = free_port()
    return ch.start("nginx", nginx_argv(tmp / "nginx", port, backend_port), cpu=cpu), port


def start_all(ch: Children, tmp: Path, targets: list[str]) -> tuple[dict[str, str], dict[str, int]]:
    profile = tmp / "bench-fast.toml"
    profile.write_text(PROFILE)
    sim_port = free_port()
    sim_url = f"http://127.0.0.1:{sim_port}"
    sim = ch.start(
        "sim",
        [tool("loadtest"), "sim", "--profile", str(profile), "--port", str(sim_port)],
        cpu=CLIENT_CPU,
    )
    wait_ready(sim, sim_url)
    urls, pids = {"direct": sim_url}, {"sim": sim.pid}
    starting: list[tuple[Child, str, str]] = []
    if "pipefill" in targets:
        port = free_port()
        cfg = tmp / "pipefill.toml"
        cfg.write_text(PIPEFILL_CONFIG.format(port=port, backend=sim_url))
        c = ch.start("pipefill", [tool("proxy"), "--config", str(cfg)], cpu=PROXY_CPU)
        starting.append((c, "pipefill", f"http://127.0.0.1:{port}"))
    if "nginx" in targets:
        c, port = start_nginx(ch, tmp, sim_port, PROXY_CPU)
        starting.append((c, "nginx", f"http://127.0.0.1:{port}"))
    if "sglang-router" in targets:
        port, prom = free_port(), free_port()
        c = ch.start(
            "sglang-router",
            [
                sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                "--port", str(port), "--prometheus-host", "127.0.0.1", "--prometheus-port",
                str(prom), "--worker-urls", sim_url, "--policy", "round_robin",
                "--log-level", "warn",
            ],
            cpu=PROXY_CPU,
            env={"HF_HUB_OFFLINE": "1"},
        )  # fmt: skip
        starting.append((c, "sglang-router", f"http://127.0.0.1:{port}"))
    for c, name, url in starting:
        wait_ready(c, url, timeout=60.0)
        urls[name], pids[name] = url, c.pid
    return urls, pids


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="~1 minute smoke run (short windows)")
    ap.add_argument("--out", metavar="PREFIX", help="write PREFIX.md and PREFIX.json")
    ap.add_argument(
        "--targets",
        default=",".join(TARGETS),
        help=f"comma-separated subset of {','.join(TARGETS)} (direct is always measured)",
    )
    ap.add_argument(
        "--scale", type=float, default=1.0, help="multiply every warmup and window (tests: 0.2)"
    )
    ap.add_argument("--keep-tmp", action="store_true", help="keep the temp dir (logs, JSON)")
    args = ap.parse_args(argv)
    mode = "quick" if args.quick else "full"
    targets = ["direct"] + [t for t in args.targets.split(",") if t and t != "direct"]
    unknown = set(targets) - set(TARGETS)
    if unknown:
        print(f"proxy_overhead: unknown target(s): {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    if "nginx" in targets and not Path(NGINX).exists():
        print(f"proxy_overhead: {NGINX} not found (apt-get install nginx)", file=sys.stderr)
        return 2

    def on_term(_sig: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    tmp = Path(tempfile.mkdtemp(prefix="pipefill-bench-"))
    ch = Children(tmp)
    sampler: CpuSampler | None = None
    t_start = time.monotonic()
    try:
        print(f"starting simulator and {', '.join(targets[1:])} (temp dir {tmp})", flush=True)
        urls, pids = start_all(ch, tmp, targets)
        sampler = CpuSampler(pids)
        sampler.start()
        bench = Bench(ch, sampler, urls, tmp)
        k = args.scale
        for c, warmup, window, rounds in STREAM_LEVELS[mode]:
            for r in range(rounds):
                order = targets if r % 2 == 0 else targets[::-1]
                for t in order:
                    bench.loadtest(t, c, warmup * k, window * k, stream=True)
        c, warmup, window = RPS[mode]
        for t in targets:
            bench.loadtest(t, c, warmup * k, window * k, stream=False)
        meta = {
            "mode": mode,
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "elapsed_s": round(time.monotonic() - t_start, 1),
            "cpus": os.cpu_count(),
            "pinning": {
                "simulator+loadtest": CLIENT_CPU if ch.taskset else None,
                "proxy": PROXY_CPU if ch.taskset else None,
            },
            "profile": PROFILE,
            "stream_levels": STREAM_LEVELS[mode],
            "stream_workload": STREAM_WORKLOAD,
            "rps": RPS[mode],
            "scale": args.scale,
            "rps_workload": RPS_WORKLOAD,
            "versions": versions(),
            "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        }
        summary = summarize(bench, mode, targets, meta)
        text = render(summary)
        print()
        print(text)
        if args.out:
            prefix = Path(args.out)
            prefix.parent.mkdir(parents=True, exist_ok=True)
            prefix.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")
            header = (
                "# Proxy overhead: direct vs pipefill vs nginx vs sglang-router\n\n"
                f"`{meta['command']}` — {meta['started_at']}, {meta['elapsed_s']:.0f} s, "
                f"{meta['cpus']} CPUs; simulator + loadtest on CPU {CLIENT_CPU}, proxy on CPU "
                f"{PROXY_CPU}. Versions: "
                + ", ".join(f"{k} {v}" for k, v in meta["versions"].items())
                + ". Setup and how to read this: docs/benchmarks-proxy.md.\n\n"
            )
            prefix.with_suffix(".md").write_text(header + text)
            print(f"wrote {prefix.with_suffix('.md')} and {prefix.with_suffix('.json')}")
        print(f"elapsed {time.monotonic() - t_start:.0f} s")
        return 0
    except BenchError as e:
        print(f"proxy_overhead: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("proxy_overhead: interrupted", file=sys.stderr)
        return 130
    finally:
        if sampler is not None:
            sampler.stop()
        ch.stop_all()
        if not args.keep_tmp:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
