"""`loadtest demo`: three simulated backends (pp8, tp8, ep8) and the proxy in front of them.

    loadtest demo                      # ~2 minutes on 2 cores
    loadtest demo --quick              # a few seconds (what the tests run)

Everything runs in this one process, on one event loop: the simulators (loadtest.sim.server),
the proxy (proxy.app.ProxyServer, default routing and adaptive limits) and the load generator
(loadtest.runner.Sweep). The same closed-loop sweep runs against each backend directly and then
through the proxy; one table compares them. The simulators are time-scaled (``--time-scale``);
every time and rate reported is in modelled seconds, as the real deployment would measure it.
Documentation: docs/demo.md.
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtest.cli import CliError
from loadtest.interrupt import run_stoppable
from loadtest.run_cli import DEFAULT_CONCURRENCY, _nonneg, _positive, _positive_ints

PROFILES = ("pp8", "tp8", "ep8")
PROXY = "proxy"
DEFAULT_TIME_SCALE = 0.2
DEFAULT_DURATION = 30.0  # modelled seconds of steady-state window per level
# Modelled seconds before each window opens: one whole 256-token answer at C=32 (13-21 s), so
# the window sees steady state — also the proxy's, whose limits start each level from where the
# previous, smaller one left them.
DEFAULT_WARMUP = 20.0
DEFAULT_OUT_DIR = "demo-results"
PLOT_FILE = "demo.png"

# Proxy settings measured in seconds that pace its control loops: scaled with the simulators,
# so the proxy decides as often per *modelled* second as it would in front of real servers.
# (Timeouts are not scaled: they only bound failures.)
SCALED_PROXY_SETTINGS = (
    ("limits", "window_s"),
    ("limits", "max_window_s"),
    ("limits", "probe_every_s"),
    ("scrape", "interval_s"),
    ("health", "interval_s"),
    ("queue", "control_interval_s"),
)
MIN_WALL_INTERVAL_S = 0.05  # no control loop faster than this, whatever the scale
DRAIN_S = 1.0  # modelled seconds a level waits after its window before cutting what runs
MIN_WALL_DRAIN_S = 0.02


@dataclass(frozen=True)
class DemoPlan:
    """What one demo runs; durations are modelled seconds."""

    time_scale: float = DEFAULT_TIME_SCALE
    concurrency: tuple[int, ...] = (1, 4, 32)
    duration: float = DEFAULT_DURATION
    warmup: float = DEFAULT_WARMUP
    input_len: int = 512
    output_len: int = 256
    out_dir: Path = Path(DEFAULT_OUT_DIR)
    save_records: bool = False
    plot: bool = True
    progress: bool = False

    def wall_estimate(self) -> float:
        """Wall seconds the sweeps take (4 targets x levels x (warmup + window))."""
        per_level = (self.warmup + self.duration + DRAIN_S) * self.time_scale
        return (len(PROFILES) + 1) * len(self.concurrency) * per_level


QUICK = dict(time_scale=0.05, duration=4.0, warmup=2.0, input_len=64, output_len=32)


@dataclass
class TargetRun:
    """One target's sweep: a backend directly, or the proxy in front of all of them."""

    name: str  # "pp8 direct", "proxy"
    slug: str  # file stem: "pp8-direct", "proxy"
    url: str
    result: Any = None  # loadtest.results.RunResult
    messages: list[str] = field(default_factory=list)
    error: str | None = None
    path: Path | None = None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--time-scale",
        type=_positive,
        default=None,
        metavar="X",
        help=f"wall seconds per modelled second of the simulators (default {DEFAULT_TIME_SCALE}:"
        " five times faster than real; --quick: 0.05)",
    )
    p.add_argument(
        "--duration",
        type=_positive,
        default=None,
        metavar="S",
        help=f"steady-state window per level in modelled seconds (default {DEFAULT_DURATION:g})",
    )
    p.add_argument(
        "--warmup",
        type=_nonneg,
        default=None,
        metavar="S",
        help=f"modelled seconds before each window opens (default {DEFAULT_WARMUP:g})",
    )
    p.add_argument(
        "--concurrency",
        "-c",
        type=_positive_ints,
        default=None,
        metavar="C1,C2,...",
        help=f"closed-loop levels (default {DEFAULT_CONCURRENCY})",
    )
    p.add_argument(
        "--out-dir",
        default=DEFAULT_OUT_DIR,
        metavar="DIR",
        help=f"where the JSON results and the plot go (default ./{DEFAULT_OUT_DIR})",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="a very short run (seconds; short prompts and answers): a smoke test",
    )
    p.add_argument(
        "--save-records", action="store_true", help="include every request's record in the JSON"
    )
    p.add_argument("--no-plot", action="store_true", help="do not write the plot")
    p.add_argument("--quiet", "-q", action="store_true", help="no live progress")


def plan_from_args(args: argparse.Namespace) -> DemoPlan:
    base: dict[str, Any] = dict(QUICK) if args.quick else {}
    if args.time_scale is not None:
        base["time_scale"] = args.time_scale
    if args.duration is not None:
        base["duration"] = args.duration
    if args.warmup is not None:
        base["warmup"] = args.warmup
    if args.concurrency:
        base["concurrency"] = tuple(args.concurrency)
    return DemoPlan(
        **base,
        out_dir=Path(args.out_dir),
        save_records=args.save_records,
        plot=not args.no_plot,
        progress=not args.quiet and sys.stdout.isatty(),
    )


# ---- the servers ----------------------------------------------------------------------------


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports on 127.0.0.1 (held open together so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def proxy_settings(backends: Sequence[Any], time_scale: float) -> Any:
    """The proxy's default settings in front of ``backends`` (SimBackend), on a free port,
    with its pacing intervals scaled like the simulators' clocks."""
    from proxy.settings import Settings, load_settings

    defaults = Settings()
    overrides: dict[str, Any] = {
        "server": {"host": "127.0.0.1", "port": 0, "log_level": "warning", "shutdown_grace_s": 0},
        "backends": [
            {
                "name": b.profile.name,
                "url": f"http://{b.host}:{b.port}",
                "parallelism": b.profile.parallelism,
                "pp_size": b.profile.pp_size,
            }
            for b in backends
        ],
    }
    for section, key in SCALED_PROXY_SETTINGS:
        value = getattr(getattr(defaults, section), key) * time_scale
        overrides.setdefault(section, {})[key] = max(value, MIN_WALL_INTERVAL_S)
    try:
        return load_settings(None, **overrides)
    except Exception as exc:  # ConfigError: e.g. a bad PIPEFILL_* variable in the environment
        raise CliError(f"proxy settings: {exc}") from None


def proxy_state(server: Any) -> dict[str, dict[str, Any]]:
    """Per backend: the proxy's current limit and what it relayed (for the summary)."""
    out: dict[str, dict[str, Any]] = {}
    for b in server.proxy.pool.all():
        out[b.name] = {
            "limit": getattr(b.limit, "limit", None),
            "tokens": b.stats.tokens_total,
            "completions": b.stats.completions_ok,
            "failed": b.stats.completions_failed,
        }
    return out


# ---- the sweeps -----------------------------------------------------------------------------


class Demo:
    """Starts the servers, runs every sweep, stops everything; ``stop()`` ends it early."""

    def __init__(self, plan: DemoPlan, *, say: Callable[[str], None]) -> None:
        self.plan = plan
        self.say = say
        self.runs: list[TargetRun] = []
        self.proxy_state: dict[str, dict[str, Any]] = {}
        self.stopped = False
        self._sweep: Any = None

    def stop(self) -> None:
        self.stopped = True
        if self._sweep is not None:
            self._sweep.stop()

    async def run(self) -> list[TargetRun]:
        from loadtest.sim.profiles import load_profile
        from loadtest.sim.server import SimBackend, serve
        from proxy.app import ProxyServer

        plan = self.plan
        ports = free_ports(len(PROFILES))
        sims = [
            SimBackend(load_profile(name), port=port, time_scale=plan.time_scale, seed=i)
            for i, (name, port) in enumerate(zip(PROFILES, ports, strict=True))
        ]
        async with serve(sims):
            proxy = ProxyServer(proxy_settings(sims, plan.time_scale))
            await proxy.start()
            try:
                for b in sims:
                    self.say(f"  simulator {b.profile.name:<4} http://{b.host}:{b.port}")
                self.say(f"  proxy          {proxy.url}  (policy {proxy.settings.routing.policy},"
                         f" limits {proxy.settings.limits.algorithm})")  # fmt: skip
                self.runs = [
                    TargetRun(f"{b.profile.name} direct", f"{b.profile.name}-direct",
                              f"http://{b.host}:{b.port}")
                    for b in sims
                ] + [TargetRun(PROXY, PROXY, proxy.url)]  # fmt: skip
                for target in self.runs:
                    if self.stopped:
                        break
                    await self._sweep_one(target)
                self.proxy_state = proxy_state(proxy)
            finally:
                await proxy.stop(0)
        return self.runs

    async def _sweep_one(self, target: TargetRun) -> None:
        from loadtest.runner import Sweep, SweepOptions
        from loadtest.workload import LengthDist, WorkloadConfig

        plan = self.plan
        self.say(f"\n{target.name}: {target.url}")
        options = SweepOptions(
            url=target.url,
            concurrency=list(plan.concurrency),
            duration=plan.duration,
            warmup=plan.warmup,
            # statistics use the window only: cut what still runs soon after it (not at its
            # very end, so that a cancelled request never falls inside it)
            drain_timeout=max(DRAIN_S, MIN_WALL_DRAIN_S / plan.time_scale),
            time_scale=plan.time_scale,
            progress=plan.progress,
        )
        config = WorkloadConfig(
            input_len=LengthDist("fixed", plan.input_len),
            output_len=LengthDist("fixed", plan.output_len),
        )
        self._sweep = Sweep(options, config)
        if self.stopped:
            self._sweep.stop()
        outcome = await self._sweep.run()
        self._sweep = None
        target.result = outcome.result
        target.messages = list(outcome.messages)
        target.error = outcome.error
        target.result.metadata["demo"] = {
            "target": target.name,
            "time_scale": plan.time_scale,
            "profiles": list(PROFILES),
        }


# ---- the report -----------------------------------------------------------------------------


def comparison_table(runs: Sequence[TargetRun], *, title: str | None = None) -> Any:
    """One table: a row per target and level (rich)."""
    from rich.table import Table

    from loadtest.report import fmt_ms, fmt_num

    table = Table(title=title, title_justify="left", header_style="bold")
    for header, justify in (
        ("target", "left"),
        ("C", "right"),
        ("achieved\nC", "right"),
        ("output tok/s\n(aggregate)", "right"),
        ("decode tok/s\nper req p50", "right"),
        ("TTFT ms\np50", "right"),
        ("TTFT ms\np99", "right"),
        ("TPOT ms\np50", "right"),
        ("TPOT ms\np99", "right"),
        ("done", "right"),
        ("errors", "right"),
    ):
        table.add_column(header, justify=justify)  # type: ignore[arg-type]
    shown = [r for r in runs if r.result is not None and r.result.levels]
    for i, run in enumerate(shown):
        levels = run.result.levels
        for j, level in enumerate(levels):
            table.add_row(
                run.name if j == 0 else "",
                level.label,
                fmt_num(level.achieved_concurrency),
                fmt_num(level.output_tok_s),
                fmt_num(level.decode_tok_s.p50),
                fmt_ms(level.ttft.p50),
                fmt_ms(level.ttft.p99),
                fmt_ms(level.tpot.p50),
                fmt_ms(level.tpot.p99),
                str(level.completed),
                str(sum(level.errors.values())),
                end_section=j == len(levels) - 1 and i < len(shown) - 1,
            )
    return table


def _level(run: TargetRun, concurrency: int) -> Any:
    if run.result is None:
        return None
    return next((lv for lv in run.result.levels if lv.concurrency == concurrency), None)


def interpret(runs: Sequence[TargetRun]) -> list[str]:
    """What the numbers say: the proxy against the best single backend, from the table."""
    proxy = next((r for r in runs if r.name == PROXY), None)
    direct = [r for r in runs if r.name != PROXY]
    if proxy is None or proxy.result is None or not proxy.result.levels:
        return ["no proxy results to compare"]
    lines = []
    top = max(lv.concurrency for lv in proxy.result.levels)
    low = min(lv.concurrency for lv in proxy.result.levels)
    p_top = _level(proxy, top)
    rivals = [(r, lv) for r in direct if (lv := _level(r, top)) is not None]
    if rivals:
        best, b_lv = max(rivals, key=lambda x: x[1].output_tok_s)
        ratio = p_top.output_tok_s / b_lv.output_tok_s if b_lv.output_tok_s > 0 else float("inf")
        verdict = (
            "more than" if ratio > 1.02 else ("less than" if ratio < 0.98 else "about the same as")
        )
        lines.append(
            f"At C={top} the proxy delivered {p_top.output_tok_s:.0f} tok/s aggregate, {ratio:.2f}x"
            f" the best single backend ({best.name}, {b_lv.output_tok_s:.0f} tok/s): {verdict} it"
            f" with the same {top} clients. Proxy vs {best.name}: per-request decode"
            f" {_num(p_top.decode_tok_s.p50)} vs {_num(b_lv.decode_tok_s.p50)} tok/s, TTFT p50"
            f" {_ms(p_top.ttft.p50)} vs {_ms(b_lv.ttft.p50)}, p99 {_ms(p_top.ttft.p99)} vs"
            f" {_ms(b_lv.ttft.p99)}."
        )
    if low != top:
        p_low = _level(proxy, low)
        rivals = [(r, lv) for r in direct if (lv := _level(r, low)) is not None]
        if rivals and p_low is not None:
            ranked = sorted(rivals, key=lambda x: x[1].decode_tok_s.p50 or 0.0)
            (slow, s_lv), (fast, f_lv) = ranked[0], ranked[-1]
            lines.append(
                f"At C={low} a request through the proxy decoded at"
                f" {_num(p_low.decode_tok_s.p50)} tok/s (p50); alone, the fastest backend"
                f" ({fast.name}) did {_num(f_lv.decode_tok_s.p50)}, the slowest ({slow.name})"
                f" {_num(s_lv.decode_tok_s.p50)}."
            )
    return lines


def _ms(seconds: float | None) -> str:
    from loadtest.report import fmt_ms

    return "—" if seconds is None else f"{fmt_ms(seconds)} ms"


def _num(value: float | None) -> str:
    from loadtest.report import fmt_num

    return fmt_num(value)


def make_out_dir(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CliError(f"cannot create --out-dir {path}: {exc.strerror or exc}") from None


def write_outputs(plan: DemoPlan, runs: Sequence[TargetRun], say: Callable[[str], None]) -> None:
    from loadtest.results import ResultsError

    done = [r for r in runs if r.result is not None and r.result.levels]
    if not done:
        return
    make_out_dir(plan.out_dir)
    for run in done:
        path = plan.out_dir / f"{run.slug}.json"
        try:
            run.result.save(path, include_records=plan.save_records)
        except ResultsError as exc:
            raise CliError(str(exc)) from None
        run.path = path
    say(f"wrote {', '.join(str(r.path) for r in done)}")
    if not plan.plot:
        return
    from loadtest.plot import PlotUnavailable, plot_sweep

    path = plan.out_dir / PLOT_FILE
    try:
        plot_sweep(
            [r.result for r in done],
            path,
            labels=[r.name for r in done],
            title=f"pipefill demo (simulated, time-scale {plan.time_scale:g}; modelled seconds)",
        )
    except PlotUnavailable:
        say("no plot: matplotlib is not installed (pip install 'pipefill[plot]')")
        return
    except (OSError, ValueError) as exc:
        raise CliError(f"cannot write plot {path}: {exc}") from None
    say(f"wrote {path}")


# ---- the command ----------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    plan = plan_from_args(args)
    return run_plan(plan)


def run_plan(plan: DemoPlan, *, out: Any = None) -> int:
    from loadtest.report import make_console

    console = make_console(out)
    make_out_dir(plan.out_dir)  # a bad --out-dir fails before minutes of work

    def say(text: str) -> None:
        console.print(text, highlight=False, markup=False, soft_wrap=True)

    t0 = time.monotonic()
    say(
        f"loadtest demo: simulators pp8, tp8, ep8 and the proxy in front of them, sweep C="
        f"{','.join(map(str, plan.concurrency))}, {plan.warmup:g} s warmup + {plan.duration:g} s"
        f" window per level, {plan.input_len}-token prompts, {plan.output_len}-token answers."
    )
    say(
        f"TIME-SCALED: the simulators run at --time-scale {plan.time_scale:g} (one modelled second"
        f" = {plan.time_scale:g} wall seconds, {1 / plan.time_scale:g}x real speed); every time and"
        " rate below is in modelled seconds, as the real deployment would measure it."
        f" Expected wall time ~{plan.wall_estimate():.0f} s."
    )
    demo = Demo(plan, say=say)
    interrupted = _run_loop(demo)
    runs = demo.runs
    for r in runs:
        for line in r.messages:
            say(f"{r.name}: {line}")
    console.print()
    console.print(
        comparison_table(
            runs,
            title=f"direct vs through the proxy (modelled seconds; time-scale {plan.time_scale:g})",
        )
    )
    for line in interpret(runs):
        say(line)
    if demo.proxy_state:
        say(
            "proxy limits at the end: "
            + ", ".join(
                f"{name} {s['limit']} ({s['completions']} requests)"
                for name, s in demo.proxy_state.items()
            )
        )
    write_outputs(plan, runs, say)
    say(f"done in {time.monotonic() - t0:.0f} s wall; everything it started is stopped.")
    errors = [f"{r.name}: {r.error}" for r in runs if r.error]
    if errors:
        raise CliError("; ".join(errors))
    return 130 if interrupted else 0


def _run_loop(demo: Demo) -> bool:
    """Run the demo on uvloop. The first Ctrl-C (or SIGTERM) ends the current level, skips the
    rest and reports what was measured; a second one stops at once. Both clean up."""
    try:
        _, interrupted = run_stoppable(
            demo.run,
            demo.stop,
            "ending this level and reporting what was measured (Ctrl-C again to stop at once)",
            signals=(signal.SIGINT, signal.SIGTERM),
        )
    except OSError as exc:
        raise CliError(f"cannot start the demo's servers: {exc.strerror or exc}") from None
    return interrupted
