"""The profiles reproduce the measured deployment (in simulated time: not a timing test)."""

from __future__ import annotations

import itertools

import pytest

from loadtest.sim.calibrate import TARGETS, closed_loop
from loadtest.sim.profiles import load_profile


@pytest.mark.parametrize("jitter", [0.0, 0.002], ids=["lockstep", "jittered"])
@pytest.mark.parametrize(("name", "concurrency"), sorted(TARGETS))
def test_calibration_within_10_percent(name, concurrency, jitter):
    """Both with clients resubmitting at the same instant and, as over HTTP, a few ms apart
    (which splits PP cohorts over more micro-batches)."""
    metric, target = TARGETS[(name, concurrency)]
    r = closed_loop(name, concurrency, think_s=jitter, jitter_s=jitter)
    got = getattr(r, metric)
    assert got == pytest.approx(target, rel=0.10), f"{name} C={concurrency} {metric}={got:.1f}"


@pytest.mark.parametrize(("name", "concurrency"), sorted(TARGETS))
def test_calibration_holds_for_loadtest_run_defaults(name, concurrency):
    """`loadtest run`'s default workload (512-token prompts, 256 output tokens) has the same
    prompt:output ratio, so it reproduces the table too."""
    metric, target = TARGETS[(name, concurrency)]
    got = getattr(closed_loop(name, concurrency, input_len=512, output_len=256), metric)
    assert got == pytest.approx(target, rel=0.10)


def test_ep8_assumption_faster_in_aggregate_not_single_request():
    tp1, ep1 = closed_loop("tp8", 1), closed_loop("ep8", 1)
    tp32, ep32 = closed_loop("tp8", 32), closed_loop("ep8", 32)
    assert ep32.aggregate_tok_s > tp32.aggregate_tok_s * 1.05
    assert ep1.per_request_tok_s <= tp1.per_request_tok_s * 1.02
    assert ep1.per_request_tok_s >= tp1.per_request_tok_s * 0.8  # "lower or similar"


def test_pp8_throughput_rises_until_micro_batches_full():
    pp = load_profile("pp8")
    full = pp.num_slots * pp.micro_batch_cap  # requests in flight that fill every slot
    levels = [1, 2, 4, 8, 16, 32, full]
    agg = [closed_loop(pp, c, output_len=128).aggregate_tok_s for c in levels]
    assert all(b > a * 1.3 for a, b in itertools.pairwise(agg)), agg
    beyond = closed_loop(pp, full * 2, output_len=128)
    assert beyond.aggregate_tok_s == pytest.approx(agg[-1], rel=0.05)  # the knee: no more gain
    assert beyond.mean_queued > full * 0.8  # the excess waits in the backend's queue


def test_pp8_few_micro_batches_leave_stages_idle():
    """Below S non-empty micro-batches, another micro-batch adds throughput without slowing
    the others: each request still advances one token per loop, the stages just idle less."""
    pp = load_profile("pp8")
    cap = pp.micro_batch_cap
    rs = [closed_loop(pp, n * cap, output_len=256) for n in (1, 2, 4)]
    for r in rs[1:]:
        assert r.per_request_tok_s == pytest.approx(rs[0].per_request_tok_s, rel=0.05)
    assert rs[1].aggregate_tok_s == pytest.approx(2 * rs[0].aggregate_tok_s, rel=0.1)
    assert rs[2].aggregate_tok_s == pytest.approx(4 * rs[0].aggregate_tok_s, rel=0.1)


def test_tp_throughput_grows_but_per_request_speed_falls():
    rs = [closed_loop("tp8", c, output_len=128) for c in (1, 8, 32)]
    assert rs[0].aggregate_tok_s < rs[1].aggregate_tok_s < rs[2].aggregate_tok_s
    assert rs[0].per_request_tok_s > rs[1].per_request_tok_s > rs[2].per_request_tok_s


def test_kv_exhaustion_queues_and_retracts_in_closed_loop():
    p = load_profile("tp8").with_overrides(max_total_tokens=20_000, new_token_ratio=0.05)
    r = closed_loop(p, 32, input_len=512, output_len=256)
    assert r.mean_queued > 1  # 32 x 768 tokens do not fit in 20k
    assert r.mean_running < 32
    assert r.retractions > 0
    assert r.aggregate_tok_s > 0


def test_closed_loop_deterministic():
    a = closed_loop("pp8", 8, output_len=64, ignore_eos=False, seed=5).to_dict()
    b = closed_loop("pp8", 8, output_len=64, ignore_eos=False, seed=5).to_dict()
    assert a == b
