"""Routing policies rank candidates; admission binds. Duck-typed backends, no server."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from adapt_fakes import FakeBackend, FakeClock

from proxy.policies import (
    LeastInFlight,
    P2CPeakEwma,
    RoutingSettings,
    make_policy,
)


def measured(name, *, ttft, itl, limit=32, in_flight=0, clock=None, out=100):
    b = FakeBackend(name, limit, clock=clock)
    b.stats.observe_ttft(ttft)
    b.stats.observe_itl(itl, 10)
    b.stats.observe_completion(True, output_tokens=out)
    b.in_flight = in_flight
    return b


def test_make_policy_by_name_and_settings():
    for name in ("round_robin", "least_in_flight", "p2c_peak_ewma", "latency"):
        assert make_policy(name).name == name
    assert make_policy(RoutingSettings()).name == "latency"
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("random")


def test_round_robin_is_weighted_and_smooth():
    a, b = FakeBackend("a", weight=3), FakeBackend("b", weight=1)
    rr = make_policy("round_robin")
    picks = [rr.pick([a, b]).name for _ in range(8)]
    assert Counter(picks) == {"a": 6, "b": 2}
    assert picks[:4].count("b") == 1  # interleaved, not a a a b in bursts of weight
    # A candidate set that changes (one backend full) still works.
    assert rr.pick([b]) is b


def test_least_in_flight_prefers_fewer_and_rotates_ties():
    a, b, c = FakeBackend("a"), FakeBackend("b"), FakeBackend("c")
    a.in_flight, b.in_flight, c.in_flight = 3, 1, 1
    lif = LeastInFlight()
    picks = {lif.pick([a, b, c]).name for _ in range(6)}
    assert picks == {"b", "c"}


def test_p2c_peak_ewma_avoids_the_slow_backend():
    clock = FakeClock()
    fast = measured("fast", ttft=0.1, itl=0.02, clock=clock)
    slow = measured("slow", ttft=1.0, itl=0.02, clock=clock)
    p2c = P2CPeakEwma(seed=1)
    assert all(p2c.pick([fast, slow]) is fast for _ in range(20))
    # ... unless the fast one is that much busier: cost = ewma x (in_flight + 1)
    fast.in_flight = 20
    assert p2c.pick([fast, slow]) is slow


def test_peak_ewma_adopts_peaks_at_once_and_decays_slowly():
    clock = FakeClock()
    b = measured("b", ttft=0.1, itl=0.02, clock=clock)
    b.stats.observe_ttft(2.0)
    assert b.stats.ttft == 2.0
    clock.advance(1.0)
    b.stats.observe_ttft(0.1)
    assert 1.0 < b.stats.ttft < 2.0  # decays toward 0.1 over ~10 s, not at once


def test_errors_and_429s_count_as_slow():
    clock = FakeClock()
    good = measured("good", ttft=0.2, itl=0.02, clock=clock)
    failing = measured("failing", ttft=0.05, itl=0.02, clock=clock)
    for _ in range(3):
        failing.stats.observe_completion(False, "http_429", 0.001)
    assert failing.stats.ttft > good.stats.ttft
    assert not failing.stats.trusted
    for name in ("p2c_peak_ewma", "latency"):
        pol = make_policy(name, seed=3)
        assert all(pol.pick([good, failing]) is good for _ in range(10))


def test_latency_prefers_the_soonest_completion():
    clock = FakeClock()
    # tp-like: fast per token; pp-like: slow per token but deep; both with free slots.
    tp = measured("tp", ttft=0.1, itl=0.03, limit=32, clock=clock)
    pp = measured("pp", ttft=0.1, itl=0.05, limit=64, clock=clock)
    lat = make_policy("latency")
    assert lat.pick([tp, pp]) is tp
    # Once tp would be past its knee the slowdown term moves traffic to pp.
    tp.in_flight = 60
    assert lat.pick([tp, pp]) is pp


def test_latency_probes_a_new_backend_first():
    clock = FakeClock()
    known = measured("known", ttft=0.1, itl=0.02, clock=clock)
    new = FakeBackend("new", trusted=False, clock=clock)
    assert make_policy("latency").pick([known, new]) is new
    assert make_policy("p2c_peak_ewma", seed=0).pick([known, new]) is new


def test_a_new_backend_is_probed_by_one_request_not_flooded_until_it_answers():
    """A backend with no data is tried first while idle; once requests are in flight there
    and none has answered (a backend that slow would otherwise draw every request until it
    does), the measured one is preferred; with no data anywhere the load spreads."""
    clock = FakeClock()
    known = measured("known", ttft=0.1, itl=0.02, in_flight=5, clock=clock)
    new = FakeBackend("new", clock=clock)
    lat = make_policy("latency")
    assert lat.pick([known, new]) is new
    new.in_flight = 1
    assert all(lat.pick([known, new]) is known for _ in range(4))
    a, b = FakeBackend("a", clock=clock), FakeBackend("b", clock=clock)
    a.in_flight = 3
    assert lat.pick([a, b]) is b  # the idle one is the probe
    b.in_flight = 1
    assert all(lat.pick([a, b]) is b for _ in range(4))  # both busy, none measured: the emptier


def test_latency_exact_ties_spread():
    a = measured("a", ttft=0.1, itl=0.02)
    b = measured("b", ttft=0.1, itl=0.02)
    # Same clock-free numbers: identical estimates -> rotation spreads them.
    b.stats.ttft_ewma.value = a.stats.ttft_ewma.value
    a.stats.itl_model.fold()
    b.stats.itl_model.fold()
    b.stats.itl_model.ewma.value = a.stats.itl_model.ewma.value
    lat = make_policy("latency")
    assert {lat.pick([a, b]).name for _ in range(4)} == {"a", "b"}


def test_a_backend_that_came_back_is_probed_despite_its_old_error_penalties():
    """Error penalties stay in the TTFT estimate until the backend serves again; health marking
    it back (mark_restarted) forgets them, so latency routing tries it instead of never."""
    clock = FakeClock()
    busy = measured("busy", ttft=0.3, itl=0.03, limit=64, in_flight=40, clock=clock)
    back = measured("back", ttft=0.3, itl=0.03, clock=clock)
    for _ in range(3):
        back.stats.observe_completion(False, "connect")  # it died: penalties pile up
    policy = make_policy("latency")
    assert policy.pick([busy, back]) is busy
    back.stats.mark_restarted()
    assert policy.pick([busy, back]) is back


def _learn_itl_curve(b, clock, base=0.04, per_request=0.004, loads=range(1, 9)):
    """Feed ITL samples of a TP-like backend whose step grows with its batch."""
    for n in loads:
        b.stats.observe_in_flight(n, b.limit.limit)
        for _ in range(20):
            clock.advance(0.05)
            b.stats.observe_itl(base + per_request * n)


def test_itl_at_follows_the_measured_slope_and_needs_the_load_to_vary():
    clock = FakeClock()
    varied, flat = FakeBackend("varied", clock=clock), FakeBackend("flat", clock=clock)
    _learn_itl_curve(varied, clock)
    _learn_itl_curve(flat, clock, loads=[4] * 8)
    at2, at8 = varied.stats.itl_at(2), varied.stats.itl_at(8)
    assert at2 < at8
    assert (at8 - at2) / 6 == pytest.approx(0.004, rel=0.25)
    assert flat.stats.itl_at(1) == flat.stats.itl_at(30) == flat.stats.itl
    varied.stats.mark_restarted()
    assert varied.stats.itl_at(4) is None


def test_latency_prefers_the_emptier_of_two_similar_backends_below_their_knees():
    """Both far below their knee (32): one more request slows a TP step, so the backend with
    fewer in flight finishes sooner (without the slope this was a tie, spread by rotation)."""
    clock = FakeClock()
    a, b = FakeBackend("a", 32, clock=clock), FakeBackend("b", 32, clock=clock)
    for x in (a, b):
        x.stats.observe_ttft(0.1)
        x.stats.observe_completion(True, output_tokens=100)
        _learn_itl_curve(x, clock)
    a.in_flight, b.in_flight = 3, 1
    lat = make_policy("latency")
    assert {lat.pick([a, b]).name for _ in range(4)} == {"b"}


def test_an_estimate_begun_in_a_burst_follows_the_samples_after_it():
    """The first ITL sample (a start-up prefill stall) counts as one sample, not as all history:
    a few hundred steady samples later the estimate is theirs."""
    clock = FakeClock()
    b = FakeBackend("b", clock=clock)
    b.stats.observe_in_flight(8, 32)
    b.stats.observe_itl(0.4)  # the first token after eight prefills
    for _ in range(200):
        clock.advance(0.005)
        b.stats.observe_itl(0.05)
    assert b.stats.itl == pytest.approx(0.05, rel=0.05)


def test_an_idle_backends_estimates_fade_until_it_is_tried_again():
    """Nothing of ours on it, nothing refreshes its TTFT and ITL: they fade toward zero, so a
    backend measured slow once is tried again; with a request on it the estimate stands."""
    clock = FakeClock()
    b = FakeBackend("b", clock=clock)
    b.stats.observe_in_flight(1, 32)
    b.stats.observe_ttft(2.0)
    b.stats.observe_itl(0.2)
    b.stats.observe_in_flight(0, 32)
    ttft0, itl0 = b.stats.ttft, b.stats.itl
    clock.advance(b.stats.decay_s)
    assert b.stats.ttft == pytest.approx(ttft0 / math.e)
    assert b.stats.itl == pytest.approx(itl0 / math.e)
    b.stats.observe_in_flight(1, 32)
    assert (b.stats.ttft, b.stats.itl) == (ttft0, itl0)


def test_latency_spreads_over_estimates_within_near_best_by_relative_load():
    """Estimates closer than NEAR_BEST are no evidence: the least loaded for its limit wins, so
    one backend measured a few percent faster does not take every request."""
    clock = FakeClock()
    a = measured("a", ttft=0.1, itl=0.020, limit=64, in_flight=30, clock=clock)
    b = measured("b", ttft=0.1, itl=0.021, limit=64, in_flight=10, clock=clock)
    c = measured("c", ttft=0.1, itl=0.030, limit=64, in_flight=0, clock=clock)
    lat = make_policy("latency")
    assert {lat.pick([a, b, c]).name for _ in range(4)} == {"b"}
    b.in_flight = 40
    assert lat.pick([a, b, c]) is a
