"""The verdicts benchmarks/heterogeneous.py and benchmarks/replicas.py print: medians over
repeats, margins and targets (a bug here would misreport a target as met); and benchmarks'
refusal of bad arguments before they start servers."""

from __future__ import annotations

import importlib
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import heterogeneous
import replicas


def _run(front: str, rows: dict[int, tuple[float, float]]) -> dict:
    """One front end's run: {C: (tok/s, E2E p99)}."""
    common = {"e2e_p50": 1.0, "ttft_p99": 0.1, "completed": 10, "failed": 0}
    return {
        "front": front,
        "rows": [
            {"front": front, "concurrency": c, "output_tok_s": tok, "e2e_p99": e2e, **common}
            for c, (tok, e2e) in rows.items()
        ],
    }


def test_median_rows_take_the_median_of_every_repeat_in_order():
    repeats = [
        [_run("latency", {4: (100, 9.0)}), _run("round_robin", {4: (90, 12.0)})],
        [_run("latency", {4: (80, 30.0)}), _run("round_robin", {4: (95, 11.0)})],
        [_run("latency", {4: (110, 10.0)}), _run("round_robin", {4: (92, 13.0)})],
    ]
    rows = {r["front"]: r for r in heterogeneous.median_rows(repeats)}
    assert rows["latency"]["output_tok_s"] == 100
    assert rows["latency"]["e2e_p99"] == 10.0
    assert [x["e2e_p99"] for x in rows["latency"]["per_repeat"]] == [9.0, 30.0, 10.0]
    assert rows["round_robin"]["output_tok_s"] == 92


def test_margins_judge_the_medians_and_count_the_repeats_won():
    repeats = [
        [_run("latency", {4: (100, 9.0)}), _run("round_robin", {4: (90, 12.0)})],
        [_run("latency", {4: (80, 30.0)}), _run("round_robin", {4: (95, 11.0)})],
        [_run("latency", {4: (110, 10.0)}), _run("round_robin", {4: (92, 13.0)})],
    ]
    (m,) = heterogeneous.margins(heterogeneous.median_rows(repeats))
    assert m["vs"] == "round_robin" and m["beats"]
    assert m["tok_s_margin"] == pytest.approx(100 / 92 - 1)
    assert m["e2e_p99_margin"] == pytest.approx(12.0 / 10.0 - 1)
    assert (m["repeats_won"], m["repeats"]) == (2, 3)


def test_margins_fail_when_latency_loses_either_number():
    faster_but_longer_tail = [
        [_run("latency", {128: (1700, 25.0)}), _run("router:power_of_two", {128: (1600, 24.0)})]
    ]
    (m,) = heterogeneous.margins(heterogeneous.median_rows(faster_but_longer_tail))
    assert m["tok_s_margin"] > 0 and m["e2e_p99_margin"] < 0
    assert not m["beats"] and m["repeats_won"] == 0


def test_replicas_verdict_is_on_the_median_ratio():
    medians, ok = replicas.verdict({"pp8": [0.78, 1.02, 0.97], "tp8": [1.0, 1.01, 0.99]})
    assert medians == {"pp8": 0.97, "tp8": 1.0} and ok
    _, ok = replicas.verdict({"pp8": [0.78, 0.75, 0.97], "tp8": [1.0, 1.0, 1.0]})
    assert not ok


def test_replicas_verdict_fails_a_repeat_that_measured_nothing():
    _, ok = replicas.verdict({"pp8": [1.0, math.nan, 1.0], "tp8": [1.0, 1.0, 1.0]})
    assert not ok


def test_relay_micro_fit_separates_per_request_from_per_event_cost():
    import relay_micro

    a, b = 150e-6, 17e-6  # seconds per request, per event
    runs = [
        {"requests": r, "events": e, "cpu_s": a * r + b * e}
        for r, e in ((7700, 92000), (900, 66000), (256, 63000))
    ]
    fa, fb = relay_micro.fit(runs)
    assert math.isclose(fa, a, rel_tol=1e-9) and math.isclose(fb, b, rel_tol=1e-9)
    with pytest.raises(relay_micro.BenchError):  # one shape of run says nothing about the split
        relay_micro.fit([{"requests": 10, "events": 100, "cpu_s": 1.0}] * 3)


@pytest.mark.parametrize("script", ["faults", "heterogeneous", "overload", "replicas"])
@pytest.mark.parametrize(
    "argv", [["--out", "results/x"], ["--output-len", "bogus"], ["--output-len", "0"]]
)
def test_benchmarks_refuse_bad_arguments_before_starting_anything(script, argv):
    """``--out x`` is no abbreviation of ``--output-len`` (faults.py read it as one and failed
    only after three simulators and a proxy had started), and a bad length is refused up front."""
    module = importlib.import_module(script)
    with pytest.raises(SystemExit) as e:
        module.main(argv)
    assert e.value.code == 2
