"""loadtest.results / report / report_cli / plot: files, merge, tables and the CLI."""

from __future__ import annotations

import csv
import dataclasses

import orjson
import pytest

from loadtest.cli import main
from loadtest.records import RequestRecord
from loadtest.report import levels_markdown, make_console, render_compare, render_run
from loadtest.results import (
    ResultsError,
    RunResult,
    base_metadata,
    csv_columns,
    merge_runs,
    write_csv,
)
from loadtest.stats import combine_repeats, summarize_level

WORKLOAD = {"api": "chat", "input_len": "fixed:128", "output_len": "fixed:8"}


def closed_loop(
    concurrency: int, t0: float, t1: float, *, tpot: float, ttft: float, worker_base: int = 0
) -> list[RequestRecord]:
    """Deterministic closed-loop records: each worker back to back from t0 until t1."""
    out = []
    for w in range(concurrency):
        t = t0 + 0.01 * w
        while t < t1:
            times = [t + ttft + tpot * k for k in range(8)]
            out.append(
                RequestRecord(
                    level=concurrency,
                    worker=worker_base + w,
                    t_scheduled=t,
                    t_send=t,
                    t_first=times[0],
                    t_last=times[-1],
                    t_end=times[-1],
                    token_times=times,
                    token_counts=[1] * 8,
                    completion_tokens=8,
                    prompt_tokens=130,
                    requested_input_len=128,
                    requested_output_len=8,
                    status=200,
                )
            )
            t = times[-1]
    return out


def make_run(
    levels=(1, 4), *, offset: float = 1000.0, t0: float = 0.0, slo=None, workload=WORKLOAD
) -> RunResult:
    records, summaries = [], []
    for i, c in enumerate(levels):
        start = t0 + 30.0 * i
        rs = closed_loop(c, start, start + 20.0, tpot=0.01 * (1 + c / 4), ttft=0.05 * c)
        records += rs
        summaries.append(
            summarize_level(rs, concurrency=c, window=(start + 5.0, start + 15.0), slo=slo)
        )
    metadata = {**base_metadata(["loadtest", "run"]), "t_wall_offset": offset}
    metadata.update(target="http://127.0.0.1:1", workload=workload)
    return RunResult(metadata=metadata, levels=summaries, records=records)


# ---------------------------------------------------------------------------- save / load


@pytest.mark.parametrize("with_records", [True, False])
def test_save_load_round_trip(tmp_path, with_records):
    run = make_run()
    path = tmp_path / "r.json"
    run.save(path, include_records=with_records)
    again = RunResult.load(path)
    assert again.levels == run.levels
    assert again.metadata == run.metadata
    assert again.records == (run.records if with_records else None)
    assert orjson.loads(path.read_bytes())["schema"] == "pipefill.loadtest.run/1"


def test_base_metadata_has_what_merge_and_reports_need():
    md = base_metadata(["loadtest", "run", "--concurrency", "1,4"])
    assert md["command"] == "loadtest run --concurrency 1,4"
    assert isinstance(md["t_wall_offset"], float)
    assert md["client"]["host"] and md["versions"]["python"]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no such file"),
        (b"{not json", "not valid JSON"),
        (b'{"levels": []}', "not a loadtest results file"),
        (b'{"schema": "pipefill.loadtest.run/1", "levels": 3}', "malformed"),
        (b'{"schema": "pipefill.loadtest.run/1", "levels": [{"window": [0, 1]}]}', "malformed"),
        (
            b'{"schema": "pipefill.loadtest.run/1", "levels": [], "records": [{"x": 1}]}',
            "malformed",
        ),
    ],
)
def test_load_errors_are_one_line(tmp_path, content, message):
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ResultsError, match=message) as info:
        RunResult.load(path)
    assert "\n" not in str(info.value)


def test_csv_one_row_per_level(tmp_path):
    run = make_run(slo={"ttft": 0.1})
    path = tmp_path / "r.csv"
    write_csv(run.levels, path)
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert list(rows[0]) == csv_columns()
    assert [int(r["concurrency"]) for r in rows] == [1, 4]
    for row, level in zip(rows, run.levels, strict=True):
        assert float(row["ttft_p50"]) == pytest.approx(level.ttft.p50)
        assert float(row["tpot_p99.9"]) == pytest.approx(level.tpot.p999)
        assert float(row["output_tok_s"]) == pytest.approx(level.output_tok_s)
        assert float(row["goodput"]) == pytest.approx(level.goodput)
        assert row["errors"] == "0"
    for column in ("achieved_concurrency", "itl_p99", "e2e_max", "outside_done_after_window"):
        assert column in rows[0]


# ---------------------------------------------------------------------------------- merge


def test_merge_equals_summary_of_the_union():
    """Two machines, clocks 250.5 s apart, started together: one run of concurrency 1+2."""
    off_a, off_b = 1000.0, 1250.5
    a = make_run((1, 2), offset=off_a, t0=0.0)
    # machine B started its sweep 0.25 s (wall) later than A, on its own monotonic clock
    b = make_run((1, 2), offset=off_b, t0=off_a - off_b + 0.25)
    merged = merge_runs([a, b])
    assert [level.concurrency for level in merged.levels] == [2, 4]
    for i, level in enumerate(merged.levels):
        la, lb = a.levels[i], b.levels[i]
        shift = off_b - off_a
        union = list(a.records_for(la))
        base = max(r.worker for r in union) + 1
        for r in b.records_for(lb):
            union.append(
                dataclasses.replace(
                    r,
                    worker=r.worker + base,
                    t_scheduled=r.t_scheduled + shift,
                    t_send=r.t_send + shift,
                    t_first=r.t_first + shift,
                    t_last=r.t_last + shift,
                    t_end=r.t_end + shift,
                    token_times=[t + shift for t in r.token_times],
                )
            )
        window = (max(la.window[0], lb.window[0] + shift), min(la.window[1], lb.window[1] + shift))
        assert window[0] == pytest.approx(la.window[0] + 0.25)
        expected = summarize_level(union, concurrency=la.concurrency * 2, window=window)
        got, want = level.to_dict(), expected.to_dict()
        got.pop("selfcheck"), want.pop("selfcheck")
        assert _approx_equal(got, want)
        assert level.achieved_concurrency == pytest.approx(2 * la.concurrency, rel=0.01)
        both = la.request_throughput + lb.request_throughput
        assert level.request_throughput == pytest.approx(both, rel=0.05)
    assert {r.level for r in merged.records} == {2, 4}
    assert merged.metadata["merged_from"][1]["t_wall_offset"] == off_b


def _approx_equal(got, want) -> bool:
    if isinstance(want, dict):
        assert set(got) == set(want)
        return all(_approx_equal(got[k], want[k]) for k in want)
    if isinstance(want, list):
        assert len(got) == len(want)
        return all(_approx_equal(g, w) for g, w in zip(got, want, strict=True))
    if isinstance(want, float):
        assert got == pytest.approx(want, rel=1e-9, abs=1e-9)
        return True
    assert got == want
    return True


def test_merge_refuses_what_it_cannot_merge():
    a = make_run((1, 2))
    with pytest.raises(ResultsError, match="no per-request records"):
        merge_runs([a, dataclasses.replace(make_run((1, 2)), records=None)])
    with pytest.raises(ResultsError, match="different levels"):
        merge_runs([a, make_run((1, 4))])
    with pytest.raises(ResultsError, match="different workload"):
        merge_runs([a, make_run((1, 2), workload={"api": "generate"})])
    with pytest.raises(ResultsError, match="do not overlap"):
        merge_runs([a, make_run((1, 2), t0=500.0)])
    no_offset = make_run((1, 2))
    del no_offset.metadata["t_wall_offset"]
    with pytest.raises(ResultsError, match="t_wall_offset"):
        merge_runs([a, no_offset])
    repeated = make_run((1, 2))
    repeated.levels = [combine_repeats([lv, lv]) for lv in repeated.levels]
    with pytest.raises(ResultsError, match="--repeat"):
        merge_runs([a, repeated])
    with pytest.raises(ResultsError, match="different SLOs"):
        merge_runs([a, make_run((1, 2), slo={"ttft": 1.0})])
    with pytest.raises(ResultsError, match="at least two"):
        merge_runs([a])


# -------------------------------------------------------------------------- console output


def _text(render, *args, **kwargs) -> str:
    import io

    buf = io.StringIO()
    render(*args, make_console(buf), **kwargs)
    return buf.getvalue()


def test_render_run_shows_one_row_per_level_and_checks():
    run = make_run((1, 4), slo={"ttft": 0.1})
    run.levels[1].selfcheck = {"warnings": ["CLIENT IS THE BOTTLENECK: test"], "client_cpu": 0.5}
    out = _text(render_run, run)
    assert "output tok/s" in out and "TPOT ms" in out and "goodput" in out
    assert "CLIENT IS THE BOTTLENECK: test" in out
    assert "50%" in out  # client CPU from the self-check
    assert "window and self-checks" in out
    lines = [line for line in out.splitlines() if line.startswith("│")]
    assert len(lines) == 4  # two levels in each of the two tables


def test_render_run_of_repeats_shows_spread():
    run = make_run((1,))
    other = make_run((1,), t0=0.0)
    other.levels[0].output_tok_s *= 1.5
    run.levels = [combine_repeats([run.levels[0], other.levels[0], run.levels[0]])]
    out = _text(render_run, run)
    assert "medians of 3 repetitions" in out
    assert ".." in out  # the min..max line under the cell


def test_render_compare_and_markdown():
    a, b = make_run((1, 4)), make_run((4, 8))
    out = _text(render_compare, a, b, names=("direct", "proxy"))
    assert "C=4" in out and "direct" in out and "proxy" in out
    assert "only in direct: levels 1" in out and "only in proxy: levels 8" in out
    md = levels_markdown(a.levels)
    assert md.count("\n") == 4 and md.startswith("| C | achieved C |")


# ------------------------------------------------------------------------------------ CLI


def test_cli_report_csv_and_slo(tmp_path, capsys):
    path = tmp_path / "r.json"
    make_run((1, 4)).save(path)
    assert main(["report", str(path), "--csv", str(tmp_path / "r.csv")]) == 0
    out = capsys.readouterr().out
    assert "TTFT ms" in out and (tmp_path / "r.csv").exists()
    assert "goodput" not in out
    assert main(["report", str(path), "--slo", "ttft=0.1"]) == 0
    assert "goodput" in capsys.readouterr().out


def test_cli_errors_are_one_line_without_traceback(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2")
    assert main(["report", str(tmp_path / "missing.json")]) == 1
    assert main(["report", str(bad)]) == 1
    good = tmp_path / "good.json"
    make_run((1,)).save(good)
    assert main(["report", str(good), "--slo", "ttft=soon"]) == 2
    bare = tmp_path / "bare.json"
    make_run((1,)).save(bare, include_records=False)
    assert main(["report", str(bare), "--slo", "ttft=1"]) == 1
    assert main(["merge", str(good)]) == 2
    assert main(["merge", str(good), str(bare)]) == 1
    assert main(["compare", str(good), str(bad)]) == 1
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 7 and all(line.startswith("loadtest ") for line in lines)
    assert "Traceback" not in err
    assert "no such file" in lines[0] and "not valid JSON" in lines[1]
    assert "no per-request records" in lines[3] and "no per-request records" in lines[5]


def test_cli_compare(tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    make_run((1, 4)).save(a)
    run_b = make_run((1, 4))
    run_b.levels[0].output_tok_s = run_b.levels[0].output_tok_s * 1.1
    run_b.save(b)
    assert main(["compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "aggregate output tok/s" in out and "+10.0%" in out and "TTFT p99" in out


def test_cli_merge_writes_merged_run(tmp_path, capsys):
    a, b, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "m.json"
    make_run((1, 2), offset=1000.0).save(a)
    make_run((1, 2), offset=1000.0, t0=0.1).save(b)
    assert main(["merge", str(a), str(b), "--out", str(out), "--csv", str(tmp_path / "m.csv")]) == 0
    merged = RunResult.load(out)
    assert [level.concurrency for level in merged.levels] == [2, 4]
    assert "merged from 2 runs" in capsys.readouterr().out
    assert (tmp_path / "m.csv").exists()


def test_cli_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "r.json"
    make_run((1, 4, 8)).save(path)
    png = tmp_path / "sweep.png"
    assert main(["report", str(path), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    png2 = tmp_path / "cmp.png"
    assert main(["compare", str(path), str(path), "--plot", str(png2)]) == 0
    assert png2.stat().st_size > 0


def test_merge_refuses_modelled_time():
    a, b = make_run((1,)), make_run((1,))
    b.metadata["time_scale"] = 0.01
    with pytest.raises(ResultsError, match="modelled time"):
        merge_runs([a, b])


def test_merge_keeps_each_machines_self_check_warnings():
    a, b = make_run((1,)), make_run((1,), t0=0.1)
    a.levels[0].selfcheck = {"client_cpu": 0.2, "warnings": []}
    b.levels[0].selfcheck = {"client_cpu": 0.97, "warnings": ["CLIENT IS THE BOTTLENECK: cpu"]}
    merged = merge_runs([a, b], names=["a.json", "b.json"])
    check = merged.levels[0].selfcheck
    assert check["client_cpu"] == 0.97
    assert "b.json: CLIENT IS THE BOTTLENECK: cpu" in check["warnings"]
    assert len(check["merged"]) == 2


# ------------------------------------------------------------ what a report says of its run


def test_an_interrupted_run_is_announced_first():
    from loadtest.report import INTERRUPTED_BANNER, header_lines

    run = make_run((1,))
    assert INTERRUPTED_BANNER not in header_lines(run.metadata)
    run.metadata["interrupted"] = True
    assert header_lines(run.metadata)[0] == INTERRUPTED_BANNER


def test_runs_are_named_by_what_they_measured():
    from loadtest.report import plot_title, run_label
    from loadtest.report_cli import _names

    proxy = {
        "target": "http://127.0.0.1:8080",
        "server": {"proxy": "pipefill", "fronts": ["pp8 (pp, healthy)", "tp8 (tp, healthy)"]},
        "workload": {"api": "chat"},
    }
    direct = {"target": "http://127.0.0.1:30001", "server": {"sim_profile": "tp8"}}
    assert run_label(proxy) == "proxy (pp8, tp8) @ 127.0.0.1:8080"
    assert run_label(direct) == "tp8 @ 127.0.0.1:30001"
    assert run_label({}) is None
    assert plot_title(proxy) == "proxy (pp8, tp8) @ 127.0.0.1:8080 · api=chat"
    a, b, c = make_run((1,)), make_run((1,)), make_run((1,))
    a.metadata, b.metadata = proxy, direct
    assert _names(["x/run1.json", "y/run2.json"], [a, b]) == [run_label(proxy), run_label(direct)]
    c.metadata = dict(direct)
    # two runs that read the same keep their files' names beside
    assert _names(["r1.json", "r2.json"], [b, c]) == [
        "tp8 @ 127.0.0.1:30001 (r1)",
        "tp8 @ 127.0.0.1:30001 (r2)",
    ]


def test_the_plot_is_titled_and_its_legends_sit_outside_the_data(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from loadtest import plot

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    run = make_run((1, 4))
    run.metadata.update(target="http://127.0.0.1:30001", server={"sim_profile": "tp8"})
    plot.plot_sweep(run, tmp_path / "p.png")
    (fig,) = figures
    assert fig.get_suptitle().startswith("tp8 @ 127.0.0.1:30001")
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        legend = ax.get_legend()
        if legend is None:
            continue
        box, area = legend.get_window_extent(renderer), ax.get_window_extent(renderer)
        assert box.y1 <= area.y0 + 1, "a legend overlaps its panel's data area"
