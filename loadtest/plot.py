"""`--plot sweep.png`: four panels of a concurrency sweep (matplotlib, an optional extra).

1. aggregate output tok/s and per-request decode tok/s (p50) vs concurrency
2. TTFT p50/p90/p99 vs concurrency
3. TPOT p50/p90/p99 vs concurrency
4. latency vs throughput: TPOT p50/p99 against aggregate output tok/s, points labelled by C
   (the knee: where more throughput starts to cost latency)

Several runs may be overlaid (e.g. direct vs through the proxy), one colour per run.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from loadtest.results import RunResult
from loadtest.stats import LevelSummary


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


#: a legend below its panel (outside the data), in columns
LEGEND_OUTSIDE = {"fontsize": 8, "loc": "upper center", "bbox_to_anchor": (0.5, -0.14), "ncol": 3}


def _x(level: LevelSummary) -> float:
    """Requested concurrency; for open-loop levels the achieved one."""
    return float(level.concurrency) if level.concurrency > 0 else level.achieved_concurrency


def plot_sweep(
    runs: RunResult | Sequence[RunResult],
    path: str | Path,
    *,
    labels: Sequence[str] | None = None,
    title: str | None = None,
) -> Path:
    """Write the sweep figure to `path` (format from its suffix, e.g. .png or .svg)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotUnavailable("--plot needs matplotlib: pip install 'pipefill[plot]'") from None

    runs = [runs] if isinstance(runs, RunResult) else list(runs)
    if labels is None:
        from loadtest.report import run_label

        labels = [run_label(r.metadata) or f"run {i + 1}" for i, r in enumerate(runs)]
    labels = list(labels)
    many = len(runs) > 1
    fig, axes = plt.subplots(2, 2, figsize=(14, 12), layout="constrained")
    (ax_tput, ax_ttft), (ax_tpot, ax_knee) = axes
    ax_user = ax_tput.twinx()
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = {"p50": "-", "p90": "--", "p99": ":"}
    for i, (run, label) in enumerate(zip(runs, labels, strict=True)):
        levels = sorted(run.levels, key=_x)
        if not levels:
            continue
        colour = colours[i % len(colours)]
        prefix = f"{label} " if many else ""
        xs = [_x(level) for level in levels]
        ax_tput.plot(
            xs,
            [lv.output_tok_s for lv in levels],
            "o-",
            color=colour,
            label=f"{prefix}aggregate output tok/s",
        )
        ax_user.plot(
            xs,
            [_nan(lv.decode_tok_s.p50) for lv in levels],
            "s--",
            color=colour,
            alpha=0.7,
            label=f"{prefix}decode tok/s per request (p50)",
        )
        for stat, style in styles.items():
            ax_ttft.plot(
                xs,
                [_ms(lv.ttft.get(stat)) for lv in levels],
                "o" + style,
                color=colour,
                label=f"{prefix}{stat}",
            )
            ax_tpot.plot(
                xs,
                [_ms(lv.tpot.get(stat)) for lv in levels],
                "o" + style,
                color=colour,
                label=f"{prefix}{stat}",
            )
        tput = [lv.output_tok_s for lv in levels]
        ax_knee.plot(
            tput, [_ms(lv.tpot.p50) for lv in levels], "o-", color=colour, label=f"{prefix}TPOT p50"
        )
        ax_knee.plot(
            tput, [_ms(lv.tpot.p99) for lv in levels], "o:", color=colour, label=f"{prefix}TPOT p99"
        )
        for level, x in zip(levels, tput, strict=True):
            ax_knee.annotate(
                f"C={level.label}",
                (x, _ms(level.tpot.p50)),
                textcoords="offset points",
                xytext=(4, 4),
                fontsize=8,
                color=colour,
            )

    ticks = sorted({_x(level) for run in runs for level in run.levels})
    for ax in (ax_tput, ax_ttft, ax_tpot):
        ax.set_xscale("log", base=2)
        if ticks:
            ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
            ax.minorticks_off()
        ax.set_xlabel("concurrency (requests in flight)")
        ax.grid(True, which="both", alpha=0.3)
    ax_tput.set_ylabel("aggregate output tok/s")
    ax_user.set_ylabel("decode tok/s per request (1/TPOT, p50)")
    ax_tput.set_title("throughput vs concurrency")
    lines = ax_tput.get_legend_handles_labels()
    lines2 = ax_user.get_legend_handles_labels()
    # Legends go below their panel, never over its data points.
    ax_tput.legend(lines[0] + lines2[0], lines[1] + lines2[1], **LEGEND_OUTSIDE)
    ax_ttft.set_ylabel("TTFT (ms)")
    ax_ttft.set_title("time to first token vs concurrency")
    ax_tpot.set_ylabel("TPOT (ms)")
    ax_tpot.set_title("time per output token vs concurrency")
    ax_knee.set_xlabel("aggregate output tok/s")
    ax_knee.set_ylabel("TPOT (ms)")
    ax_knee.set_title("latency vs throughput")
    ax_knee.grid(True, alpha=0.3)
    ax_knee.margins(x=0.1, y=0.1)  # room for the C=... labels
    for ax in (ax_ttft, ax_tpot, ax_knee):
        ax.legend(**LEGEND_OUTSIDE)
    if title is None:
        from loadtest.report import plot_title

        title = plot_title(runs[0].metadata) if len(runs) == 1 else " vs ".join(labels)
    fig.suptitle(title)
    out = Path(path)
    try:
        fig.savefig(out, dpi=110)
    finally:
        plt.close(fig)
    return out


def _nan(value: float | None) -> float:
    return float("nan") if value is None else value


def _ms(seconds: float | None) -> float:
    return float("nan") if seconds is None else seconds * 1e3
