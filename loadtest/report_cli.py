"""`loadtest report | compare | merge`: work on saved results files (results.json).

- `loadtest report results.json [--slo ...] [--csv F] [--plot F]` re-renders a run; with
  `--slo` the goodput is recomputed from the stored per-request records.
- `loadtest compare a.json b.json [--plot F]` shows every metric of each common level side by
  side with its absolute and relative change.
- `loadtest merge a.json b.json ... [--out merged.json] [--csv F] [--plot F]` combines runs
  made at the same time on several machines into one, percentiles recomputed exactly from
  the union of their records.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from loadtest.cli import CliError
from loadtest.results import ResultsError, RunResult, merge_runs, write_csv


def _add_outputs(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--csv", metavar="FILE", help="also write one CSV row per level")
    parser.add_argument("--plot", metavar="FILE", help="also draw the sweep (needs matplotlib)")


def _add_slo(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--slo",
        metavar="SPEC",
        help="goodput SLOs, seconds: e.g. ttft=0.5,tpot=0.05,e2e=10 (recomputed from records)",
    )


def add_report_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("results", help="a results.json written by `loadtest run --out`")
    _add_slo(parser)
    _add_outputs(parser)


def add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("a", help="baseline results.json")
    parser.add_argument("b", help="results.json to compare with the baseline")
    parser.add_argument("--plot", metavar="FILE", help="overlay both sweeps in one figure")


def add_merge_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("results", nargs="+", help="results.json files of simultaneous runs")
    parser.add_argument("--out", metavar="FILE", help="write the merged run (with records)")
    _add_slo(parser)
    _add_outputs(parser)


def _load(path: str) -> RunResult:
    try:
        return RunResult.load(path)
    except ResultsError as exc:
        raise CliError(str(exc)) from None


def _parse_slo(text: str | None) -> dict[str, float] | None:
    if text is None:
        return None
    from loadtest.stats import parse_slo

    try:
        return parse_slo(text)
    except ValueError as exc:
        raise CliError(f"--slo: {exc}", status=2) from None


def _resummarize(run: RunResult, slo: dict[str, float], source: str) -> RunResult:
    """The same run with every level recomputed from its records under new SLOs."""
    from loadtest.stats import summarize_level

    if run.records is None:
        raise CliError(f"{source} has no per-request records; cannot recompute goodput for --slo")
    if any(level.repeats > 1 for level in run.levels):
        raise CliError(f"{source} holds medians of --repeat runs; --slo cannot recompute them")
    levels = [
        summarize_level(
            run.records_for(level),
            concurrency=level.concurrency,
            window=level.window,
            slo=slo,
            selfcheck=level.selfcheck,
            rate=level.rate,
        )
        for level in run.levels
    ]
    return RunResult(metadata=run.metadata, levels=levels, records=run.records)


def _write_outputs(
    runs: Sequence[RunResult],
    labels: Sequence[str],
    *,
    csv: str | None = None,
    plot: str | None = None,
) -> None:
    if csv:
        try:
            write_csv(runs[0].levels, csv)
        except ResultsError as exc:
            raise CliError(str(exc)) from None
        print(f"wrote {csv}")
    if plot:
        from loadtest.plot import PlotUnavailable, plot_sweep

        try:
            plot_sweep(runs, plot, labels=labels)
        except PlotUnavailable as exc:
            raise CliError(str(exc)) from None
        except (OSError, ValueError) as exc:
            raise CliError(f"cannot write plot {plot}: {exc}") from None
        print(f"wrote {plot}")


def run_report(args: argparse.Namespace) -> int:
    from loadtest.report import make_console, render_run

    run = _load(args.results)
    slo = _parse_slo(args.slo)
    if slo is not None:
        run = _resummarize(run, slo, args.results)
    render_run(run, make_console())
    _write_outputs([run], [Path(args.results).stem], csv=args.csv, plot=args.plot)
    return 0


def run_compare(args: argparse.Namespace) -> int:
    from loadtest.report import make_console, render_compare

    a, b = _load(args.a), _load(args.b)
    names = _names([args.a, args.b], [a, b])
    render_compare(a, b, make_console(), names=(names[0], names[1]))
    _write_outputs([a, b], names, plot=args.plot)
    return 0


def run_merge(args: argparse.Namespace) -> int:
    from loadtest.report import make_console, render_run

    if len(args.results) < 2:
        raise CliError("merge needs at least two results files", status=2)
    runs = [_load(path) for path in args.results]
    try:
        merged = merge_runs(runs, slo=_parse_slo(args.slo), names=list(args.results))
    except ResultsError as exc:
        raise CliError(str(exc)) from None
    render_run(merged, make_console(), title=f"merged: {len(runs)} runs")
    if args.out:
        try:
            merged.save(args.out)
        except ResultsError as exc:
            raise CliError(str(exc)) from None
        print(f"wrote {args.out}")
    _write_outputs([merged], ["merged"], csv=args.csv, plot=args.plot)
    return 0


def _names(paths: Sequence[str], runs: Sequence[RunResult] | None = None) -> list[str]:
    """Short, distinct names: what each run measured (proxy or server, target), else the
    files' stems (numbered when they collide), with the stem added where two runs would read
    the same."""
    from loadtest.report import run_label

    stems = [Path(p).stem for p in paths]
    if len(set(stems)) != len(stems):  # short still (labels prefix every legend entry)
        stems = [f"{s} #{i + 1}" for i, s in enumerate(stems)]
    if runs is None:
        return stems
    labels = [run_label(r.metadata) or s for r, s in zip(runs, stems, strict=True)]
    if len(set(labels)) != len(labels):
        labels = [f"{lb} ({s})" if lb != s else s for lb, s in zip(labels, stems, strict=True)]
    return labels
