"""Console rendering of runs and comparisons (rich tables), plus a Markdown table for docs.

Only presentation lives here; every number comes from `loadtest.stats`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from loadtest.results import RunResult
from loadtest.stats import LevelSummary, MetricChange, compare_levels, summary_warnings

DASH = "—"

FEW_REQUESTS = 10  # fewer completions than this in a window: say the percentiles are rough


def make_console(file: Any = None) -> Console:
    """A console that does not squeeze the wide table when output is not a terminal."""
    file = file or sys.stdout
    tty = hasattr(file, "isatty") and file.isatty()
    return Console(file=file, width=None if tty else 200, highlight=False, soft_wrap=False)


def fmt_ms(seconds: float | None) -> str:
    """Seconds shown as milliseconds with 3 significant digits (at least integer ms)."""
    if seconds is None:
        return DASH
    ms = seconds * 1e3
    if abs(ms) >= 100:
        return f"{ms:.0f}"
    if abs(ms) >= 10:
        return f"{ms:.1f}"
    return f"{ms:.2f}"


def fmt_num(value: float | None) -> str:
    """A rate or count with about 3 significant digits."""
    if value is None:
        return DASH
    if abs(value) >= 100:
        return f"{value:.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def _with_spread(level: LevelSummary, path: str, text: str, scale: float = 1.0) -> Text:
    """A cell, with the min..max over repetitions underneath when the level was repeated."""
    cell = Text(text)
    spread = (level.spread or {}).get(path)
    if spread:
        fmt = fmt_ms if scale != 1.0 else fmt_num
        lo, hi = spread["min"], spread["max"]
        cell.append(f"\n{fmt(lo)}..{fmt(hi)}", style="dim")
    return cell


def level_table(levels: Sequence[LevelSummary], *, title: str | None = None) -> Table:
    """One row per level: the columns every sweep report shows."""
    show_goodput = any(level.slo for level in levels)
    open_loop = any(level.concurrency == 0 and level.rate is not None for level in levels)
    table = Table(title=title, title_justify="left", header_style="bold")
    table.add_column("rate" if open_loop else "C", justify="right")
    for header in (
        "achieved\nC",
        "req/s",
        "output tok/s\n(aggregate)",
        "decode tok/s\nper req p50",
        "TTFT ms\np50",
        "TTFT ms\np99",
        "TPOT ms\np50",
        "TPOT ms\np99",
        "ITL ms\np50",
        "ITL ms\np99",
        "E2E ms\np50",
        "E2E ms\np99",
    ):
        table.add_column(header, justify="right")
    if show_goodput:
        table.add_column("goodput\nreq/s (%)", justify="right")
    show_cache = any(level.cache for level in levels)
    if show_cache:
        table.add_column("cache\nhit", justify="right")
    table.add_column("errors", justify="right")
    for level in levels:
        row: list[Text | str] = [
            level.label,
            _with_spread(level, "achieved_concurrency", fmt_num(level.achieved_concurrency)),
            _with_spread(level, "request_throughput", fmt_num(level.request_throughput)),
            _with_spread(level, "output_tok_s", fmt_num(level.output_tok_s)),
            _with_spread(level, "decode_tok_s/p50", fmt_num(level.decode_tok_s.p50)),
        ]
        for name in ("ttft", "tpot", "itl", "e2e"):
            dist = level.distribution(name)
            for stat in ("p50", "p99"):
                row.append(_with_spread(level, f"{name}/{stat}", fmt_ms(dist.get(stat)), 1e3))
        if show_goodput:
            if level.goodput is None:
                row.append(DASH)
            else:
                pct = "" if level.slo_attainment is None else f" ({level.slo_attainment:.0%})"
                row.append(f"{fmt_num(level.goodput)}{pct}")
        if show_cache:
            row.append(fmt_hit(level.cache))
        n_errors = sum(level.errors.values())
        row.append(Text(str(n_errors), style="red" if n_errors else ""))
        table.add_row(*row)
    return table


def fmt_hit(cache: dict[str, Any] | None) -> str:
    """A level's reported cache hit rate; n/a when its servers reported none."""
    return "n/a" if not cache else f"{cache['hit_rate']:.1%}"


def cache_table(levels: Sequence[LevelSummary]) -> Table | None:
    """Cache hit rate per backend that served (when a proxy named them) at each level."""
    names = sorted({n for lv in levels if lv.cache for n in lv.cache.get("by_backend", {})})
    if not names:
        return None
    table = Table(title="prefix cache hit rate per backend (requests)", title_justify="left",
                  header_style="bold")  # fmt: skip
    table.add_column("C", justify="right")
    for name in names:
        table.add_column(name, justify="right")
    for level in levels:
        by = (level.cache or {}).get("by_backend", {})
        cells = [
            f"{by[n]['hit_rate']:.1%} ({by[n]['requests']})" if n in by else DASH for n in names
        ]
        table.add_row(level.label, *cells)
    return table


def checks_table(levels: Sequence[LevelSummary]) -> Table:
    """What fell outside each window, token accounting and the client's self-checks."""
    table = Table(title="window and self-checks", title_justify="left", header_style="bold")
    for header in (
        "C",
        "window s",
        "counted",
        "done\nbefore W",
        "done\nafter W",
        "never\ndone",
        "tokens\noutside W",
        "dispatch\np99 ms",
        "loop lag\np99 ms",
        "client\nCPU",
        "usage ≠\nchunks",
        "no\nusage",
        "early\nstops",
        "prompt tok\nrequested/server",
    ):
        table.add_column(header, justify="right")
    for level in levels:
        sc = level.selfcheck or {}
        out = level.outside
        dispatch = sc.get("dispatch_delay_p99_s", level.dispatch_delay.p99)
        cpu = sc.get("client_cpu")
        pt = level.prompt_tokens
        table.add_row(
            level.label,
            f"{level.duration:.1f}",
            str(level.completed + level.failed),
            str(out.get("done_before_window", 0)),
            str(out.get("done_after_window", 0)),
            str(out.get("never_done", 0)),
            str(out.get("tokens_before_window", 0) + out.get("tokens_after_window", 0)),
            fmt_ms(dispatch),
            fmt_ms(sc.get("loop_lag_p99_s")),
            DASH if cpu is None else f"{cpu:.0%}",
            str(level.token_mismatch),
            str(level.usage_missing),
            str(level.early_stops),
            f"{fmt_num(pt.get('requested_mean'))}/{fmt_num(pt.get('server_mean'))}",
        )
    return table


def level_warnings(level: LevelSummary) -> list[str]:
    """The runner's self-check warnings (or ones derived from the summary when it has none),
    plus what the window left out."""
    sc = level.selfcheck or {}
    if isinstance(sc.get("warnings"), list):
        warnings = [str(w) for w in sc["warnings"]]
    else:
        warnings = summary_warnings(level)
    for kind, n in sorted(level.errors_all.items()):
        inside = level.errors.get(kind, 0)
        if n > inside:
            warnings.append(f"{n - inside} {kind} error(s) outside the window")
    if level.completed == 0:
        warnings.append("no request completed inside the window: latency percentiles are empty")
    elif level.completed < FEW_REQUESTS:
        warnings.append(
            f"only {level.completed} request(s) completed inside the window: percentiles are "
            "rough (use a longer --duration)"
        )
    return warnings


def _describe(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}={_describe(v)}" for k, v in value.items() if v is not None)
    if isinstance(value, list):
        return ",".join(_describe(v) for v in value)
    return str(value)


_HEADER_KEYS = (
    "target",
    "model",
    "api",
    "stream",
    "workload",
    "server",
    "sweep",
    "time_note",
    "started_at",
    "command",
)


def run_label(metadata: dict[str, Any]) -> str | None:
    """A short name for a run from what it measured: the server's profile or the proxy and
    what it fronts, and the target; None when the metadata says nothing useful."""
    server = metadata.get("server") or {}
    target = str(metadata.get("target") or "").removeprefix("http://")
    if server.get("proxy"):
        fronts = server.get("fronts")
        names = ", ".join(str(f).split(" ", 1)[0] for f in fronts) if fronts else "?"
        what = f"proxy ({names})"
    else:
        what = server.get("sim_profile") or server.get("profile") or server.get("model_path")
    if not what and not target:
        return None
    return f"{what} @ {target}" if what and target else str(what or target)


def plot_title(metadata: dict[str, Any]) -> str:
    """The figure's title: what was measured, with which workload."""
    parts = [run_label(metadata) or "loadtest run"]
    if metadata.get("workload"):
        parts.append(_describe(metadata["workload"]))
    if metadata.get("interrupted"):
        parts.append("INTERRUPTED")
    return " · ".join(parts)


#: the first line of the report of a run stopped before its sweep ended
INTERRUPTED_BANNER = "INTERRUPTED: stopped before the sweep ended; only what ran is reported"


def header_lines(metadata: dict[str, Any]) -> list[str]:
    lines = [f"{key}: {_describe(metadata[key])}" for key in _HEADER_KEYS if metadata.get(key)]
    if metadata.get("interrupted"):
        lines.insert(0, INTERRUPTED_BANNER)
    client = metadata.get("client")
    if isinstance(client, dict) and client.get("host"):
        lines.append(f"client: {client['host']} ({client.get('cpus', '?')} CPUs)")
    merged = metadata.get("merged_from")
    if isinstance(merged, list):
        hosts = [str((m.get("client") or {}).get("host", "?")) for m in merged]
        lines.append(f"merged from {len(merged)} runs: {', '.join(hosts)}")
    return lines


def render_run(
    result: RunResult, console: Console | None = None, *, title: str | None = None
) -> None:
    """The full report of a run: header, the level table, window/self-check table, warnings."""
    console = console or make_console()
    for line in header_lines(result.metadata):
        console.print(Text(line, style="dim"))
    if not result.levels:
        console.print("no levels measured")
        return
    console.print(level_table(result.levels, title=title))
    repeats = max(level.repeats for level in result.levels)
    if repeats > 1:
        console.print(Text(f"medians of {repeats} repetitions; min..max underneath", style="dim"))
    slo = next((level.slo for level in result.levels if level.slo), None)
    if slo:
        console.print(
            Text(
                "goodput SLO: " + ", ".join(f"{k} ≤ {fmt_ms(v)} ms" for k, v in slo.items()),
                style="dim",
            )
        )
    per_backend = cache_table(result.levels)
    if per_backend is not None:
        console.print(per_backend)
    console.print(checks_table(result.levels))
    for level in result.levels:
        for warning in level_warnings(level):
            name = f"C={level.label}" if level.concurrency or level.rate is None else level.label
            console.print(Text(f"{name}: {warning}", style="yellow"))


def _fmt_metric(value: float | None, unit: str) -> str:
    if value is None:
        return DASH
    if unit == "s":
        return f"{fmt_ms(value)} ms"
    if unit == "n" and float(value).is_integer():
        return f"{value:.0f}"
    return fmt_num(value)


def compare_table(changes: Sequence[MetricChange], *, title: str, names: tuple[str, str]) -> Table:
    table = Table(title=title, title_justify="left", header_style="bold")
    table.add_column("metric")
    table.add_column(names[0], justify="right")
    table.add_column(names[1], justify="right")
    table.add_column("change", justify="right")
    table.add_column("%", justify="right")
    for ch in changes:
        style = {True: "green", False: "red", None: ""}[ch.better]
        if ch.delta is None:
            delta = DASH
        else:
            delta = ("+" if ch.delta >= 0 else "") + _fmt_metric(ch.delta, ch.unit)
        pct = DASH if ch.percent is None else f"{ch.percent:+.1f}%"
        table.add_row(
            ch.label,
            _fmt_metric(ch.a, ch.unit),
            _fmt_metric(ch.b, ch.unit),
            Text(delta, style=style),
            Text(pct, style=style),
        )
    return table


def match_levels(
    a: RunResult, b: RunResult
) -> tuple[list[tuple[LevelSummary, LevelSummary]], list[str], list[str]]:
    """Pairs of levels with the same concurrency (and rate), and the labels left unmatched."""
    key = lambda level: (level.concurrency, level.rate)  # noqa: E731
    b_by_key = {key(level): level for level in b.levels}
    pairs = [(level, b_by_key[key(level)]) for level in a.levels if key(level) in b_by_key]
    a_keys = {key(level) for level in a.levels}
    only_a = [level.label for level in a.levels if key(level) not in b_by_key]
    only_b = [level.label for level in b.levels if key(level) not in a_keys]
    return pairs, only_a, only_b


def render_compare(
    a: RunResult,
    b: RunResult,
    console: Console | None = None,
    *,
    names: tuple[str, str] = ("A", "B"),
) -> None:
    """Per matched level, each metric of both runs with its absolute and relative change."""
    console = console or make_console()
    for name, run in zip(names, (a, b), strict=True):
        header = "; ".join(header_lines(run.metadata)[:3])
        if header:
            console.print(Text(f"{name}: {header}", style="dim"))
    pairs, only_a, only_b = match_levels(a, b)
    for la, lb in pairs:
        title = f"C={la.label}" if la.rate is None else f"rate={la.label}"
        console.print(compare_table(compare_levels(la, lb), title=title, names=names))
    if only_a:
        console.print(Text(f"only in {names[0]}: levels {', '.join(only_a)}", style="yellow"))
    if only_b:
        console.print(Text(f"only in {names[1]}: levels {', '.join(only_b)}", style="yellow"))
    if not pairs:
        console.print(Text("no level is in both runs", style="yellow"))


def levels_markdown(levels: Sequence[LevelSummary]) -> str:
    """The level table as GitHub Markdown (for README and docs)."""
    headers = [
        "C",
        "achieved C",
        "req/s",
        "output tok/s (aggregate)",
        "decode tok/s per req p50",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "TPOT p50 ms",
        "TPOT p99 ms",
        "ITL p50 ms",
        "ITL p99 ms",
        "E2E p50 ms",
        "E2E p99 ms",
    ]
    show_goodput = any(level.slo for level in levels)
    if show_goodput:
        headers.append("goodput req/s")
    show_cache = any(level.cache for level in levels)
    if show_cache:
        headers.append("cache hit")
    headers.append("errors")
    lines = ["| " + " | ".join(headers) + " |", "|" + "---:|" * len(headers)]
    for level in levels:
        cells = [
            level.label,
            fmt_num(level.achieved_concurrency),
            fmt_num(level.request_throughput),
            fmt_num(level.output_tok_s),
            fmt_num(level.decode_tok_s.p50),
        ]
        for name in ("ttft", "tpot", "itl", "e2e"):
            dist = level.distribution(name)
            cells += [fmt_ms(dist.p50), fmt_ms(dist.p99)]
        if show_goodput:
            cells.append(fmt_num(level.goodput))
        if show_cache:
            cells.append(fmt_hit(level.cache))
        cells.append(str(sum(level.errors.values())))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
