"""Limit algorithms on synthetic windows: numbers only, no server, no clock.

The adaptive limit's decisions are asserted by their structured outcome (``Decision.code`` and
its numbers), never by their wording.
"""

from __future__ import annotations

import dataclasses

import pytest
from limit_models import BatchModel, drive, ready, win
from pydantic import ValidationError

from proxy.limits import (
    FIRST_PROBE_SHARE,
    FULL_WINDOWS,
    AdaptiveLimit,
    Code,
    Demand,
    FixedLimit,
    LimitSettings,
    Phase,
    make_limit,
)
from proxy.stats import Window


def adaptive(floor: int = 1, **kw) -> AdaptiveLimit:
    return AdaptiveLimit(LimitSettings(**kw), floor=floor)


def feed(lim: AdaptiveLimit, windows) -> list:
    return [d for w in windows if (d := lim.update(w)) is not None]


def test_fixed_limit_never_moves():
    lim = make_limit(LimitSettings(algorithm="fixed", initial=24), parallelism="pp", pp_size=8)
    assert isinstance(lim, FixedLimit)
    drive(lim, BatchModel(max_running=64), 20)
    assert lim.limit == 24
    # A fixed limit is exactly what was asked for, even below the pp floor (benchmark sweeps).
    assert (
        make_limit(LimitSettings(algorithm="fixed", initial=4), parallelism="pp", pp_size=8).limit
        == 4
    )


def test_make_limit_applies_the_pp_floor_and_starts_there():
    lim = make_limit(LimitSettings(), parallelism="pp", pp_size=8)
    assert isinstance(lim, AdaptiveLimit)
    assert lim.floor == 8 and lim.limit == 8
    assert make_limit(LimitSettings(), parallelism="tp", pp_size=8).floor == 1
    assert make_limit(LimitSettings(initial=3, min_limit=2)).limit == 3


def test_a_server_that_says_it_is_a_pipeline_raises_the_floor_without_a_hint():
    # no parallelism hint: SGLang's /server_info says pp_size, and a pipeline with fewer
    # requests than stages cannot be full
    lim = adaptive(initial=4, max_limit=64)
    assert lim.floor == 1
    d = lim.update(dataclasses.replace(win(4, pressure=0.0), pp_size=8))
    assert d is not None and (d.code, d.before, d.after) == (Code.SERVER, 4, 8)
    assert lim.floor == 8
    # a backend that keeps most of ours waiting is cut to what it runs, but not below the stages
    limits = []
    for t in range(1, 8):
        lim.update(dataclasses.replace(win(lim.limit, t, awaiting_min=6.0), pp_size=8))
        limits.append(lim.limit)
    assert min(limits) == 8
    # the word never lifts the floor past the ceiling, nor lowers it
    capped = adaptive(max_limit=4)
    capped.update(dataclasses.replace(win(1), pp_size=8))
    assert (capped.floor, capped.limit) == (4, 4)
    hinted = adaptive(floor=16)
    hinted.update(dataclasses.replace(win(16), pp_size=4))
    assert hinted.floor == 16


def test_settings_reject_nonsense():
    with pytest.raises(ValidationError):
        LimitSettings(algorithm="vegas")
    with pytest.raises(ValidationError):
        LimitSettings(backoff=1.5)
    with pytest.raises(ValidationError):
        LimitSettings(target_itl_s=0)


@pytest.mark.parametrize("cap", [3, 8, 24, 64, 100, 333, 1024])
@pytest.mark.parametrize("scraped", [True, False])
def test_converges_to_the_backends_capacity(cap, scraped):
    """Whatever the engine's cap, the limit ends at what it runs plus the tolerance kept ready:
    never below (throughput lost), and further above only while a probe checks whether the
    capacity grew."""
    lim = adaptive(floor=1)
    history = drive(lim, BatchModel(max_running=cap, scraped=scraped), 120)
    assert lim.capacity == cap
    assert min(history[60:]) >= cap
    held = sum(1 for x in history[60:] if x == ready(cap)) / len(history[60:])
    assert held >= 0.75
    # a probe is +25%, and at least enough to be seen over the tolerance
    assert max(history[60:]) <= ready(cap) + max(round(ready(cap) * 0.25), 4)


def test_reaches_capacity_within_ten_windows_from_the_floor():
    lim = adaptive(floor=8)
    history = drive(lim, BatchModel(max_running=512), 30)
    assert next(i for i, x in enumerate(history) if x >= 512) <= 10


def test_grows_only_while_demand_fills_the_limit():
    lim = adaptive(floor=8)
    drive(lim, BatchModel(max_running=512, demand=5), 30)
    assert lim.limit == 8 and lim.phase is Phase.START
    # demand arrives: the limit takes this backend's share of the queue at once
    d = lim.update(win(8, 30.0, backlog=100))
    assert d is not None and d.code is Code.GROW and d.after == 108
    # a small backlog still doubles
    d = lim.update(win(108, 31.0, backlog=5))
    assert d is not None and d.code is Code.GROW and d.after == 216


def test_a_cold_start_takes_demand_as_it_arrives_not_at_a_windows_end():
    """With the capacity unknown, demand above the limit is what sending straight would put on
    the backend: the limit takes it at the moment it is seen (the step a window under pressure
    would take), up to what the server says it runs. Only then: not under the limit, not with
    nothing waiting, not once a window showed the backend full, not at a capacity found."""
    lim = adaptive(floor=8)
    assert lim.demand(Demand(0.1, in_flight=8, backlog=88)) is not None
    assert (lim.decision.code, lim.decision.before, lim.limit) == (Code.GROW, 8, 96)
    assert lim.demand(Demand(0.2, in_flight=96, backlog=3)).after == 192  # at least doubles
    assert lim.demand(Demand(0.3, in_flight=100, backlog=50)) is None  # under the limit
    assert lim.demand(Demand(0.4, in_flight=192, backlog=0)) is None  # nothing waits
    told = adaptive(floor=8)
    d = told.demand(Demand(0.1, in_flight=8, backlog=500, max_running=64, elsewhere=True))
    assert d is not None and d.after == 64

    full = adaptive(floor=8, initial=64)
    assert full.update(win(64, 0.0, awaiting_min=20.0)) is None  # one window full so far
    assert full.demand(Demand(1.1, in_flight=64, backlog=50)) is None
    assert full.update(win(64, 1.0, awaiting_min=20.0)).code is Code.FULL
    assert full.phase is Phase.HOLD and full.demand(Demand(2.1, 46, backlog=50)) is None


def test_what_the_backend_runs_is_read_at_the_moment_the_fewest_waited():
    """Requests arriving through a window raise its mean in flight above what was in flight
    when the fewest waited: a backend that kept 40 of 72 waiting runs 32, not the mean (100)
    less 40. Taking the mean would set the capacity 28 too high and hide that queue."""
    lim = adaptive(floor=8, initial=128)
    lim._phase = Phase.HOLD
    windows = [
        dataclasses.replace(
            win(128, float(t), in_flight=100.0, awaiting_min=40.0, pressure=0.0),
            in_flight_at_min=72.0,
        )
        for t in range(FULL_WINDOWS)
    ]
    d = feed(lim, windows)[-1]
    assert d.code is Code.FULL and lim.capacity == 32 and lim.limit == 32
    # and each full window's waiting is paired with its own count: arrivals filling the
    # backend from 65 to 127 in flight (33, then 95 waiting) is a backend that runs 32, not
    # the second window's count less the first window's waiting (94)
    lim = adaptive(floor=8, initial=128)
    lim._phase = Phase.HOLD
    filling = [
        win(128, 0.0, in_flight=65.0, awaiting_min=33.0, pressure=0.0),
        win(128, 1.0, in_flight=127.0, awaiting_min=95.0, pressure=0.0),
    ]
    d = feed(lim, filling)[-1]
    assert d.code is Code.FULL and lim.capacity == 32 and lim.limit == 32


def test_never_below_the_floor_even_when_the_backend_runs_fewer():
    lim = adaptive(floor=8)
    drive(lim, BatchModel(max_running=3), 60)
    assert lim.limit == 8


def test_full_needs_consecutive_windows_and_cuts_to_what_the_backend_runs():
    lim = adaptive(floor=1, initial=100)
    lim._phase = Phase.HOLD
    # one window with requests kept waiting (a prefill wave) and one without: no change
    assert lim.update(win(100, 0.0, awaiting_min=30.0, pressure=0.0)) is None
    assert lim.update(win(100, 1.0, in_flight=60.0, pressure=0.0)) is None
    assert lim.limit == 100
    decisions = feed(
        lim,
        [win(100, 2.0 + i, awaiting_min=30.0 + i, pressure=0.0) for i in range(FULL_WINDOWS)],
    )
    assert [d.code for d in decisions] == [Code.FULL]
    d = decisions[0]
    # judged on our own count alone (no gauge): the cut leaves none ready, so that the next
    # window tells prefill from a queue; nothing waits there, and the requests kept ready return
    assert d.before == 100 and d.after == 70 and d.excess == 30.0
    assert lim.capacity == 70 and lim.phase is Phase.HOLD
    # what still waits is judged once the backend finished as many as it runs (70)
    assert lim.update(win(70, 10.0, awaiting_min=0.0, pressure=1.0, completions=40)) is None
    d = lim.update(win(70, 11.0, awaiting_min=5.0, pressure=1.0, completions=30))
    assert d is not None and d.code is Code.PREFILL and d.after == ready(70) == 73
    assert lim.prefill_share == 0.0 and lim.capacity == 70


def test_a_wave_of_prefills_after_a_cut_is_not_read_as_the_prefill_share():
    """Clients that send together (answers of one length) are in prefill together for as long
    as the backend takes to prefill them all: the first window after a cut may find most of
    what it runs waiting. Read as the share always in prefill, that undid a right cut and hid
    the queue from then on; over a whole turnover the wave passes and the cut stays."""
    lim = adaptive(floor=1, initial=96)
    lim._phase = Phase.HOLD
    feed(lim, [win(96, t, awaiting_min=32.0, pressure=0.0) for t in range(FULL_WINDOWS)])
    assert (lim.decision.code, lim.limit) == (Code.FULL, 64)
    # a wave of prefills, then its decode: 64 run, nothing of ours queued
    wave = [(48.0, 0), (30.0, 0), (12.0, 8), (0.0, 30), (0.0, 30)]
    decisions = feed(
        lim,
        [win(64, 10 + i, awaiting_min=a, completions=n) for i, (a, n) in enumerate(wave)],
    )
    assert [d.code for d in decisions] == [Code.PREFILL]
    assert decisions[0].after == ready(64) and lim.prefill_share == 0.0
    assert lim.capacity == 64
    # a queue of 32 at 96 shows again as one: the share learned does not hide it
    assert lim.excess(win(96, 30.0, awaiting_min=32.0)) == 32.0


def test_a_dip_in_what_the_backend_runs_is_held_through_a_lasting_one_is_cut():
    """An SGLang server admits less for a while after it retracted requests: the limit follows
    the most it ran within probe_every_s, and the dip waits in its queue as with no limit."""
    lim = adaptive(floor=1)
    drive(lim, BatchModel(max_running=40), 30)
    assert lim.limit == ready(40)
    dip = BatchModel(max_running=34)  # 8 of ours kept waiting: over the tolerance
    decisions = feed(lim, [dip.window(lim.limit, 30 + i) for i in range(25)])
    assert decisions == [] and lim.limit == ready(40)
    t = 55
    while (d := lim.update(dip.window(lim.limit, t))) is None:
        t += 1
    assert d.code is Code.FULL and d.after == ready(34) and lim.capacity == 34
    assert t >= 29 + lim.settings.probe_every_s  # once it last ran 40 is that long ago


def feeding(limit: int, t: float, share: float = 0.15) -> Window:
    """A backend that keeps ``share`` of what it is sent waiting whatever the level (it admits
    in bursts as room frees): its queue is what keeps it fed, not excess."""
    waiting = round(share * limit)
    return win(
        limit,
        t,
        awaiting_min=float(waiting),
        queue=float(waiting),
        running=float(limit - waiting),
    )


def test_a_cut_that_takes_what_the_backend_runs_is_undone_and_not_repeated():
    lim = adaptive(floor=1, initial=64)
    lim._phase = Phase.HOLD
    decisions = [d for t in range(120) if (d := lim.update(feeding(lim.limit, t)))]
    cut, undo = decisions[0], decisions[1]
    assert cut.code is Code.FULL and cut.after == ready(64 - 10) == 56
    # at 56 it ran 48 instead of 54 and as many waited: the cut came out of what it runs
    assert undo.code is Code.UNDO and undo.before == 56 and undo.after == 64
    assert len(decisions) == 2 and lim.limit == 64 and lim.capacity == 54


def test_room_another_proxy_takes_after_a_cut_is_not_a_loss_to_undo():
    """Two proxies share a backend that runs 127 with 21 queued. This one cuts its share of the
    queue; the other proxy's requests take the room, so this one runs fewer after its cut, but
    the backend runs as many as before (SGLang's running gauge): the cut stands, and the next
    is not undone."""
    lim = adaptive(floor=1, initial=85)
    lim._phase = Phase.HOLD
    t = 0
    decisions = []
    for _ in range(12):
        mine = lim.limit
        waiting = 12.0
        decisions += feed(
            lim,
            [win(mine, t, in_flight=float(mine), awaiting_min=waiting, queue=21.0, running=127.0)],
        )
        t += 1
    assert [d.code for d in decisions] == [Code.FULL]
    assert lim.limit == decisions[0].after == ready(85 - 12)


def test_a_cut_that_removes_a_queue_stands_and_a_later_shrink_is_followed():
    lim = adaptive(floor=1, initial=64)
    lim._phase = Phase.HOLD
    t = 0
    for cap in (40, 34):  # a true queue; then the backend's room shrinks for good
        model = BatchModel(max_running=cap)
        for _ in range(60):
            lim.update(model.window(lim.limit, t))
            t += 1
        assert lim.capacity == cap and lim.limit == ready(cap)
    assert Code.UNDO not in {d.code for d in lim.history}


def test_a_loss_larger_than_the_cut_is_the_room_shrinking_not_the_cut():
    """A KV pool that starts thrashing runs far fewer whatever the proxy cut: a cut of d can
    take at most d from what the backend runs, so this is cut to, not undone."""
    lim = adaptive(floor=1, initial=64)
    lim._phase = Phase.HOLD
    t = 0
    for cap in (54, 20):  # the second is held through as a dip for probe_every_s first
        model = BatchModel(max_running=cap)
        for _ in range(60):
            lim.update(model.window(lim.limit, t))
            t += 1
    assert Code.UNDO not in {d.code for d in lim.history}
    assert lim.history[-1].code is Code.FULL and lim.limit == ready(20)


def test_an_undone_cut_is_forgotten_when_the_backend_restarts():
    lim = adaptive(floor=1, initial=64)
    lim._phase = Phase.HOLD
    for t in range(10):
        lim.update(feeding(lim.limit, t))
    assert lim.decision.code is Code.UNDO and lim.limit == 64
    lim.update(win(64, 10, restarted=True, pressure=0.0))
    model = BatchModel(max_running=30)  # it came back smaller: a true queue, cut to
    for t in range(11, 60):
        lim.update(model.window(lim.limit, t))
    assert lim.capacity == 30 and lim.limit == ready(30)


def test_a_few_waiting_requests_are_within_tolerance():
    lim = adaptive(floor=1, initial=200)
    # tolerance: max(queue_tolerance 2, 5% of 200 = 10)
    assert feed(lim, [win(200, i, awaiting_min=9.0, pressure=0.0) for i in range(5)]) == []
    assert lim.limit == 200


def test_the_tolerance_is_a_share_of_what_is_in_flight_not_of_an_unfilled_limit():
    """Demand fills 70 of a limit of 200 and the backend keeps 9 of them waiting all along:
    9 is within 5% of 200 but not of 70, so the backend is full, cut to what it runs (the
    rest of what waits goes back to the proxy, to whichever backend frees first)."""
    lim = adaptive(floor=1, initial=200)
    d = feed(lim, [win(200, i, in_flight=70, awaiting_min=9.0, pressure=0.0) for i in range(2)])
    assert [(x.code, x.after) for x in d] == [(Code.FULL, 61)]


def test_prefill_is_not_a_queue_when_sglang_says_it_does_not_queue():
    """Dense arrivals keep a few of ours in prefill all the time: the proxy alone would read
    them as a queue; SGLang's gauge says nothing waits, and the smaller of the two decides."""
    lim = adaptive(floor=1)
    drive(lim, BatchModel(max_running=400, prefill_share=0.2), 60)
    assert lim.capacity == 400 and lim.prefill_share == 0.0


@pytest.mark.parametrize("share", [0.1, 0.2, 0.4])
def test_without_sglangs_gauge_what_still_waits_after_a_cut_is_prefill(share):
    """The proxy alone cannot tell prefill from a queue by one count; two levels can: a queue
    empties when the limit comes down, requests in prefill stay in proportion. The share
    learned is discounted, and the limit holds at (or a little above) the real capacity, never
    spiralling down."""
    lim = adaptive(floor=1)
    history = drive(lim, BatchModel(max_running=400, prefill_share=share, scraped=False), 90)
    assert any(d.code is Code.PREFILL for d in lim.history)
    assert lim.prefill_share == pytest.approx(share, abs=0.05)
    # the limit never holds the backend below what it runs
    assert min(history[60:]) >= 400
    assert lim.capacity is not None and 0.95 * 400 <= lim.capacity <= 400 * (1 + share)


def test_a_stale_gauge_alone_does_not_cut_when_nobody_of_ours_waits():
    lim = adaptive(floor=1, initial=64)
    windows = [win(64, i, queue=20.0, running=44.0, awaiting_min=0.0) for i in range(4)]
    assert all(d.code is not Code.FULL for d in feed(lim, windows))


def test_non_streamed_traffic_is_judged_by_sglangs_queue():
    lim = adaptive(floor=1, initial=64)
    lim._phase = Phase.HOLD
    windows = [
        win(64, i, queue=24.0, running=40.0, opaque=60.0, awaiting_min=0.0, pressure=0.0)
        for i in range(FULL_WINDOWS)
    ]
    assert [d.code for d in feed(lim, windows)] == [Code.FULL]
    assert lim.capacity == 40 and lim.limit == ready(40)


def test_another_proxys_requests_in_the_queue_are_not_ours_to_shed():
    """Two proxies in front of one backend: each sheds its share of SGLang's queue."""
    lim = adaptive(floor=1, initial=60)
    lim._phase = Phase.HOLD
    windows = [
        win(60, i, queue=20.0, running=100.0, awaiting_min=15.0, pressure=0.0)
        for i in range(FULL_WINDOWS)
    ]
    decisions = feed(lim, windows)
    # our share of the 20 queued: 60 / 120 -> 10 (our own count says 15: the smaller decides)
    assert decisions[-1].code is Code.FULL and lim.capacity == 50


def test_probes_above_a_held_capacity_soon_after_a_cut_then_seldom():
    """Under demand a capacity just read is probed after FIRST_PROBE_SHARE of probe_every_s;
    each probe that finds the backend full again doubles the wait, up to probe_every_s."""
    lim = adaptive(floor=1)
    model = BatchModel(max_running=40)
    drive(lim, model, 300)
    hist = list(lim.history)
    first = next(i for i, d in enumerate(hist) if d.code is Code.FULL)
    assert hist[first].after == ready(40) == 42 and lim.capacity == 40
    waits = []
    for held, nxt in zip(hist[first:], hist[first + 1 :], strict=False):
        if nxt.code is Code.PROBE:
            # demand waited in the proxy all along: the wait runs from the hold's start
            assert held.code is Code.FULL and held.after == 42 and nxt.after == 42 + 10  # +25%
            waits.append(nxt.at - held.at)
        else:  # the probe found it full again: back to what it runs
            assert nxt.code is Code.FULL and nxt.after == 42
    every = lim.settings.probe_every_s
    expected = [every * FIRST_PROBE_SHARE * 2**i for i in range(4)]
    assert expected[-1] == every and len(waits) > 8
    assert all(e <= w <= e + 1 for e, w in zip(expected, waits, strict=False))
    assert all(every <= w <= every + 1 for w in waits[len(expected) :])


def test_a_probe_that_finds_no_queue_grows_again():
    """The backend's capacity grew (a restart with a bigger pool, shorter requests): a probe
    without a queue reopens the search, which doubles as from the start."""
    lim = adaptive(floor=1)
    drive(lim, BatchModel(max_running=40), 60)
    assert lim.capacity == 40
    drive(lim, BatchModel(max_running=300), 60, t0=60)
    assert lim.capacity == 300
    assert any(d.code is Code.REOPEN for d in lim.history)


def test_no_probe_without_requests_waiting_in_the_proxy():
    lim = adaptive(floor=1)
    drive(lim, BatchModel(max_running=40), 30)
    assert lim.limit == ready(40)
    drive(lim, BatchModel(max_running=40, demand=40), 60)
    assert lim.limit == ready(40) and lim.decision.code is Code.FULL


def test_errors_back_off():
    lim = adaptive(floor=1, initial=40)
    d = lim.update(win(40, 0.0, errors=6, completions=8))
    assert d is not None and d.code is Code.ERRORS and d.after == 34


def test_stale_metrics_back_off_after_three_windows_and_never_grow():
    lim = adaptive(floor=1, initial=40)
    decisions = feed(lim, [win(40, i, stale=True) for i in range(6)])
    assert [d.code for d in decisions] == [Code.STALE, Code.STALE]
    assert lim.limit == 28


def test_a_restarted_backend_resumes_at_its_capacity():
    lim = adaptive(floor=8)
    drive(lim, BatchModel(max_running=64), 30)
    assert lim.capacity == 64
    d = lim.update(win(64, 30.0, restarted=True))
    assert d is not None and d.code is Code.RESTART and lim.limit == ready(64)
    assert lim.phase is Phase.HOLD


def test_a_restart_before_any_capacity_starts_over():
    lim = adaptive(floor=8)
    drive(lim, BatchModel(max_running=512), 2)
    assert lim.limit > 8
    lim.update(win(lim.limit, 5.0, restarted=True))
    assert lim.limit == 8 and lim.phase is Phase.START and lim.decision.code is Code.RESTART


def test_a_latency_objective_holds_the_limit_below_capacity():
    """With target_itl_s set, the limit does not grow while the median ITL is above it, and
    steps down once that persists."""
    lim = adaptive(floor=1, initial=64, target_itl_s=0.05)
    assert lim.update(win(64, 0.0, itl_p50=0.08)) is None
    d = lim.update(win(64, 1.0, itl_p50=0.08))
    assert d is not None and d.code is Code.LATENCY and d.after < 64 and d.itl == 0.08
    # under the target again: no change until demand has waited probe_every_s
    assert lim.update(win(lim.limit, 2.0, itl_p50=0.04)) is None


def test_ceiling_is_respected():
    lim = adaptive(floor=1, max_limit=100)
    drive(lim, BatchModel(max_running=5000), 30)
    assert lim.limit == 100


def test_snapshot_and_decision_are_structured():
    lim = adaptive(floor=1)
    drive(lim, BatchModel(max_running=40), 30)
    snap = lim.snapshot()
    assert snap["limit"] == ready(40) and snap["capacity"] == 40 and snap["phase"] == "hold"
    assert snap["decision"] == "full"
    assert str(lim.decision).startswith("full ")


def test_a_growth_step_stops_where_the_server_says_it_runs_no_more():
    """``/server_info``'s max_running_requests: growth stops there, plus the few kept ready in
    its queue as for a capacity found (no queue to cut back, nothing to recall), however much
    waits in the proxy."""
    lim = adaptive(floor=8)
    lim._told = True  # (as if the server's word had come before this test's windows)
    d = lim.update(dataclasses.replace(win(8, 0.0, backlog=200), max_running=64))
    assert d is not None and d.code is Code.GROW and d.after == ready(64) > 64
    at = lim.limit
    assert lim.update(dataclasses.replace(win(at, 1.0, backlog=150), max_running=64)) is None
    assert lim.limit == ready(64)


def test_a_cold_start_begins_where_the_server_says_it_runs():
    """The first window carrying /server_info's max_running_requests sets the limit there, with
    or without demand yet (a limit binds only when demand exceeds it): no windows of growth."""
    lim = adaptive(floor=8)
    d = lim.update(dataclasses.replace(win(8, 0.0, pressure=0.0, in_flight=0.0), max_running=64))
    assert d is not None and d.code is Code.SERVER and d.after == ready(64)
    assert lim.phase is Phase.START  # nothing measured yet: the evidence still decides
    # the word is taken once: a full backend below it comes down and stays down
    model = BatchModel(max_running=40)
    for i in range(5):
        lim.update(dataclasses.replace(model.window(lim.limit, 1 + i), max_running=64))
    assert lim.capacity == 40 and lim.limit == ready(40)


def test_the_requests_kept_ready_at_the_servers_cap_only_where_none_could_go_elsewhere():
    """At exactly its cap a freed slot waits a step for the proxy's next request; a request
    kept ready there starts at once but can no longer be bound late. So: ready when this is
    the only backend, exactly the cap when another could take them; growth and probes stop
    at that level."""
    for elsewhere, level in ((False, ready(64)), (True, 64)):
        lim = adaptive(floor=8)
        w = dataclasses.replace(win(8, 0.0, pressure=0.0, in_flight=0.0), max_running=64)
        d = lim.update(dataclasses.replace(w, elsewhere=elsewhere))
        assert d is not None and d.code is Code.SERVER and lim.limit == level
        demand = win(level, 1.0, backlog=100)
        assert lim.update(dataclasses.replace(demand, max_running=64, elsewhere=elsewhere)) is None
        lim._phase = Phase.HOLD
        held = [dataclasses.replace(win(level, 2 + i, backlog=100), max_running=64,
                                    elsewhere=elsewhere) for i in range(60)]  # fmt: skip
        assert feed(lim, held) == [] and lim.limit == level


def test_a_capacity_found_keeps_requests_ready_only_where_none_could_go_elsewhere():
    """The same principle for a capacity read from what the backend ran: kept ready in its
    queue (its room moves around what it ran) when it is the only backend; exactly what it
    ran where another could take the rest, which then waits in the proxy for whichever
    backend frees first instead of behind this one's next completion."""
    for elsewhere, level in ((False, ready(40)), (True, 40)):
        lim = adaptive(floor=1)
        model = BatchModel(max_running=40)
        decisions = []
        for t in range(30):
            w = dataclasses.replace(model.window(lim.limit, t), elsewhere=elsewhere)
            if (d := lim.update(w)) is not None:
                decisions.append(d)
        full = [d for d in decisions if d.code is Code.FULL]
        assert full and full[0].after == level
        assert lim.capacity == 40 and lim.limit == level


def test_a_probe_stops_at_what_the_server_says_it_runs():
    """A limit held at exactly the server's cap (another backend could take the rest) whose
    backend is now alone probes only up to the cap plus the requests kept ready."""
    lim = adaptive(floor=8, initial=64)
    lim._phase = Phase.HOLD
    lim.capacity = 64
    held = [dataclasses.replace(win(64, i, backlog=100), max_running=64) for i in range(60)]
    decisions = feed(lim, held)
    assert [d.code for d in decisions] == [Code.PROBE] and lim.limit == ready(64)


def test_no_probe_at_or_above_what_the_server_says_it_runs():
    lim = adaptive(floor=1)
    model = BatchModel(max_running=40)
    drive(lim, model, 30)
    assert lim.limit == ready(40)
    windows = [dataclasses.replace(model.window(42, 30 + i), max_running=40) for i in range(60)]
    assert feed(lim, windows) == []


def test_no_judgement_while_draining_down_to_a_lower_limit():
    """Requests that had started cannot be recalled: until they finish, the backend shows what
    was sent before, and the limit does not cut again on it."""
    lim = adaptive(floor=1, initial=50)
    lim._phase = Phase.HOLD
    draining = [win(50, i, in_flight=80.0, awaiting_min=30.0, pressure=0.0) for i in range(4)]
    assert feed(lim, draining) == []
    assert lim.limit == 50


def test_a_restart_with_nothing_known_takes_the_servers_word_again():
    lim = adaptive(floor=8)
    w = dataclasses.replace(win(8, 0.0, pressure=0.0, in_flight=0.0), max_running=96)
    d = lim.update(dataclasses.replace(w, restarted=True))
    assert d is not None and d.code is Code.SERVER and lim.limit == ready(96)


def test_a_queue_that_empties_by_itself_is_a_prefill_wave_not_a_full_backend():
    """After a surge, SGLang queues the new requests for their prefill; its queue gauge drains
    window by window. Only a queue that stays says the backend is full."""
    lim = adaptive(floor=1, initial=64)
    wave = [win(64, i, awaiting_min=40.0 - 12 * i, queue=40.0 - 12 * i, running=24.0 + 12 * i)
            for i in range(4)]  # fmt: skip
    assert feed(lim, wave) == [] and lim.limit == 64
    stays = [win(64, 10 + i, awaiting_min=10.0, queue=10.0, running=54.0) for i in range(2)]
    # the cut takes the smallest excess of the windows counted (the wave's last one, 4)
    assert [d.code for d in feed(lim, stays)] == [Code.FULL] and lim.limit == ready(60)


def test_on_our_own_count_a_backend_that_admits_more_than_it_finishes_is_not_full():
    """Without the gauge, the wave shows as requests admitted (first tokens) faster than
    others finish: the set the backend runs grows, so it had room. A full backend admits only
    as it finishes."""
    lim = adaptive(floor=1, initial=64)
    # each window 12 more have their first token, none finishes
    wave = [win(64, i, awaiting_min=40.0 - 12 * i, completions=0, admitted=12) for i in range(4)]
    assert feed(lim, wave) == [] and lim.limit == 64
    # a queue that stays: it admits as it finishes (10 of each per window)
    stays = [win(64, 10 + i, awaiting_min=10.0) for i in range(2)]
    decisions = feed(lim, stays)
    # on our own count the cut leaves none ready, and keeps the most it ran lately (60)
    assert [(d.code, d.after) for d in decisions] == [(Code.FULL, 60)]


def test_a_cut_that_misread_a_passing_wave_is_cleared_while_it_drains():
    """A cut's excess stays on the backend until its requests end when there is no other
    backend to recall them to; meanwhile each window shows what the backend does with what it
    still runs. Once it keeps none of that waiting under demand (a surge's prefills are done),
    the cut misread a wave: the limit comes back up to what it runs, with the capacity unknown
    again. A backend that still keeps some waiting, no demand, or a back-off on errors is left
    to drain."""
    lim = adaptive(floor=1, initial=228)
    lim._phase = Phase.HOLD
    surge = [win(228, i, awaiting_min=186.0, pressure=0.0) for i in range(FULL_WINDOWS)]
    assert [d.code for d in feed(lim, surge)] == [Code.FULL] and lim.limit == 42
    assert lim.update(win(42, 5.0, in_flight=220.0, awaiting_min=120.0)) is None  # still queued
    assert lim.update(win(42, 6.0, in_flight=220.0, pressure=0.0)) is None  # no demand
    d = lim.update(win(42, 7.0, in_flight=220.4, awaiting_min=1.0))
    assert d is not None and d.code is Code.CLEARED and (d.before, d.after) == (42, 220)
    assert lim.phase is Phase.START and lim.capacity is None
    backed_off = adaptive(floor=1, initial=40)
    d = backed_off.update(win(40, 0.0, errors=6, completions=8))
    assert d is not None and d.code is Code.ERRORS
    assert backed_off.update(win(34, 1.0, in_flight=40.0)) is None and backed_off.limit == 34


def test_a_cut_from_a_limit_demand_did_not_fill_is_redone_from_what_was_in_flight():
    """Beside another backend, demand may fill 72 of a limit of 128. The cut's check redoes it
    from the 72 that were there, never back up to the unfilled 128 (which would leave the
    backend's queue to hold what the proxy should bind late)."""
    lim = adaptive(floor=1, initial=128)
    lim._phase = Phase.HOLD
    feed(lim, [win(128, t, in_flight=72.0, awaiting_min=8.0, pressure=0.0) for t in range(2)])
    assert (lim.decision.code, lim.limit) == (Code.FULL, 64)
    d = lim.update(win(64, 5.0, awaiting_min=1.0, completions=64))  # a turnover: 1 in prefill
    assert d is not None and d.code is Code.PREFILL
    assert 64 < d.after <= 72


def test_a_backend_that_filled_its_last_seats_then_admits_as_it_finishes_is_full():
    """A slow backend given a cold start's burst: it admits its last two as the streak begins,
    then nothing until one ends, while 28 wait all along. Once it has finished some, admitting
    within the tolerance of its finishes is admitting as it finishes: full, cut to what it
    runs (here another backend could take the rest)."""
    lim = adaptive(floor=1, initial=51)
    lim._phase = Phase.HOLD
    filled = [win(51, 0.0, in_flight=30.0, awaiting_min=28.0, completions=0, admitted=2)]
    still = [win(51, 1.0 + t, in_flight=30.0, awaiting_min=28.0, completions=0, admitted=0)
             for t in range(4)]  # fmt: skip
    ends = [win(51, 5.0, in_flight=30.0, awaiting_min=28.0, completions=1, admitted=0)]
    windows = [dataclasses.replace(w, elsewhere=True, ttft=30.0) for w in filled + still + ends]
    decisions = feed(lim, windows)
    assert [(d.code, d.at) for d in decisions] == [(Code.FULL, 6.0)]
    assert lim.limit == 2


def test_no_verdict_while_none_of_ours_runs_or_while_it_admits_more_than_it_finishes():
    """A cold start on long prompts: every request waits for its prefill, then they are
    admitted one by one (one prefill chunk per step) while none has finished. That says
    nothing of what the backend runs, so nothing is cut; once it finishes as many as it
    admitted and 20 still wait all along, it is full."""
    lim = adaptive(floor=1, initial=35)
    lim._phase = Phase.HOLD
    prefill = [win(35, t, awaiting_min=35.0, completions=0, admitted=0) for t in range(6)]
    assert feed(lim, prefill) == [] and lim.limit == 35
    wave = [win(35, 10 + t, awaiting_min=20.0, completions=0, admitted=t % 2) for t in range(8)]
    assert feed(lim, wave) == [] and lim.limit == 35  # 15 run, 4 admitted, none finished
    queue = [win(35, 20 + t, awaiting_min=20.0, completions=1, admitted=0) for t in range(4)]
    decisions = feed(lim, queue)
    assert [(d.code, d.after) for d in decisions] == [(Code.FULL, 15)]
    assert decisions[0].at > 20.0  # not before it finished one


def test_a_queue_that_stands_still_is_full_before_anything_finishes():
    """A backend at its cap whose first answers are long: nothing finishes for a while, and
    nothing more is admitted. Once the queue stood still for longer than the requests it
    admitted took to their first token (3 s here: it may have been one prefill step), it is
    full."""
    lim = adaptive(floor=1, initial=128)
    lim._phase = Phase.HOLD
    admitted = dataclasses.replace(win(128, 0.0, in_flight=64.0, pressure=0.0), ttft=3.0)
    assert lim.update(admitted) is None
    stands = [win(128, t, awaiting_min=64.0, completions=0, admitted=0) for t in range(1, 9)]
    decisions = feed(lim, stands)
    assert [(d.code, d.after, d.at) for d in decisions] == [(Code.FULL, 64, 5.0)]


def test_a_cut_keeps_what_the_backend_ran_when_demand_was_below_its_limit():
    """Fewer clients than the backend runs, prompts long enough that a few of them are always
    in prefill: a window where it ran all 14 shows it runs 14, so a later window where 3 of
    them wait (in prefill) cuts no lower than 14, and no client waits in the proxy."""
    lim = adaptive(floor=1, initial=26)
    lim._phase = Phase.HOLD
    assert lim.update(win(26, 0.0, in_flight=14.0, pressure=0.0)) is None
    waits = [win(26, 1.0 + t, in_flight=14.0, awaiting_min=3.0, pressure=0.0) for t in range(2)]
    decisions = feed(lim, waits)
    assert [(d.code, d.after) for d in decisions] == [(Code.FULL, 14)]
    # without that window, 11 is all it was seen to run
    fresh = adaptive(floor=1, initial=26)
    fresh._phase = Phase.HOLD
    decisions = feed(fresh, waits)
    assert [(d.code, d.after) for d in decisions] == [(Code.FULL, 11)]
