"""loadtest.stats: per-level summaries from synthetic records with hand-computable answers."""

from __future__ import annotations

import itertools
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loadtest.records import RequestRecord
from loadtest.stats import (
    Distribution,
    LevelSummary,
    combine_repeats,
    compare_levels,
    meets_slo,
    parse_slo,
    percentile,
    summarize_level,
    token_events,
)


def rec(
    t_send: float,
    times: list[float],
    counts: list[int] | None = None,
    *,
    level: int = 4,
    worker: int = 0,
    n: int | None = None,
    t_end: float | None = None,
    error: str | None = None,
    **kw,
) -> RequestRecord:
    """A streamed request whose token events arrive at `times` (t_end = last event)."""
    counts = counts if counts is not None else [1] * len(times)
    return RequestRecord(
        level=level,
        worker=worker,
        t_scheduled=kw.pop("t_scheduled", t_send),
        t_send=t_send,
        t_first=times[0] if times else None,
        t_last=times[-1] if times else None,
        t_end=t_end if t_end is not None else (times[-1] if times else None),
        token_times=list(times),
        token_counts=list(counts),
        completion_tokens=sum(counts) if n is None else n,
        error=error,
        **kw,
    )


# ------------------------------------------------------------------------------ percentiles


def test_percentile_linear_interpolation_by_hand():
    xs = [1.0, 2.0, 3.0, 4.0]
    assert percentile(xs, 0.5) == 2.5
    assert percentile(xs, 0.9) == pytest.approx(3.7)
    assert percentile(xs, 0.0) == 1.0
    assert percentile(xs, 1.0) == 4.0
    assert percentile([7.0], 0.99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 0.5)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=2, max_size=60))
def test_percentile_matches_reference(values):
    """statistics.quantiles(method="inclusive") is numpy's default linear method."""
    xs = sorted(values)
    cuts = statistics.quantiles(xs, n=1000, method="inclusive")  # cut k is quantile k/1000
    for q in (0.5, 0.9, 0.95, 0.99, 0.999):
        assert percentile(xs, q) == pytest.approx(cuts[round(q * 1000) - 1], rel=1e-9, abs=1e-6)
    d = Distribution.of(values)
    assert (d.count, d.min, d.max) == (len(xs), xs[0], xs[-1])
    assert d.min <= d.p50 <= d.p90 <= d.p95 <= d.p99 <= d.p999 <= d.max


def test_percentile_matches_numpy_when_available():
    np = pytest.importorskip("numpy")
    xs = sorted([0.3, 0.1, 5.0, 2.2, 2.2, 9.9, 0.0, 4.4, 1.5])
    for q in (0.5, 0.9, 0.95, 0.99, 0.999):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q * 100)))


def test_empty_distribution_is_none_not_zero():
    d = Distribution.of([])
    assert d.count == 0 and d.p50 is None and d.mean is None
    assert Distribution.from_dict(d.to_dict()) == d
    assert set(d.to_dict()) == {
        "count", "mean", "min", "p50", "p90", "p95", "p99", "p99.9", "max"
    }  # fmt: skip


# --------------------------------------------------------------------------- window clipping


def test_window_clipping_counts_what_fell_outside():
    w = (10.0, 20.0)
    records = [
        rec(1.0, [2.0, 3.0, 9.0]),  # done before W: 3 tokens before
        rec(8.0, [9.0, 11.0, 12.0]),  # done in W: 1 token before, 2 in
        rec(12.0, [13.0, 14.0]),  # done in W: 2 in
        rec(18.0, [19.0, 21.0, 22.0]),  # done after W: 1 in, 2 after
        rec(19.5, [], n=0, t_end=None),  # never done
        rec(15.0, [16.0], n=1, error="http_5xx", t_end=16.5),  # failed in W
        rec(15.0, [], n=0, error="timeout", t_end=25.0),  # failed after W
    ]
    s = summarize_level(records, concurrency=4, window=w)
    assert s.duration == 10.0
    assert s.requests == 7
    assert (s.completed, s.failed) == (2, 1)
    assert s.outside == {
        "done_before_window": 1,
        "done_after_window": 2,
        "never_done": 1,
        "tokens_before_window": 4,
        "tokens_after_window": 2,
    }
    assert s.output_tokens == 2 + 2 + 1 + 1  # the failed request's token arrived in W too
    assert s.output_tok_s == pytest.approx(0.6)
    assert s.request_throughput == pytest.approx(0.2)
    assert s.errors == {"http_5xx": 1}
    assert s.errors_all == {"http_5xx": 1, "timeout": 1}
    # per-request distributions: only the two successful requests done inside W
    assert s.ttft.count == 2
    assert s.ttft.min == pytest.approx(1.0) and s.ttft.max == pytest.approx(1.0)
    assert s.e2e.max == pytest.approx(4.0)  # 8.0 -> 12.0


def test_window_is_half_open():
    records = [rec(0.0, [1.0, 2.0]), rec(0.0, [3.0, 4.0])]
    s = summarize_level(records, concurrency=1, window=(2.0, 4.0))
    assert s.completed == 1  # done at 2.0 counts, done at 4.0 does not
    assert s.outside["done_after_window"] == 1
    assert s.output_tokens == 2  # events at 2.0 and 3.0
    with pytest.raises(ValueError):
        summarize_level(records, concurrency=1, window=(4.0, 4.0))


# ------------------------------------------------------------------------------- tokens / ITL


def test_k_token_events_give_k_itl_samples():
    r = rec(0.0, [1.0, 1.2, 1.8], [1, 2, 3])
    assert r.itl_samples() == pytest.approx([0.1, 0.1, 0.2, 0.2, 0.2])
    s = summarize_level([r], concurrency=1, window=(0.0, 5.0))
    assert s.itl.count == 5
    assert s.itl.mean == pytest.approx(0.16)
    assert s.itl.p50 == pytest.approx(0.2)
    assert s.tpot.p50 == pytest.approx(0.8 / 5)  # (t_last - t_first) / (n - 1), n = 6
    assert s.decode_tok_s.p50 == pytest.approx(5 / 0.8)
    assert s.e2e_tok_s.p50 == pytest.approx(6 / 1.8)
    assert s.output_tokens == 6


def test_usage_reconciles_chunk_counts_and_is_flagged():
    r = rec(0.0, [1.0, 2.0, 3.0], [1, 1, 1], n=5)  # the final usage says 5
    assert token_events(r) == [(1.0, 1), (2.0, 1), (3.0, 3)]
    s = summarize_level([r], concurrency=1, window=(0.0, 2.5))
    assert s.output_tokens == 2  # the residual lands on the last event, after W
    assert s.outside["tokens_after_window"] == 3
    s = summarize_level([r], concurrency=1, window=(0.0, 5.0))
    assert s.output_tokens == 5
    assert s.token_mismatch == 1
    assert s.usage_missing == 0


def test_missing_usage_counted_and_events_used():
    r = rec(0.0, [1.0, 2.0], n=None)
    r.completion_tokens = None
    s = summarize_level([r], concurrency=1, window=(0.0, 5.0))
    assert s.usage_missing == 1 and s.output_tokens == 2 and s.token_mismatch == 0


def test_non_streamed_response_tokens_fall_at_t_last_and_have_no_tpot():
    r = RequestRecord(
        level=1, worker=0, t_scheduled=0.0, t_send=0.0, t_first=3.0, t_last=3.0, t_end=3.0,
        completion_tokens=40,
    )  # fmt: skip
    assert token_events(r) == [(3.0, 40)]
    s = summarize_level([r], concurrency=1, window=(0.0, 4.0))
    assert s.output_tokens == 40
    assert s.tpot.count == 0 and s.decode_tok_s.count == 0 and s.itl.count == 0
    assert s.e2e.p50 == 3.0 and s.e2e_tok_s.p50 == pytest.approx(40 / 3)


def test_latency_is_measured_from_the_scheduled_time():
    r = rec(1.5, [2.0, 3.0], t_scheduled=1.0, level=0)
    s = summarize_level([r], concurrency=0, window=(0.0, 5.0), rate=2.0)
    assert s.ttft.p50 == pytest.approx(1.0)
    assert s.dispatch_delay.p50 == pytest.approx(0.5)
    assert s.label == "2/s"


def test_closed_loop_dispatch_delay_is_gap_after_previous_request():
    records = [
        rec(0.0, [1.0], worker=0, t_end=1.0),
        rec(1.002, [2.0], worker=0, t_end=2.0),
        rec(2.001, [3.0], worker=0),
        rec(0.0, [1.5], worker=1, t_end=1.5),
        rec(1.5, [2.5], worker=1),
    ]
    s = summarize_level(records, concurrency=2, window=(0.0, 4.0))
    assert s.dispatch_delay.count == 3
    assert s.dispatch_delay.max == pytest.approx(0.002)
    assert s.dispatch_delay.min == pytest.approx(0.0)


# ------------------------------------------------------------------------- achieved concurrency


def test_achieved_concurrency_integrates_clipped_intervals():
    records = [
        rec(-5.0, [0.0, 5.0]),  # in flight 0..5 within W: 5
        rec(2.0, [3.0, 4.0]),  # 2
        rec(8.0, [9.0, 20.0]),  # 8..10: 2
        rec(9.0, [], n=0, t_end=None),  # still in flight at the end: 9..10: 1
        rec(3.0, [], n=0, t_end=None, error="connect"),  # failed at once: 0
        rec(11.0, [12.0]),  # after W: 0
    ]
    s = summarize_level(records, concurrency=2, window=(0.0, 10.0))
    assert s.achieved_concurrency == pytest.approx(1.0)
    assert s.concurrency_max == 2


def test_closed_loop_refill_at_same_instant_is_not_counted_twice():
    # one worker, back-to-back requests: ends and starts coincide
    records = [rec(float(i), [i + 0.5, i + 1.0]) for i in range(10)]
    s = summarize_level(records, concurrency=1, window=(2.0, 8.0))
    assert s.achieved_concurrency == pytest.approx(1.0)
    assert s.concurrency_max == 1


def _reference_concurrency(intervals, w0, w1):
    """Brute force: piecewise-constant count between every breakpoint."""
    points = sorted({w0, w1, *(a for a, _ in intervals), *(b for _, b in intervals)})
    points = [p for p in points if w0 <= p <= w1]
    area, peak = 0.0, 0
    for a, b in itertools.pairwise(points):
        mid = (a + b) / 2
        n = sum(1 for s, e in intervals if s <= mid < e)
        area += n * (b - a)
        peak = max(peak, n)
    return area / (w1 - w0), peak


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 400), st.integers(1, 200), st.integers(0, 5)),
        min_size=1,
        max_size=30,
    )
)
def test_achieved_concurrency_and_token_conservation_property(spec):
    records, intervals = [], []
    for start, length, tokens in spec:
        t0, t1 = start / 10, (start + length) / 10
        times = [t0 + (t1 - t0) * (i + 1) / tokens for i in range(tokens)] if tokens else []
        r = rec(t0, times, n=tokens, t_end=t1)
        records.append(r)
        intervals.append((t0, t1))
    w0, w1 = 10.0, 40.0
    s = summarize_level(records, concurrency=3, window=(w0, w1))
    avg, peak = _reference_concurrency(intervals, w0, w1)
    assert s.achieved_concurrency == pytest.approx(avg)
    assert s.concurrency_max == peak
    total = s.output_tokens + s.outside["tokens_before_window"] + s.outside["tokens_after_window"]
    assert total == sum(t for _, _, t in spec)
    outside = s.outside
    assert s.completed + outside["done_before_window"] + outside["done_after_window"] == len(spec)


# ------------------------------------------------------------------------------------- SLOs


def test_parse_slo():
    assert parse_slo("ttft=0.5,tpot=50ms, e2e=10s") == {"ttft": 0.5, "tpot": 0.05, "e2e": 10.0}
    for bad in ("", "ttft", "foo=1", "ttft=fast", "ttft=0", "tpot=-1"):
        with pytest.raises(ValueError):
            parse_slo(bad)


def test_goodput_counts_successful_requests_meeting_every_slo():
    slo = {"ttft": 0.5, "tpot": 0.1}
    records = [
        rec(0.0, [0.2, 0.3, 0.4]),  # ttft 0.2, tpot 0.1: good (bound inclusive)
        rec(0.0, [0.7, 0.8]),  # ttft 0.7: bad
        rec(0.0, [0.1, 0.5]),  # tpot 0.4: bad
        rec(0.0, [0.3], n=1),  # one token: TPOT undefined cannot violate: good
        rec(0.0, [0.1, 0.2], error="stream_error"),  # failed: never good
    ]
    s = summarize_level(records, concurrency=5, window=(0.0, 2.0), slo=slo)
    assert s.good == 2
    assert s.goodput == pytest.approx(1.0)
    assert s.slo_attainment == pytest.approx(2 / 5)
    assert s.slo == slo
    no_slo = summarize_level(records, concurrency=5, window=(0.0, 2.0))
    assert no_slo.goodput is None and no_slo.good is None
    assert not meets_slo(rec(0.0, [], n=0, t_end=1.0), {"ttft": 1.0})


def test_early_stops_and_prompt_tokens():
    records = [
        rec(0.0, [1.0, 2.0], requested_output_len=2, requested_input_len=100, prompt_tokens=104),
        rec(0.0, [1.0], requested_output_len=8, requested_input_len=100, prompt_tokens=None),
    ]
    s = summarize_level(records, concurrency=2, window=(0.0, 3.0))
    assert s.early_stops == 1
    assert s.prompt_tokens == {
        "requested_mean": 100.0,
        "server_mean": 104.0,
        "server_missing": 1,
        "differ": 1,
    }


# --------------------------------------------------------------------- serialisation, repeats


def _summary(tok_s_scale: float = 1.0, errors: dict | None = None) -> LevelSummary:
    records = [rec(0.0, [t * tok_s_scale for t in (1.0, 2.0, 3.0)], worker=w) for w in range(4)]
    for i, kind in enumerate(errors or {}):
        records.append(rec(0.5, [1.0], error=kind, worker=10 + i))
    return summarize_level(
        records, concurrency=4, window=(0.0, 10.0), slo={"ttft": 2.0}, selfcheck={"x": 1}
    )


def test_level_summary_round_trip():
    s = _summary(errors={"timeout": 1})
    again = LevelSummary.from_dict(s.to_dict())
    assert again == s
    assert again.to_dict() == s.to_dict()
    with pytest.raises(ValueError):
        LevelSummary.from_dict({"window": [0, 1]})


def test_combine_repeats_takes_medians_and_keeps_spread():
    runs = [_summary(1.0), _summary(2.0, errors={"timeout": 1}), _summary(1.5)]
    c = combine_repeats(runs)
    assert c.repeats == 3
    assert c.tpot.p50 == pytest.approx(1.5)  # medians of 1.0, 2.0, 1.5
    assert c.spread["tpot/p50"] == {
        "min": pytest.approx(1.0),
        "q1": pytest.approx(1.25),
        "q3": pytest.approx(1.75),
        "max": pytest.approx(2.0),
    }
    assert c.errors == {"timeout": 0}  # median of 0, 1, 0: a kind missing in a run is 0
    assert c.spread["errors/timeout"]["max"] == 1
    assert isinstance(c.completed, int)
    assert c.concurrency == 4 and c.window == runs[0].window
    assert len(c.selfcheck["repeats"]) == 3
    assert combine_repeats(runs[:1]) is runs[0]
    assert LevelSummary.from_dict(c.to_dict()) == c
    other = summarize_level([rec(0.0, [1.0])], concurrency=8, window=(0.0, 2.0))
    with pytest.raises(ValueError):
        combine_repeats([runs[0], other])


def test_compare_levels_absolute_and_relative_change():
    a, b = _summary(1.0), _summary(2.0)
    changes = {c.path: c for c in compare_levels(a, b)}
    tpot = changes["tpot/p50"]
    assert (tpot.a, tpot.b) == (pytest.approx(1.0), pytest.approx(2.0))
    assert tpot.delta == pytest.approx(1.0) and tpot.percent == pytest.approx(100.0)
    assert tpot.better is False  # higher latency is worse
    dec = changes["decode_tok_s/p50"]
    assert dec.percent == pytest.approx(-50.0) and dec.better is False
    errors = changes["errors"]
    assert errors.a == 0 and errors.percent is None and errors.better is None
    assert changes["goodput"].delta is not None


def test_level_without_records_is_empty_not_an_error():
    s = summarize_level([], concurrency=4, window=(0.0, 1.0), slo={"ttft": 1.0})
    assert (s.requests, s.completed, s.output_tok_s, s.achieved_concurrency) == (0, 0, 0.0, 0.0)
    assert s.span is None and s.ttft.count == 0 and s.good == 0 and s.slo_attainment is None
    assert LevelSummary.from_dict(s.to_dict()) == s
