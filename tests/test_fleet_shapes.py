"""benchmarks/fleet_shapes.py: fleets of two generated backends, and one case's arithmetic.

The adaptive limits' ratios are not asserted (that is what the benchmark measures); what is:
a seed always gives the same fleet, its second engine can hold the workload, and a case runs
its three arms on one workload and reports their quotients."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import fleet_shapes as bench
from test_limit_shapes import QUICK  # the short durations its tiny shapes run with

from loadtest.sim.profiles import load_profile
from loadtest.sim.shapes import Shape, estimate


def test_a_seed_always_gives_the_same_fleet_and_its_second_engine_holds_the_workload():
    fleets = [bench.generate_fleet(seed) for seed in range(20)]
    assert all(f is not None for f in fleets)
    for f in fleets:
        again = bench.generate_fleet(f.seed)
        assert again is not None and again.name == f.name
        longest = f.first.input_len + f.first.output_len[1] + 1
        assert f.second.profile.max_total_tokens >= 2 * longest
        assert f.second_est == estimate(f.second.profile, f.first.input_len, f.first.output_len)
        assert f.capacity == f.first.est.capacity + f.second_est.capacity
    assert len({f.name for f in fleets}) == len(fleets)


def _tiny(name: str, cap: int, compute_ms: float) -> Shape:
    p = load_profile("tp8").with_overrides(
        name=name,
        max_running_requests=cap,
        max_total_tokens=4000,
        step_overhead_ms=10.0,
        weights_ms=5.0,
        expert_read_ms=0.0,
        compute_ms_per_token=compute_ms,
        comm_latency_us=0.0,
        comm_us_per_token=0.0,
    )
    return Shape(0, p, 64, (8, 16), estimate(p, 64, (8, 16)))


def test_a_case_runs_three_arms_on_one_workload_and_reports_their_quotients():
    fast, slow = _tiny("fast", 8, 1.0), _tiny("slow", 4, 6.0)
    fleet = bench.Fleet(0, fast, slow, slow.est)
    row = bench.run_fleet(fleet, 18, QUICK)
    assert row["clients"] == 18 and row["fleet"] == "fast + slow"
    for w, (t0, t1) in bench.windows(fleet, 18, QUICK).items():
        assert 0 < t0 < t1
        for arm in bench.ARMS:
            assert row[f"{arm}_{w}_tps"] > 0
        for a, b in bench.RATIOS:
            assert row[f"{w}_{a}_{b}_tps"] == pytest.approx(
                row[f"{a}_{w}_tps"] / row[f"{b}_{w}_tps"]
            )
            assert row[f"{w}_{a}_{b}_ttft"] == pytest.approx(
                row[f"{a}_{w}_ttft99"] / row[f"{b}_{w}_ttft99"]
            )
    assert bench.run_fleet(fleet, 18, QUICK) == row  # virtual time: repeatable
    text = bench.markdown(
        [row],
        {"split": "tune", "command": "c", "commit": "x", "fleets": 1, "seeds": "0-0",
         "jobs": 1, "wall_s": 1.0, "load": "-"},
    )  # fmt: skip
    low = row["steady_adaptive_fixed_tps"] < bench.LOW
    assert f"steady window: {int(low)} of 1." in text
