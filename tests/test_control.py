"""The limits' control loop (proxy/control.py): when windows end, what is judged, recalls."""

from __future__ import annotations

import pytest
from adapt_fakes import FakeBackend, FakeClock
from limit_models import ready

from proxy.control import LimitControl
from proxy.limits import AdaptiveLimit, Code, Demand, LimitSettings


def backend(clock: FakeClock, **settings) -> FakeBackend:
    lim = AdaptiveLimit(LimitSettings(**settings), floor=8)
    return FakeBackend("a", clock=clock, limit_obj=lim)


def test_a_window_lasts_window_s():
    clock = FakeClock()
    b = backend(clock)
    control = LimitControl()
    clock.advance(0.9)
    assert control.tick([b], clock.t) == [] and b.stats.window_started == 1000.0
    clock.advance(0.1)
    control.tick([b], clock.t)
    assert b.stats.window_started == clock.t  # closed and fed


def test_the_servers_word_ends_the_window_at_once_and_starts_the_limit_there():
    """Alone, the server keeps a few ready in its queue (they start a step sooner); beside
    another routable backend, exactly its word (the rest are bound late by the proxy)."""
    clock = FakeClock()
    b = backend(clock)
    control = LimitControl()
    clock.advance(0.1)
    b.stats.scrape.max_running_requests = 64
    decisions = control.tick([b], clock.t)
    assert [d.code for _, d in decisions] == [Code.SERVER]
    assert b.limit.limit == ready(64)
    clock.advance(0.1)
    assert control.tick([b], clock.t) == []  # taken once

    pair = [backend(clock), FakeBackend("b", clock=clock, limit_obj=AdaptiveLimit(floor=8))]
    for x in pair:
        x.stats.scrape.max_running_requests = 64
    clock.advance(0.1)
    control.tick(pair, clock.t)
    assert [x.limit.limit for x in pair] == [64, 64]


def test_the_window_after_a_change_settles_until_its_requests_had_their_prefill():
    """Not judged, and it ends once few of the requests the change admitted still wait for a
    first token (or after max_window_s), not window_s later."""
    clock = FakeClock()
    b = backend(clock, initial=20)
    control = LimitControl()
    b.in_flight = 20
    b.stats.observe_in_flight(20, 20)
    b.stats.observe_waiters(30)  # demand above the limit
    clock.advance(1.0)
    assert [d.code for _, d in control.tick([b], clock.t)] == [Code.GROW]
    keys = [b.stats.observe_sent() for _ in range(10)]  # the raise's requests, in prefill
    clock.advance(1.5)
    control.tick([b], clock.t)
    assert b.stats.window_started == 1001.0  # still settling: 10 wait for a first token
    for k in keys[:9]:
        b.stats.observe_answered(key=k)
    clock.advance(0.1)
    assert control.tick([b], clock.t) == []  # the settling window ends, unjudged
    assert b.stats.window_started == clock.t


@pytest.mark.parametrize("gap", [0.05, 0.25])
def test_a_settling_window_ends_once_the_wave_is_answered_and_the_backend_falls_silent(gap):
    """After a raise, the backend answers its wave of prefills, then none while the rest wait
    for room: once it has been silent for a whole window, and for longer than the wave took,
    the settling window ends (before max_window_s) and the windows after judge the queue. A
    wave still answering (first tokens every 0.25 s for 2.5 s) keeps it settling."""
    clock = FakeClock()
    b = backend(clock, initial=20)
    control = LimitControl()
    b.in_flight = 20
    b.stats.observe_in_flight(20, 20)
    b.stats.observe_waiters(30)
    clock.advance(1.0)
    assert [d.code for _, d in control.tick([b], clock.t)] == [Code.GROW]
    raised = clock.t
    keys = [b.stats.observe_sent() for _ in range(30)]  # what waited goes out
    b.in_flight = 50
    b.stats.observe_in_flight(50, b.limit.limit)
    b.stats.observe_waiters(0)
    for k in keys[:10]:  # the wave's first tokens
        clock.advance(gap)
        b.stats.observe_answered(key=k)
    wave = clock.t - raised
    clock.advance(0.95)
    control.tick([b], clock.t)
    assert b.stats.window_started == raised  # silent, but not for a whole window yet
    clock.advance(0.1)
    control.tick([b], clock.t)
    if wave < 1.0:  # 0.5 s of wave, then a window of silence: the settling window ends
        assert b.stats.window_started == clock.t < raised + b.limit.settings.max_window_s
    else:  # 2.5 s of wave: a silence shorter than that may be a pause inside it
        assert b.stats.window_started == raised
    assert b.limit.limit == 50  # ended unjudged


def test_demand_arriving_at_once_settles_like_a_raise():
    """The server's word set the limit with nothing in flight; then the clients all arrive.
    Their wait for prefill behind each other is not a queue: the window after the one they
    arrived in ends unjudged once they had their prefill (or after max_window_s), so no cut is
    read from the wave; a backend that still keeps them waiting is cut in the windows after.
    Demand that grows by a few is judged as ever."""
    clock = FakeClock()
    b = backend(clock)
    control = LimitControl()
    b.stats.scrape.max_running_requests = 64
    clock.advance(0.1)
    control.tick([b], clock.t)  # the server's word, nothing in flight yet
    clock.advance(0.1)
    control.tick([b], clock.t)  # its settling window ends at once: nothing waits
    assert b.limit.limit == ready(64)
    keys = [b.stats.observe_sent() for _ in range(40)]  # the clients arrive, all at once
    b.in_flight = 40
    b.stats.observe_in_flight(40, b.limit.limit)
    clock.advance(1.0)
    assert control.tick([b], clock.t) == []  # the window they arrived in
    for _ in range(4):  # 40 still wait for a first token: settling, unjudged, for 4 s more
        clock.advance(1.0)
        assert control.tick([b], clock.t) == []
    assert b.limit.decision.code is Code.SERVER
    for k in keys[:20]:
        b.stats.observe_answered(key=k)
    clock.advance(1.0)
    control.tick([b], clock.t)  # max_window_s: the settling window ends, unjudged
    for _ in range(2):  # 20 of them wait all along two windows: a queue, cut to what it runs
        clock.advance(1.0)
        control.tick([b], clock.t)
    assert b.limit.decision.code is Code.FULL and b.limit.limit < 40


def test_demand_above_a_cold_limit_raises_it_at_the_next_tick_and_that_window_settles():
    """A cold start does not wait for the end of a window it began idle: the tick after the
    clients arrive takes what waits, and the window that was open settles (unjudged) while
    their prefills run."""
    clock = FakeClock()
    b = backend(clock)
    fleet = [b, backend(clock)]
    control = LimitControl()
    clock.advance(0.6)
    keys = [b.stats.observe_sent() for _ in range(8)]
    b.in_flight = 8
    b.stats.observe_in_flight(8, 8)
    b.stats.observe_waiters(40)
    clock.advance(0.1)
    decisions = control.tick(fleet, clock.t)
    assert [(x, d.code, d.after) for x, d in decisions] == [(b, Code.GROW, 48)]
    assert b.stats.window_started == 1000.0  # the window goes on, now settling
    b.in_flight = 48
    b.stats.observe_in_flight(48, 48)
    b.stats.observe_waiters(0)
    keys += [b.stats.observe_sent() for _ in range(40)]
    clock.advance(0.4)
    assert control.tick(fleet, clock.t) == [] and b.stats.window_started == 1000.0
    for k in keys[:45]:
        b.stats.observe_answered(key=k)
    clock.advance(0.1)
    assert control.tick(fleet, clock.t) == [] and b.stats.window_started == clock.t


@pytest.mark.parametrize("alone", [False, True])
def test_no_demand_raise_while_the_backend_keeps_requests_waiting_for_a_window(alone):
    """Half of what a cold start's raise sent has waited a whole window for a first token:
    that is a queue (or a prefill slower than a window). Where another backend could take
    what waits, the limit does not take it on demand (it would join that queue, no longer
    free to go to whichever backend frees first); the judged windows decide. Alone, holding
    back gains nothing: the limit takes it."""
    clock = FakeClock()
    b = backend(clock)
    fleet = [b] if alone else [b, backend(clock)]
    control = LimitControl()
    b.limit.demand(Demand(clock.t, 8, 24))  # a cold start's raise: 8 -> 32
    keys = [b.stats.observe_sent() for _ in range(32)]
    b.in_flight = 32
    b.stats.observe_in_flight(32, 32)
    b.stats.observe_waiters(40)
    clock.advance(0.5)
    for k in keys[:16]:  # half of them answered, half wait for room
        b.stats.observe_answered(key=k)
    assert b.stats.awaiting_since(clock.t, 100) == 16
    assert b.stats.awaiting_since(clock.t - 0.5, 100) == 0  # they were sent at the start
    if not alone:  # waiting half a window: it may be prefill, the raise is not held
        assert [d.code for _, d in control.demand(fleet, clock.t)] == [Code.GROW]
        b.limit.reset()
        b.limit.demand(Demand(clock.t, 8, 24))
    clock.advance(0.6)
    decisions = control.demand(fleet, clock.t)
    if alone:
        assert [(d.code, d.after) for _, d in decisions] == [(Code.GROW, 72)]
    else:
        assert decisions == [] and b.limit.limit == 32


@pytest.mark.parametrize("alone", [False, True])
def test_a_limit_that_falls_below_what_is_in_flight_recalls_the_unanswered(alone):
    """...so that they bind to whichever backend frees first; with no other backend to go to,
    none is recalled (each would lose its place in the backend's queue for nothing)."""
    clock = FakeClock()
    b = backend(clock, initial=10)
    fleet = [b] if alone else [b, backend(clock, initial=10)]
    control = LimitControl()
    recalled = []
    b.in_flight = 10
    b.stats.observe_in_flight(10, 10)
    for i in range(10):
        b.stats.observe_sent(recall=lambda i=i: recalled.append(i) or True)
    b.limit._phase = b.limit.phase.HOLD
    b.stats.observe_scrape(ok=True, queue_reqs=6.0, running_reqs=4.0)
    clock.advance(1.0)
    control.tick(fleet, clock.t)  # the window the requests were sent in
    clock.advance(5.0)
    control.tick(fleet, clock.t)  # the wave's settling window (max_window_s), unjudged
    for _ in range(2):  # full two windows in a row: 6 of ours waited all along
        clock.advance(1.0)
        control.tick(fleet, clock.t)
    assert b.limit.decision.code is Code.FULL and b.limit.limit == 8  # the floor
    assert recalled == ([] if alone else [9, 8])  # newest first, down to the new limit
