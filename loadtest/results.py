"""A saved run: metadata, per-level summaries and (optionally) every request's record.

`RunResult.save(path)` writes JSON (orjson); `RunResult.load(path)` reads it back and raises
`ResultsError` (one-line message) for a missing, unreadable or foreign file. `write_csv`
writes one row per level. `merge_runs` combines runs made at the same time on several
machines into one, recomputing every statistic from the union of their records.
"""

from __future__ import annotations

import csv
import dataclasses
import importlib.metadata
import os
import platform
import shlex
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

from loadtest.records import RequestRecord
from loadtest.stats import (
    DISTRIBUTIONS,
    STAT_KEYS,
    LevelSummary,
    summarize_level,
    summary_warnings,
)

SCHEMA = "pipefill.loadtest.run/1"


class ResultsError(ValueError):
    """A results file that cannot be used (missing, not JSON, wrong schema, not mergeable)."""


def base_metadata(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """What every run records about where and how it ran; the runner adds target/workload.

    `t_wall_offset` = time.time() - time.monotonic() maps this run's monotonic times onto
    the wall clock, which is how `merge_runs` aligns runs from different machines.
    """
    versions = {"python": platform.python_version()}
    for dist in ("pipefill", "aiohttp", "orjson", "uvloop", "rich"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    argv = list(sys.argv if argv is None else argv)
    return {
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "t_wall_offset": time.time() - time.monotonic(),
        "command": shlex.join(argv),
        "client": {
            "host": socket.gethostname(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "pid": os.getpid(),
        },
        "versions": versions,
    }


@dataclass(slots=True)
class RunResult:
    """One `loadtest run` (or a merge of several): metadata, levels, optional records."""

    metadata: dict[str, Any] = field(default_factory=dict)
    levels: list[LevelSummary] = field(default_factory=list)
    records: list[RequestRecord] | None = None

    def to_dict(self, *, include_records: bool = True) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "metadata": self.metadata,
            "levels": [level.to_dict() for level in self.levels],
            "records": self.records if include_records and self.records is not None else None,
        }

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "results") -> RunResult:
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            raise ResultsError(f"{source}: not a loadtest results file (expected schema {SCHEMA})")
        levels_raw, records_raw = data.get("levels"), data.get("records")
        metadata = data.get("metadata") or {}
        if not isinstance(levels_raw, list) or not isinstance(metadata, dict):
            raise ResultsError(f"{source}: malformed results file ('levels' must be a list)")
        if records_raw is not None and not isinstance(records_raw, list):
            raise ResultsError(f"{source}: malformed results file ('records' must be a list)")
        try:
            levels = [LevelSummary.from_dict(level) for level in levels_raw]
            records = (
                None if records_raw is None else [RequestRecord.from_dict(r) for r in records_raw]
            )
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            raise ResultsError(f"{source}: malformed results file ({exc})") from None
        return cls(metadata=metadata, levels=levels, records=records)

    def save(self, path: str | Path, *, include_records: bool = True) -> None:
        """Write JSON; indented for reading when it holds no records (which are large)."""
        doc = self.to_dict(include_records=include_records)
        try:
            data = orjson.dumps(doc, option=orjson.OPT_INDENT_2 if doc["records"] is None else 0)
        except TypeError as exc:  # orjson.JSONEncodeError: a non-JSON value in metadata
            raise ResultsError(f"cannot write {path}: {exc}") from None
        try:
            Path(path).write_bytes(data)
        except OSError as exc:
            raise ResultsError(f"cannot write {path}: {exc.strerror or exc}") from None

    @classmethod
    def load(cls, path: str | Path) -> RunResult:
        try:
            raw = Path(path).read_bytes()
        except FileNotFoundError:
            raise ResultsError(f"{path}: no such file") from None
        except OSError as exc:
            raise ResultsError(f"cannot read {path}: {exc.strerror or exc}") from None
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise ResultsError(f"{path}: not valid JSON ({exc})") from None
        return cls.from_dict(data, source=str(path))

    def write_csv(self, path: str | Path) -> None:
        write_csv(self.levels, path)

    def records_for(self, level: LevelSummary) -> list[RequestRecord]:
        """This level's records: same requested level, sent within the level's span."""
        if self.records is None:
            return []
        if level.span is None:
            return [r for r in self.records if r.level == level.concurrency]
        lo, hi = level.span
        return [r for r in self.records if r.level == level.concurrency and lo <= r.t_send <= hi]


# ------------------------------------------------------------------------------------ CSV

_SCALAR_COLUMNS = (
    "concurrency",
    "rate",
    "repeats",
    "achieved_concurrency",
    "concurrency_max",
    "duration",
    "requests",
    "completed",
    "failed",
    "request_throughput",
    "output_tokens",
    "output_tok_s",
    "good",
    "goodput",
    "slo_attainment",
    "token_mismatch",
    "usage_missing",
    "early_stops",
)
_OUTSIDE_KEYS = (
    "done_before_window",
    "done_after_window",
    "never_done",
    "tokens_before_window",
    "tokens_after_window",
)


def csv_columns() -> list[str]:
    """The CSV header: scalars, errors, what fell outside W, prompt tokens, distributions."""
    return [
        *_SCALAR_COLUMNS,
        "errors",
        "errors_by_kind",
        *(f"outside_{k}" for k in _OUTSIDE_KEYS),
        "prompt_tokens_requested_mean",
        "prompt_tokens_server_mean",
        *(f"{dist}_{stat}" for dist in DISTRIBUTIONS for stat in STAT_KEYS),
    ]


def csv_row(level: LevelSummary) -> dict[str, Any]:
    row: dict[str, Any] = {name: getattr(level, name) for name in _SCALAR_COLUMNS}
    row["errors"] = sum(level.errors.values())
    row["errors_by_kind"] = ";".join(f"{k}:{v}" for k, v in sorted(level.errors.items()))
    for key in _OUTSIDE_KEYS:
        row[f"outside_{key}"] = level.outside.get(key, 0)
    row["prompt_tokens_requested_mean"] = level.prompt_tokens.get("requested_mean")
    row["prompt_tokens_server_mean"] = level.prompt_tokens.get("server_mean")
    for dist in DISTRIBUTIONS:
        d = level.distribution(dist)
        for stat in STAT_KEYS:
            row[f"{dist}_{stat}"] = d.get(stat)
    return row


def write_csv(levels: Sequence[LevelSummary], path: str | Path) -> None:
    """One row per level; seconds for times, empty cells for undefined values."""
    try:
        with open(path, "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=csv_columns())
            writer.writeheader()
            for level in levels:
                writer.writerow({k: ("" if v is None else v) for k, v in csv_row(level).items()})
    except OSError as exc:
        raise ResultsError(f"cannot write {path}: {exc.strerror or exc}") from None


# ---------------------------------------------------------------------------------- merge


def _level_key(level: LevelSummary) -> tuple[int, float | None]:
    return (level.concurrency, level.rate)


def merge_runs(
    runs: Sequence[RunResult],
    *,
    slo: dict[str, float] | None = None,
    names: Sequence[str] | None = None,
) -> RunResult:
    """Runs made at the same time on several machines -> one run, as if from one client.

    Each run's monotonic times are shifted onto the first run's clock through the wall
    clock (`metadata["t_wall_offset"]`). For each level, the merged window is the
    intersection of the runs' windows (when all of them were in steady state), the requested
    concurrency is the sum, and every statistic, percentiles included, is recomputed exactly
    from the union of the records. Workers are renumbered so they stay distinct.

    Raises ResultsError when a run has no records or no t_wall_offset, or when runs differ in
    levels or workload, or a level's windows do not overlap.
    """
    names = list(names) if names is not None else [f"run {i + 1}" for i in range(len(runs))]
    if len(runs) < 2:
        raise ResultsError("merge needs at least two runs")
    for i, run in enumerate(runs):
        name = names[i]
        if run.records is None:
            raise ResultsError(f"{name} has no per-request records (it was saved without them)")
        if not isinstance(run.metadata.get("t_wall_offset"), int | float):
            raise ResultsError(f"{name} has no metadata.t_wall_offset; cannot align clocks")
        scale = run.metadata.get("time_scale", 1.0)
        if scale not in (None, 1, 1.0):
            raise ResultsError(
                f"{name} reports modelled time (--time-scale {scale:g}); "
                "only runs on the wall clock can be merged"
            )
        if any(level.repeats > 1 for level in run.levels):
            raise ResultsError(f"{name} combines --repeat runs; merge runs made without --repeat")
    first = runs[0]
    keys = [_level_key(level) for level in first.levels]
    workload = first.metadata.get("workload")
    for i, run in enumerate(runs[1:], start=1):
        if [_level_key(level) for level in run.levels] != keys:
            raise ResultsError(
                f"{names[i]} has different levels than {names[0]}: "
                f"{_levels_text(run)} vs {_levels_text(first)}"
            )
        if run.metadata.get("workload") != workload:
            raise ResultsError(f"{names[i]} ran a different workload than {names[0]}")
    if slo is None:
        slos = {
            orjson.dumps(level.slo, option=orjson.OPT_SORT_KEYS) for r in runs for level in r.levels
        }
        if len(slos) > 1:
            raise ResultsError("runs used different SLOs; pass --slo to choose one")
        slo = first.levels[0].slo if first.levels else None

    base_offset = float(first.metadata["t_wall_offset"])
    merged_levels: list[LevelSummary] = []
    merged_records: list[RequestRecord] = []
    for li, key in enumerate(keys):
        concurrency = sum(r.levels[li].concurrency for r in runs)
        shifted: list[RequestRecord] = []
        windows: list[tuple[float, float]] = []
        worker_base = 0
        for run in runs:
            level = run.levels[li]
            shift = float(run.metadata["t_wall_offset"]) - base_offset
            records = run.records_for(level)
            shifted.extend(_shift(r, shift, worker_base, concurrency) for r in records)
            worker_base += max((r.worker for r in records), default=-1) + 1
            windows.append((level.window[0] + shift, level.window[1] + shift))
        w0, w1 = max(w[0] for w in windows), min(w[1] for w in windows)
        if w1 <= w0:
            raise ResultsError(
                f"level {first.levels[li].label}: the runs' steady-state windows do not overlap "
                "(were they started at the same time?)"
            )
        rate = None if key[1] is None else sum(r.levels[li].rate or 0.0 for r in runs)
        summary = summarize_level(
            shifted, concurrency=concurrency, window=(w0, w1), slo=slo, rate=rate
        )
        summary.selfcheck = _merged_selfcheck(
            [r.levels[li].selfcheck for r in runs], names, summary_warnings(summary)
        )
        merged_levels.append(summary)
        merged_records.extend(shifted)
    metadata = {
        **{k: v for k, v in first.metadata.items() if k not in ("client", "command", "pid")},
        "t_wall_offset": base_offset,
        "merged_from": [run.metadata for run in runs],
    }
    return RunResult(metadata=metadata, levels=merged_levels, records=merged_records)


def _merged_selfcheck(
    checks: Sequence[dict[str, Any] | None], names: Sequence[str], derived: list[str]
) -> dict[str, Any]:
    """Each source's self-checks, the worst of the client-side numbers, and all warnings."""
    out: dict[str, Any] = {"merged": list(checks)}
    for key in ("dispatch_delay_p99_s", "loop_lag_p99_s", "client_cpu"):
        values = [c[key] for c in checks if c and isinstance(c.get(key), int | float)]
        if values:
            out[key] = max(values)
    warnings = [
        f"{name}: {w}"
        for name, c in zip(names, checks, strict=True)
        for w in (c or {}).get("warnings") or []
    ]
    out["warnings"] = warnings + derived
    return out


def _shift(record: RequestRecord, shift: float, worker_base: int, level: int) -> RequestRecord:
    def s(t: float | None) -> float | None:
        return None if t is None else t + shift

    return dataclasses.replace(
        record,
        level=level,
        worker=record.worker + worker_base,
        t_scheduled=record.t_scheduled + shift,
        t_send=record.t_send + shift,
        t_first=s(record.t_first),
        t_last=s(record.t_last),
        t_end=s(record.t_end),
        token_times=[t + shift for t in record.token_times],
    )


def _levels_text(run: RunResult) -> str:
    return ",".join(level.label for level in run.levels) or "none"
