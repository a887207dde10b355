"""The relay's per-event observations (proxy/stats.py): summed as they arrive, read the same."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.stats import FOLD_SHARE, DecayingEwma, DecayingSlope, ItlModel, RateMeter

_SAMPLES = st.lists(
    st.tuples(
        st.floats(0.001, 1.0),  # ITL
        st.integers(0, 300),  # in flight
        st.sampled_from([0.0, 0.0005, 0.002, 0.5, 3.0, 40.0]),  # time since the last one
    ),
    min_size=1,
    max_size=60,
)


@given(samples=_SAMPLES, reads=st.lists(st.integers(0, 60), max_size=8))
def test_itl_model_folded_in_batches_matches_every_sample_observed_at_its_batchs_last_time(
    samples, reads
):
    """Folding sums is exact for samples at one instant; a batch (ended by a read, or by a
    sample more than FOLD_SHARE of the horizon after the batch began) counts at its last
    sample's time, so the reference observes each sample at that time."""
    tau = 10.0
    model = ItlModel(tau)
    ewma, load, slope = DecayingEwma(tau), DecayingEwma(tau), DecayingSlope(6 * tau)
    pending: list[tuple[float, int]] = []
    began = last = 0.0

    def flush() -> None:
        for y, x in pending:
            ewma.observe(y, last)
            load.observe(x, last)
            slope.observe(x, y, last)
        pending.clear()

    now = 100.0
    read_at = set(reads)
    for i, (itl, in_flight, gap) in enumerate(samples):
        now += gap
        if pending and now - began > FOLD_SHARE * tau:
            flush()
        if not pending:
            began = now
        model.add(itl, in_flight, now)
        pending.append((itl, in_flight))
        last = now
        if i in read_at or i == len(samples) - 1:
            model.fold()
            flush()
            assert model.ewma.value == pytest.approx(ewma.value, rel=1e-9)
            assert model.load.value == pytest.approx(load.value, rel=1e-9, abs=1e-9)
            if slope.slope is None:
                assert model.slope.slope is None
            else:
                assert model.slope.slope == pytest.approx(slope.slope, rel=1e-6, abs=1e-9)


def test_itl_model_reset_drops_what_was_not_folded():
    model = ItlModel(10.0)
    model.add(0.5, 3, 1.0)
    model.reset()
    model.fold()
    assert model.ewma.value is None and model.load.value is None


@given(
    events=st.lists(st.tuples(st.floats(0.0, 3.0), st.integers(1, 5)), min_size=1, max_size=80),
    horizon=st.sampled_from([1.0, 10.0]),
)
def test_rate_meter_counts_what_fell_in_its_horizon(events, horizon):
    """The bucket being filled is kept apart; the rate read is what a sum over the buckets of
    the horizon gives, whatever order of adds and reads."""
    meter = RateMeter(horizon_s=horizon, buckets=20)
    width = horizon / 20
    now, seen = 50.0, []
    for gap, amount in events:
        now += gap
        meter.add(amount, now)
        seen.append((int(now // width), amount))
        key = int(now // width)
        expected = sum(a for k, a in seen if key - 20 < k <= key) / horizon
        assert meter.rate(now) == pytest.approx(expected)
    later = now + 2 * horizon
    assert meter.rate(later) == 0.0


def test_the_fewest_waiting_are_paired_with_what_was_in_flight_then():
    """Where the count in flight moves within a window (open-loop arrivals, a raise filling),
    the fewest waiting for a first token are a share of what was in flight at that moment,
    not of the window's mean."""
    from adapt_fakes import FakeClock

    from proxy.stats import BackendStats

    clock = FakeClock()
    st = BackendStats(clock=clock)
    keys = [st.observe_sent() for _ in range(10)]
    st.observe_in_flight(10, 100)
    st.take_window()
    clock.advance(0.1)
    for k in keys[:4]:
        st.observe_answered(key=k)  # 6 wait of the 10
    clock.advance(0.1)
    more = [st.observe_sent() for _ in range(50)]
    st.observe_in_flight(60, 100)  # arrivals: 56 wait of 60, for the rest of the window
    clock.advance(0.8)
    w = st.take_window()
    assert w.awaiting_min == 6 and w.in_flight_at_fewest == 10
    assert w.in_flight > 40  # the mean, which the fewest waiting are not a share of
    # the next window starts paired with what is in flight at its start
    st.observe_answered(key=more[0])
    clock.advance(1.0)
    w = st.take_window()
    assert (w.awaiting_min, w.in_flight_at_fewest) == (55, 60)
