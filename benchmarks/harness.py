"""Process management shared by the HTTP benchmarks (heterogeneous, overload, faults, replicas).

A `Harness` starts simulators, proxies and sglang-router as child processes bound to
127.0.0.1 on free ports, waits until each answers, runs `loadtest run` levels and loads their
JSON, and stops every child it started when the `with` block ends — also on Ctrl-C and on
SIGTERM (turned into KeyboardInterrupt so the `finally` runs). Logs go to the harness's workdir.

    with Harness("heterogeneous", time_scale=0.25) as h:
        sim = h.sim(["pp8", "tp8", "ep8"])              # one process, three backends
        proxy = h.proxy(proxy_toml(backends=[...], policy="latency", time_scale=0.25))
        level = h.loadtest(proxy.url, ["--concurrency", "32", "--duration", "60"])

`Poller` samples a URL (e.g. /admin/backends) every few hundred ms in a thread while a run
goes on. Everything here is the standard library plus the repository's own console scripts.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtest.workload import LengthDist
from proxy.limits import LimitSettings

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
NGINX = "/usr/sbin/nginx"  # Debian's nginx (apt-get install nginx-light)
RESULTS = REPO / "benchmarks" / "results"
HOST = "127.0.0.1"


def out_argument(ap: argparse.ArgumentParser, name: str) -> None:
    """``--out [BASE]``: write BASE.md and BASE.json (without BASE: benchmarks/results/<name>)."""
    ap.add_argument(
        "--out",
        nargs="?",
        const=str(RESULTS / name),
        default=None,
        metavar="BASE",
        help=f"write BASE.md and BASE.json (without BASE: benchmarks/results/{name})",
    )


def sglang_defaults_argument(ap: argparse.ArgumentParser) -> None:
    """``--sglang-defaults`` and ``--inference-only`` (one at most): what the simulators say of
    themselves; :func:`surface_name` names the choice, :data:`SURFACES` has its flags."""
    g = ap.add_mutually_exclusive_group()
    g.add_argument(
        "--sglang-defaults",
        action="store_true",
        help="simulators started as SGLang is by default: no /metrics, max_running_requests "
        "only in /v1/loads (the proxy hears that and its own requests, no gauges)",
    )
    g.add_argument(
        "--inference-only",
        action="store_true",
        help="simulators that serve inference, health and models only (no /metrics, "
        "/server_info or load report), as a server that is not SGLang: the proxy hears only "
        "its own requests",
    )


@dataclass(frozen=True)
class Surface:
    """What simulators started one way say of themselves: their `loadtest sim` flags, and how
    results name and describe them."""

    flags: tuple[str, ...]
    text: str


#: each choice of :func:`sglang_defaults_argument`, by the name results use
SURFACES = {
    # as SGLang starts by default: no /metrics (they need --enable-metrics), and
    # max_running_requests left to the scheduler (null in /server_info)
    "sglang-defaults": Surface(
        ("--no-metrics", "--max-running-unset"), "simulators with SGLang's defaults: no /metrics"
    ),
    # a server that is not SGLang: inference, health and models only
    "inference-only": Surface(
        ("--inference-only",),
        "simulators serving inference only: no /metrics, /server_info or load report",
    ),
}


def surface_name(args: argparse.Namespace) -> str | None:
    """``sglang-defaults``, ``inference-only``, or None (simulators that say everything)."""
    if args.inference_only:
        return "inference-only"
    return "sglang-defaults" if args.sglang_defaults else None


def sim_surface(args: argparse.Namespace) -> list[str]:
    """The `loadtest sim` flags :func:`sglang_defaults_argument`'s choice asks for."""
    name = surface_name(args)
    return list(SURFACES[name].flags) if name else []


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def positive_int(text: str) -> int:
    """argparse type for counts such as --repeats: a clear error instead of a traceback later."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text!r}")
    return n


def argument_parser(doc: str | None) -> argparse.ArgumentParser:
    """A benchmark's argument parser, described by its docstring's first line. No abbreviated
    options: "--out x" must not be read as "--output-len x" (and fail only after servers
    started)."""
    return argparse.ArgumentParser(description=(doc or "").splitlines()[0], allow_abbrev=False)


def length_arg(text: str) -> str:
    """An ``--output-len`` for loadtest, checked before any server starts (loadtest's syntax)."""
    try:
        LengthDist.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def get_json(url: str, timeout: float = 2.0) -> Any:
    """GET a JSON document; None on any connection or parse error."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return None


def get_text(url: str, timeout: float = 2.0) -> str:
    """GET a text page (e.g. /metrics); "" on any connection error."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.read().decode()
    except OSError:
        return ""


def post_json(url: str, body: Any, timeout: float = 2.0) -> Any:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"null")


def wait_ready(url: str, timeout: float = 30.0, proc: subprocess.Popen | None = None) -> None:
    """Poll until GET url answers 200; fail early if the process died."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process for {url} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} not ready after {timeout} s")


def nginx_conf(directory: Path, port: int, backend_port: int) -> Path:
    """benchmarks/nginx.conf.template filled in for nginx on 127.0.0.1:``port`` relaying to
    127.0.0.1:``backend_port``, its files under ``directory``; the config's path."""
    for sub in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (directory / sub).mkdir(parents=True, exist_ok=True)
    template = (Path(__file__).parent / "nginx.conf.template").read_text()
    conf = directory / "nginx.conf"
    conf.write_text(
        template.replace("{tmp}", str(directory))
        .replace("{port}", str(port))
        .replace("{backend_port}", str(backend_port))
    )
    return conf


def nginx_argv(directory: Path, port: int, backend_port: int) -> list[str]:
    """The command that runs nginx with ``nginx_conf``'s config (its prefix, config and error
    log under ``directory``)."""
    conf = nginx_conf(directory, port, backend_port)
    return [NGINX, "-p", str(directory), "-c", str(conf), "-e", str(directory / "error.log")]


def stop(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """SIGTERM, then SIGKILL after `grace` seconds (a SIGSTOPped child is continued first)."""
    if proc.poll() is not None:
        return
    try:
        proc.send_signal(signal.SIGCONT)
        proc.terminate()
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    except ProcessLookupError:
        pass


@dataclass
class Child:
    """A started child process and where it listens."""

    name: str
    proc: subprocess.Popen
    url: str
    urls: list[str] = field(default_factory=list)  # a simulator: one per backend
    cmd: list[str] = field(default_factory=list)
    log: Path | None = None


class Harness:
    """Starts children, remembers them, and stops them all on exit (also on Ctrl-C)."""

    def __init__(self, name: str, time_scale: float = 1.0, workdir: Path | None = None) -> None:
        self.time_scale = time_scale
        self.workdir = workdir or Path("/tmp") / f"pipefill-bench-{name}-{os.getpid()}"
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.children: list[Child] = []
        self._n = 0
        self._old_term: Any = None

    # -- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> Harness:
        if threading.current_thread() is threading.main_thread():
            self._old_term = signal.signal(signal.SIGTERM, _raise_interrupt)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        if self._old_term is not None:
            signal.signal(signal.SIGTERM, self._old_term)

    def close(self) -> None:
        for c in reversed(self.children):
            stop(c.proc)
        self.children.clear()

    def stop(self, child: Child) -> None:
        stop(child.proc)
        if child in self.children:
            self.children.remove(child)

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> Child:
        self._n += 1
        log = self.workdir / f"{self._n:02d}-{name}.log"
        with log.open("wb") as f:
            proc = subprocess.Popen(
                cmd,
                stdout=f,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.workdir,
                env={**os.environ, **(env or {})},
                start_new_session=True,  # Ctrl-C reaches us only; we stop the children
            )
        child = Child(name=name, proc=proc, url="", cmd=cmd, log=log)
        self.children.append(child)
        return child

    # -- servers ---------------------------------------------------------------------------
    def sim(
        self,
        profiles: Iterable[str],
        *,
        ports: list[int] | None = None,
        extra: Iterable[str] = (),
        name: str = "sim",
        seed: int = 1,
    ) -> Child:
        """One `loadtest sim` process serving one backend per profile."""
        profiles = list(profiles)
        ports = ports or [free_port() for _ in profiles]
        cmd = [str(BIN / "loadtest"), "sim", "--time-scale", str(self.time_scale)]
        cmd += ["--seed", str(seed)]
        for p, port in zip(profiles, ports, strict=True):
            cmd += ["--profile", p, "--port", str(port)]
        cmd += list(extra)
        child = self._spawn(name, cmd)
        child.urls = [f"http://{HOST}:{port}" for port in ports]
        child.url = child.urls[0]
        for u in child.urls:
            wait_ready(f"{u}/health", proc=child.proc)
        return child

    def sims(
        self, profiles: Iterable[str], *, seed: int = 1, extra: Iterable[str] = ()
    ) -> list[str]:
        """One `loadtest sim` process per profile (URLs in order): on 2 cores, backends in one
        process slow each other's modelled clock when one of them gets busy."""
        return [
            self.sim([p], name=f"sim-{i}-{Path(p).stem}", seed=seed + i, extra=extra).url
            for i, p in enumerate(profiles)
        ]

    def restart(self, child: Child) -> Child:
        """Start the same command again (same ports) after it was killed; wait until ready."""
        if child.proc.poll() is None:
            stop(child.proc)
        if child in self.children:
            self.children.remove(child)
        new = self._spawn(child.name, child.cmd)
        new.url, new.urls = child.url, child.urls
        for u in new.urls:
            wait_ready(f"{u}/health", proc=new.proc)
        return new

    def proxy(self, config: str, *, name: str = "proxy") -> Child:
        """A `proxy --config` from TOML text (its [server] port must be free)."""
        self._n += 1
        cfg = self.workdir / f"{self._n:02d}-{name}.toml"
        cfg.write_text(config)
        port = _toml_port(config)
        child = self._spawn(name, [str(BIN / "proxy"), "--config", str(cfg)])
        child.url = f"http://{HOST}:{port}"
        wait_ready(f"{child.url}/health", proc=child.proc)
        return child

    def nginx(self, backend_url: str, *, name: str = "nginx") -> Child:
        """nginx (Debian's, one worker, ``proxy_buffering off``) relaying to ``backend_url``:
        a relay written in C, as the reference for what any proxy's timing does."""
        port = free_port()
        argv = nginx_argv(self.workdir / name, port, int(backend_url.rsplit(":", 1)[1]))
        child = self._spawn(name, argv)
        child.url = f"http://{HOST}:{port}"
        wait_ready(f"{child.url}/health", proc=child.proc)
        return child

    def router(
        self, worker_urls: list[str], policy: str = "round_robin", *, name: str = "router"
    ) -> Child:
        """sglang-router (PyPI wheel) in front of `worker_urls`."""
        port, mport = free_port(), free_port()
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", HOST]
        cmd += ["--port", str(port), "--prometheus-host", HOST, "--prometheus-port", str(mport)]
        cmd += ["--worker-urls", *worker_urls, "--policy", policy, "--log-level", "warn"]
        child = self._spawn(name, cmd, env={"HF_HUB_OFFLINE": "1", "NO_COLOR": "1"})
        child.url = f"http://{HOST}:{port}"
        wait_ready(f"{child.url}/v1/models", timeout=60, proc=child.proc)
        return child

    # -- load ------------------------------------------------------------------------------
    def loadtest_cmd(self, url: str, args: list[str], out: Path) -> list[str]:
        cmd = [str(BIN / "loadtest"), "run", "--url", url, "--time-scale", str(self.time_scale)]
        return cmd + list(args) + ["--out", str(out), "--quiet"]

    def start_loadtest(self, url: str, args: list[str], *, name: str = "loadtest") -> Child:
        """`loadtest run` in the background; `finish_loadtest` waits and loads its JSON."""
        self._n += 1
        out = self.workdir / f"{self._n:02d}-{name}.json"
        child = self._spawn(name, self.loadtest_cmd(url, args, out))
        child.url = str(out)  # where its results land
        return child

    def finish_loadtest(self, child: Child, timeout: float = 600.0) -> dict[str, Any]:
        try:
            rc = child.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop(child.proc)
            raise RuntimeError(f"loadtest {child.name} did not finish in {timeout} s") from None
        if child in self.children:
            self.children.remove(child)
        if rc != 0:
            tail = child.log.read_text()[-2000:] if child.log else ""
            raise RuntimeError(f"loadtest {child.name} exited {rc} (log {child.log}):\n{tail}")
        return json.loads(Path(child.url).read_text())

    def loadtest(self, url: str, args: list[str], *, name: str = "loadtest") -> dict[str, Any]:
        """Run `loadtest run` to completion and return its results JSON."""
        return self.finish_loadtest(self.start_loadtest(url, args, name=name))


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _toml_port(config: str) -> int:
    import tomllib

    return int(tomllib.loads(config)["server"]["port"])


class Poller:
    """Calls `fetch()` every `interval` wall seconds in a thread; keeps (t, value) samples.

    t is seconds since `t0` (default: when started), on the monotonic clock."""

    def __init__(
        self, fetch: Callable[[], Any], interval: float = 0.2, t0: float | None = None
    ) -> None:
        self.fetch, self.interval = fetch, interval
        self.t0 = t0
        self.samples: list[tuple[float, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Poller:
        if self.t0 is None:
            self.t0 = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.monotonic()
            value = self.fetch()
            if value is not None:
                self.samples.append((t - self.t0, value))
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - t)))


def backends_by_name(proxy_url: str) -> Callable[[], dict[str, dict] | None]:
    """A fetch function for Poller: /admin/backends as {name: backend dict}."""

    def fetch() -> dict[str, dict] | None:
        d = get_json(f"{proxy_url}/admin/backends", timeout=1.0)
        if not isinstance(d, dict):
            return None
        return {b["name"]: b for b in d.get("backends", [])}

    return fetch


# -- proxy configuration ---------------------------------------------------------------------
def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {v!r} as TOML")


def toml_table(values: dict[str, Any]) -> str:
    """A flat TOML table (a simulator profile's fields); None values are left out."""
    return "".join(f"{k} = {_toml_value(v)}\n" for k, v in values.items() if v is not None)


def proxy_toml(
    backends: list[dict[str, Any]],
    *,
    port: int | None = None,
    policy: str = "latency",
    time_scale: float = 1.0,
    **sections: dict[str, Any],
) -> str:
    """Proxy configuration TOML for `backends` ({name, url, parallelism, pp_size, ...}).

    Durations that pace the proxy (observation windows, the limits' probe interval, scrape
    and health intervals, ejection, retry backoff) are scaled
    by `time_scale`, so that they stay one modelled second (etc.) against a simulator running at
    that scale. `sections` (server=, queue=, limits=, health=, timeouts=, retries=, scrape=,
    ...) override or add keys, given in wall seconds."""
    ts = time_scale
    base: dict[str, dict[str, Any]] = {
        "server": {"host": HOST, "port": port or free_port(), "shutdown_grace_s": 1,
                   "drain_s": 0, "log_level": "warning"},
        "routing": {"policy": policy},
        "limits": {"window_s": 1.0 * ts, "max_window_s": 5.0 * ts,
                   "probe_every_s": LimitSettings().probe_every_s * ts},
        "scrape": {"interval_s": max(1.0 * ts, 0.05)},
        "health": {"interval_s": max(1.0 * ts, 0.05), "timeout_s": max(1.0 * ts, 0.2),
                   "eject_s": max(2.0 * ts, 0.1)},
        "retries": {"backoff_base_s": 0.02 * ts, "backoff_max_s": 0.5 * ts},
        "queue": {"deadline_s": 3600},
    }  # fmt: skip
    for sec, keys in sections.items():
        base.setdefault(sec, {}).update(keys)
    lines: list[str] = []
    for sec, keys in base.items():
        lines.append(f"[{sec}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in keys.items()]
        lines.append("")
    for b in backends:
        lines.append("[[backends]]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in b.items() if v is not None]
        lines.append("")
    return "\n".join(lines)


def backend_entries(urls: list[str], profiles: list[str]) -> list[dict[str, Any]]:
    """[[backends]] entries for simulator URLs, with the parallelism hint of each profile."""
    out = []
    for url, prof in zip(urls, profiles, strict=True):
        par = prof[:2] if prof[:2] in ("pp", "tp", "ep") else None
        out.append({"name": prof, "url": url, "parallelism": par,
                    "pp_size": 8 if par == "pp" else None})  # fmt: skip
    return out


# -- results ---------------------------------------------------------------------------------
def level_row(level: dict[str, Any]) -> dict[str, Any]:
    """The numbers the benchmarks compare, from one level of a `loadtest run --out` JSON."""

    def q(key: str, p: str) -> float | None:
        d = level.get(key) or {}
        return d.get(p)

    return {
        "output_tok_s": level.get("output_tok_s"),
        "ttft_p50": q("ttft", "p50"),
        "ttft_p99": q("ttft", "p99"),
        "e2e_p50": q("e2e", "p50"),
        "e2e_p99": q("e2e", "p99"),
        "completed": level.get("completed"),
        "failed": level.get("failed"),
        "achieved_concurrency": level.get("achieved_concurrency"),
    }


def write_results(name: str, markdown: str, data: dict[str, Any], out: Path | None = None) -> None:
    """benchmarks/results/<name>.md and .json (or `out` without suffix)."""
    base = out or RESULTS / name
    base.parent.mkdir(parents=True, exist_ok=True)
    base.with_suffix(".md").write_text(markdown.rstrip() + "\n")
    base.with_suffix(".json").write_text(json.dumps(data, indent=1, default=str) + "\n")


def commit() -> str:
    """The checkout's commit (short), for a result's header; "unknown" outside git."""
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def load_cpu() -> str:
    """A note on how busy the machine was (benchmarks on shared cores)."""
    try:
        return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "load average unknown"


def window_wall(result: dict[str, Any], level: int = 0) -> tuple[float, float]:
    """A level's steady-state window on the wall monotonic clock (the Poller's clock).

    With --time-scale, loadtest reports times as origin + (wall - origin) / scale, origin being
    the run's start; the first request's scheduled time stands in for it (needs
    --save-records; exact to the few ms between the start and the first send)."""
    ts = float(result["metadata"].get("time_scale") or 1.0)
    w0, w1 = result["levels"][level]["window"]
    recs = result.get("records") or []
    if not recs:
        raise ValueError("window_wall needs the run's records (--save-records)")
    origin = min(r["t_scheduled"] for r in recs)
    return origin + (w0 - origin) * ts, origin + (w1 - origin) * ts
