"""Limit algorithms on synthetic sample streams: numbers only, no server, no clock."""

from __future__ import annotations

import copy
import dataclasses
import itertools

import pytest
from limit_models import BatchModel, KneeModel, drive
from pydantic import ValidationError

from proxy.limits import AdaptiveLimit, FixedLimit, LimitSettings, make_limit


def adaptive(floor: int = 1, **kw) -> AdaptiveLimit:
    return AdaptiveLimit(LimitSettings(**kw), floor=floor)


def test_fixed_limit_never_moves():
    lim = make_limit(LimitSettings(algorithm="fixed", initial=24), parallelism="pp", pp_size=8)
    assert isinstance(lim, FixedLimit)
    drive(lim, KneeModel(knee=64), 20)
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


def test_settings_reject_nonsense():
    with pytest.raises(ValidationError):
        LimitSettings(algorithm="vegas")
    with pytest.raises(ValidationError):
        LimitSettings(backoff=1.5)


@pytest.mark.parametrize("knee", [12, 32, 48, 100])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_converges_near_the_knee(knee, seed):
    lim = adaptive(floor=8)
    model = KneeModel(knee=knee, seed=seed)
    history = drive(lim, model, 120)
    tail = history[60:]
    # Near the knee: close to full throughput, without holding many more than the knee.
    best = model.throughput(knee)
    assert sum(model.throughput(c) for c in tail) / len(tail) >= 0.93 * best
    assert sum(tail) / len(tail) <= knee * 1.3 + 1
    assert lim.knee is not None and 0.75 * knee <= lim.knee <= 1.3 * knee + 1


def test_reaches_the_knee_quickly_from_the_floor():
    lim = adaptive(floor=8)
    history = drive(lim, KneeModel(knee=48, seed=4), 30)
    assert max(history) >= 40  # slow start: 30 windows are enough to get there


def test_never_below_the_pp_floor_even_when_the_knee_is_lower():
    lim = adaptive(floor=8)
    model = KneeModel(knee=3, seed=5, queue_past=3, kv_past=3)
    history = drive(lim, model, 100)
    assert min(history) == 8 and lim.limit == 8


def test_follows_the_knee_up_and_down():
    lim = adaptive(floor=1)
    drive(lim, KneeModel(knee=24, seed=6), 80)
    assert 18 <= lim.limit <= 32
    history = drive(lim, KneeModel(knee=64, seed=7), 200, t0=80)
    assert 50 <= sum(history[-40:]) / 40 <= 85
    history = drive(lim, KneeModel(knee=16, seed=8), 200, t0=280)
    assert 12 <= sum(history[-40:]) / 40 <= 22


def test_readapts_when_the_backend_becomes_slower():
    lim = adaptive(floor=1)
    drive(lim, KneeModel(knee=32, seed=9), 80)
    before = lim.limit
    # Half as fast per token, knee unchanged: ITL doubles at the held limit -> search again,
    # and it finds the same knee.
    slow = KneeModel(knee=32, rate=12.5, seed=10)
    drive(lim, slow, 120, t0=80)
    assert any("drifted" in why for _, _, why in lim.history)
    assert 0.75 * before <= lim.limit <= 1.3 * before + 1


@pytest.mark.parametrize("new_knee", [64, 32])
def test_drift_steps_down_and_follows_the_knee_without_starving_the_backend(new_knee):
    """Half as fast per token at a held knee of 64, the knee unchanged or moved to 32: the
    drifted limit steps down and goes on down only while little is lost, so it returns to 64 or
    follows to 32 (searching again from a quarter of the knee dropped it to 16 either way)."""
    lim = adaptive(floor=1)
    drive(lim, KneeModel(knee=64, seed=9), 80)
    history = drive(lim, KneeModel(knee=new_knee, rate=12.5, seed=10), 150, t0=80)
    assert any("drifted" in why for _, _, why in lim.history)
    assert min(history) >= 0.75 * new_knee
    assert 0.9 * new_knee <= sum(history[-40:]) / 40 <= 1.25 * new_knee


def test_a_limit_held_for_lack_of_demand_does_not_search_again_on_latency():
    """Held at demand (20 clients, knee 64): latency rising there is not a changed backend (the
    baseline is a climb step's), and searching again from a quarter would starve the clients."""
    lim = adaptive(floor=1)
    drive(lim, KneeModel(knee=64, seed=31, demand=20), 60)
    held = lim.limit
    assert 20 <= held <= 31  # 20 plus headroom: growth was linear up to 20
    drive(lim, KneeModel(knee=64, rate=12.5, seed=32, demand=20), 60, t0=60)
    assert not any("drifted" in why for _, _, why in lim.history)
    assert lim.limit >= 20


def test_a_steps_transient_is_not_the_drift_baseline():
    """Right after a raise part of the requests are still in prefill, so fewer decode and ITL
    reads low for a few windows: held at the knee, the steady ITL is not a drifted backend."""

    class Transient(KneeModel):
        def window(self, limit, t, duration=1.0):
            w = super().window(limit, t, duration)
            self.age = self.age + 1 if limit == self.level else 0
            self.level = limit
            if self.age < 3:  # the settle window and the next two
                w = dataclasses.replace(w, itl=w.itl * 0.6, itl_p50=w.itl_p50 * 0.6)
            return w

    model = Transient(knee=48, seed=33)
    model.level, model.age = None, 0
    lim = adaptive(floor=8)
    drive(lim, model, 150)
    assert not any("drifted" in why for _, _, why in lim.history)
    assert 40 <= lim.limit <= 64


def test_prefill_stalls_at_a_held_knee_are_not_drift():
    """On a PP backend a window caught in a prefill stall carries few tokens, all slow (pp8 at
    64 in flight: ~1 window in 4 has a median ITL of ~0.1 s against ~0.02 s). A measurement
    reads the ITL of the tokens it saw, not the median of three windows' medians, so stalls that
    come and go neither restart the search from a quarter of the knee nor pass for gains."""

    class Stalls(KneeModel):
        def window(self, limit, t, duration=1.0):
            w = super().window(limit, t, duration)
            if self.rng.random() < 0.3:
                slow = 5.0
                w = dataclasses.replace(
                    w,
                    tokens=int(w.tokens * 0.45),
                    tokens_per_s=w.tokens_per_s * 0.45,
                    itl=w.itl * slow,
                    itl_p50=w.itl_p50 * slow,
                )
            return w

    lim = adaptive(floor=8)
    history = drive(lim, Stalls(knee=64, seed=41), 300)
    assert not any("drifted" in why for _, _, why in lim.history)
    # Nor do they read as huge gains and losses that walk the limit far past the knee.
    tail = history[100:]
    assert 48 <= sum(tail) / len(tail) <= 64 * 1.3 + 1


def test_the_climb_stops_at_the_backends_running_cap():
    lim = adaptive(floor=1)
    model = BatchModel(max_running=40, seed=11)
    history = drive(lim, model, 120)
    # Past the cap SGLang queues the extra requests: they do not count toward the decode rate,
    # so the step does not pay and is undone. (Slow start may double once past the cap, never
    # past slow_start_until.)
    assert max(history) <= LimitSettings().slow_start_until
    assert 32 <= sum(history[-40:]) / 40 <= 44


@pytest.mark.parametrize("cap", [24, 40, 56])  # (this model reads KV full past 64)
def test_requests_waiting_for_a_token_stop_the_climb_at_the_running_cap(cap):
    """Past max_running_requests SGLang queues what we send; ITL does not rise (the batch is the
    same), but those requests get no token: the proxy's own count stops the climb there."""
    lim = adaptive(floor=8)
    history = drive(lim, BatchModel(max_running=cap, seed=cap, per_req_ms=0.1), 90)
    found = next(t for t, _, why in lim.history if "running cap" in why)
    assert cap * 0.9 <= sum(history[-30:]) / 30 <= cap * 1.15
    # No probe past the cap for congestion_memory_s (each would queue requests in SGLang)...
    memory = int(LimitSettings().congestion_memory_s)
    assert max(history[int(found) + 1 : int(found) + memory]) <= cap + 1
    # ...and after it the probes go on (the cap may have moved).
    more = drive(lim, BatchModel(max_running=cap, seed=cap + 1, per_req_ms=0.1), 60, t0=90)
    assert max(more) > cap + 1
    # Without the proxy's count (gauges only), the same climb overshoots further.
    blind = adaptive(floor=8)
    model = BatchModel(max_running=cap, seed=cap, per_req_ms=0.1, proxy_sees_queue=False)
    drive(blind, model, 90)
    assert not any("running cap" in why for _, _, why in blind.history)


def test_a_slack_step_is_not_a_running_cap():
    """Demand just above a level (67 clients, limit raised from 64 to 96): the step's level is
    the 67 used, and a few requests in prefill are churn, not SGLang's queue."""

    class Churn(KneeModel):
        def window(self, limit, t, duration=1.0):
            w = super().window(limit, t, duration)
            return dataclasses.replace(w, awaiting=3.0 if w.in_flight > 64 else 0.5)

    lim = adaptive(floor=8, initial=64)
    drive(lim, Churn(knee=200, seed=34, demand=67), 40)
    assert not any("running cap" in why for _, _, why in lim.history)
    assert lim.limit >= 67


def test_a_prefill_wave_after_a_raise_is_not_a_running_cap():
    """The requests a raise admits wait for their prefill for a window or two: that is not a
    queue, and the climb goes on to the knee."""

    class PrefillWave(KneeModel):
        def window(self, limit, t, duration=1.0):
            w = super().window(limit, t, duration)
            self.age = self.age + 1 if limit == self.level else 0
            added = max(0, limit - (self.level or limit)) if self.age == 0 else self.added
            self.added, self.level = added, limit
            if self.age < 2:
                w = dataclasses.replace(w, awaiting=float(added))
            return w

    model = PrefillWave(knee=100, seed=30)
    model.level, model.age, model.added = None, 0, 0
    lim = adaptive(floor=8)
    history = drive(lim, model, 60)
    assert not any("running cap" in why for _, _, why in lim.history)
    assert max(history) >= 90


def test_backs_off_when_the_backend_starts_queueing_at_the_knee():
    lim = adaptive(floor=1)
    drive(lim, KneeModel(knee=32, seed=19), 80)
    held = lim.limit
    # Another client fills the backend: SGLang queues 12 of ours, TTFT rises.
    model = KneeModel(knee=32, seed=20, queue_past=held - 12, ttft0=0.5)
    drive(lim, model, 10, t0=80)
    assert any("queueing" in why for _, _, why in lim.history)
    assert lim.limit <= held - 10


def test_backs_off_on_a_full_kv_pool():
    lim = adaptive(floor=4, initial=40)
    model = KneeModel(knee=200, seed=12, kv_past=20)
    history = drive(lim, model, 60)
    assert history[-1] <= 20
    assert min(history) >= 4
    assert any("KV" in why for _, _, why in lim.history)


def test_stale_metrics_count_as_saturated():
    lim = adaptive(floor=8, initial=32)
    model = KneeModel(knee=64, seed=13)
    for i in range(30):
        w = dataclasses.replace(model.window(lim.limit, i), stale=True)
        lim.update(w)
    assert lim.limit == 8  # backed off to the floor, not below


def test_demand_limited_windows_do_not_move_the_limit():
    lim = adaptive(floor=1, initial=16)
    model = KneeModel(knee=64, seed=14, demand=4)  # only 4 clients: never at the limit
    drive(lim, model, 60)
    assert lim.limit == 16


def test_a_restart_before_any_knee_starts_the_search_again():
    lim = adaptive(floor=8)
    model = KneeModel(knee=48, seed=15)
    drive(lim, model, 2)
    assert lim.knee is None
    lim.update(dataclasses.replace(model.window(lim.limit, 2), restarted=True))
    assert lim.limit == 8 and lim.knee is None
    assert "search again" in lim.reason


def test_a_restarted_backend_resumes_at_the_knee_it_had():
    """A restart that comes back demand-limited still gets its old limit (nothing would make it
    climb), and one that comes back with a lower knee moves down to it."""
    lim = adaptive(floor=8)
    model = KneeModel(knee=48, seed=15)
    drive(lim, model, 60)
    knee = lim.knee
    assert knee is not None and 40 <= knee <= 60
    lim.update(dataclasses.replace(model.window(lim.limit, 60), restarted=True))
    assert lim.limit == knee and "resume" in lim.reason
    drive(lim, KneeModel(knee=48, seed=26, demand=10), 30, t0=61)
    assert lim.limit >= knee  # demand-limited: held, not lost
    # Came back smaller: SGLang queues past 24 and TTFT rises.
    lim.update(dataclasses.replace(model.window(lim.limit, 91), restarted=True))
    smaller = KneeModel(knee=24, seed=27, queue_past=24, ttft0=0.5)
    history = drive(lim, smaller, 60, t0=92)
    assert sum(history[-20:]) / 20 <= 24 * 1.3


def test_a_noisy_slow_start_window_is_measured_again():
    """One window caught in a prefill wave right after a doubling reads as sub-linear growth:
    slow start measures that level again instead of falling back to 25% steps."""

    class PrefillWave(KneeModel):
        def window(self, limit, t, duration=1.0):
            w = super().window(limit, t, duration)
            self.age = self.age + 1 if limit == self.level else 0
            self.level = limit
            if limit == 16 and self.age < 2:  # the first two windows at 16: 30% fewer tokens
                tps = w.tokens_per_s * 0.7
                itl = w.in_flight / tps
                w = dataclasses.replace(w, tokens_per_s=tps, tokens=int(tps), itl=itl, itl_p50=itl)
            return w

    model = PrefillWave(knee=64, seed=28)
    model.level, model.age = None, 0
    lim = adaptive(floor=8)
    history = drive(lim, model, 40)
    assert any("measure again" in why for _, _, why in lim.history)
    reached = _windows_to_reach(history, 56)
    assert reached is not None and reached <= 20  # 25% steps from 10 take 35+ windows


def test_slow_start_stops_doubling_at_slow_start_until():
    lim = adaptive(floor=8, slow_start_until=32)
    history = drive(lim, KneeModel(knee=200, seed=29), 80)
    steps = [(a, b) for a, b in itertools.pairwise(history) if b > a]
    assert (16, 32) in steps  # doubled up to the threshold...
    assert all(b <= a * 1.5 + 1 for a, b in steps if a >= 32)  # ...then grew by at most 50%
    assert max(history) >= 100  # and went on climbing


def test_two_proxies_share_a_backend_without_an_arms_race():
    """Each proxy sees the backend's scraped running count; together they hold about the knee."""
    knee = 40
    a, b = adaptive(floor=1, initial=30), adaptive(floor=1, initial=30)
    model = KneeModel(knee=knee, seed=16, noise=0.02)
    totals = []
    for i in range(300):
        la, lb = a.limit, b.limit
        total = la + lb
        tps = model.throughput(total) * (1 + model.rng.gauss(0, model.noise))
        for lim, mine in ((a, la), (b, lb)):
            share = tps * mine / total
            w = dataclasses.replace(
                model.window(mine, i),
                tokens=int(share),
                tokens_per_s=share,
                itl=total / tps,
                itl_p50=total / tps,
                ttft=0.2 * max(1.0, total / knee),
                running_reqs=float(min(total, 10_000)),
                queue_reqs=0.0,
            )
            lim.update(w)
        totals.append(total)
    # Combined in flight ends near one proxy's knee, not at twice it.
    assert sum(totals[-60:]) / 60 <= knee * 1.4


def test_snapshot_exposes_limit_knee_and_baselines():
    lim = adaptive(floor=8)
    drive(lim, KneeModel(knee=32, seed=17), 60)
    snap = lim.snapshot()
    for key in (
        "limit",
        "knee",
        "floor",
        "phase",
        "baseline_itl_s",
        "baseline_ttft_s",
        "current_itl_s",
        "current_ttft_s",
        "reason",
    ):
        assert key in snap
    assert snap["limit"] == lim.limit and snap["baseline_itl_s"] is not None


def test_a_climb_that_outruns_demand_settles_just_above_it():
    """64 clients in front of a backend whose knee is higher: hold near 64, not at 128."""
    lim = adaptive(floor=8)
    history = drive(lim, KneeModel(knee=200, seed=18, demand=64), 90)
    # 64 plus headroom (growth was linear up to 64): not 128 (an up-probe may be in progress)
    assert 64 <= sorted(history[-30:])[15] <= 100
    assert 60 <= lim.knee <= 80
    assert max(history[-30:]) <= 110


@pytest.mark.parametrize("seed", [18, 19])
def test_a_limit_held_for_demand_below_a_linear_climb_keeps_room_for_a_surge(seed):
    """Held for demand (20 clients) where growth was still linear, the limit keeps 50% headroom:
    a surge of demand (C = 32 -> 128 over heterogeneous backends) is admitted at once instead of
    waiting in the proxy through measured climbs (half a step of headroom: 22-23)."""
    lim = adaptive(floor=8)
    drive(lim, KneeModel(knee=200, seed=seed, demand=20), 40)
    assert 28 <= lim.limit <= 31


def _windows_to_reach(history: list[int], level: int) -> int | None:
    return next((i for i, lim in enumerate(history) if lim >= level), None)


@pytest.mark.parametrize("seed", [21, 22, 23])
def test_demand_rising_past_a_held_limit_resumes_the_climb(seed):
    """20 clients, then 128, in front of a knee of 64: the limit held for 20 climbs on at once."""
    lim = adaptive(floor=8)
    drive(lim, KneeModel(knee=64, seed=seed, demand=20), 60)
    held = lim.limit
    assert 20 <= held <= 31  # demand-limited: 20 plus headroom (and perhaps a probe's)
    model = KneeModel(knee=64, seed=seed + 100, demand=128)
    history = drive(lim, model, 80, t0=60)
    reached = _windows_to_reach(history, 56)
    assert reached is not None and reached <= 12  # periodic probes alone: 15-45 windows
    tail = history[40:]
    assert sum(model.throughput(c) for c in tail) / len(tail) >= 0.93 * model.throughput(64)
    assert sum(tail) / len(tail) <= 64 * 1.3


@pytest.mark.parametrize("seed", [61, 62, 63])
def test_a_limit_held_for_demand_from_the_start_climbs_in_slow_start_under_a_backlog(seed):
    """8 clients, then 128 (C = 4 -> 32 -> 128 on heterogeneous backends): no step above the
    start was ever judged, so the held limit knows nothing of the knee and doubles (base steps
    of 25%, each measured over three windows, took ~36 windows from 9 to 56 while requests
    waited in the proxy)."""
    lim = adaptive(floor=1)
    drive(lim, KneeModel(knee=64, seed=seed, demand=8), 40)
    assert lim.limit <= 12
    model = KneeModel(knee=64, seed=seed + 100, demand=128)
    history = drive(lim, model, 80, t0=40)
    reached = _windows_to_reach(history, 56)
    assert reached is not None and reached <= 14
    tail = history[40:]
    assert sum(tail) / len(tail) <= 64 * 1.3


def test_a_held_knee_with_requests_waiting_probes_up_sooner():
    """A knee found too low (here: the backend got faster) is re-probed promptly while requests
    wait in the proxy, and the limit follows the knee up."""
    lim = adaptive(floor=1)
    drive(lim, KneeModel(knee=24, seed=24), 80)
    assert 18 <= lim.limit <= 32
    history = drive(lim, KneeModel(knee=64, seed=25), 60, t0=80)
    reached = _windows_to_reach(history, 48)
    # Sooner than the periodic probes alone (27-37 windows): a probe up within two measurements.
    assert reached is not None and reached <= 26


class NoBacklog(KneeModel):
    """The router fills the backend to its limit, but nobody waits in the proxy."""

    def window(self, limit, t, duration=1.0):
        return dataclasses.replace(super().window(limit, t, duration), pressure=0.0)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("judged", ["refine", "knee"])
def test_a_backlog_after_a_step_judged_without_one_climbs_in_slow_start(seed, judged):
    """Slow start refined, or a knee found, while nobody waited (here a real knee at 20; then
    the backend gets a knee of 128 and a backlog): the search resumes at once and doubles,
    instead of waiting for probes and climbing in measured steps (21 windows to 96 before)."""
    lim = adaptive(floor=1)
    for t in range(60):
        drive(lim, NoBacklog(knee=20, seed=seed), 1, t0=t)
        if judged == "refine" and "refine" in lim.reason:
            break
    assert lim.limit == 20
    if judged == "knee":
        assert lim.knee == 20
    history = drive(lim, KneeModel(knee=128, seed=seed + 50), 60, t0=60)
    assert any("backlog after a step judged without one" in why for _, _, why in lim.history)
    reached = _windows_to_reach(history, 96)
    assert reached is not None and reached <= 8
    assert 96 <= sorted(history[-20:])[10] <= 216


def test_a_knee_found_with_a_backlog_is_not_searched_again_at_once():
    """The same backlog at a knee that was measured under one: only the periodic probes."""
    lim = adaptive(floor=1)
    drive(lim, KneeModel(knee=20, seed=3), 60)
    assert lim.knee is not None and 16 <= lim.knee <= 26
    drive(lim, KneeModel(knee=20, seed=4), 30, t0=60)
    assert not any("without one" in why for _, _, why in lim.history)


@pytest.mark.parametrize("waiting", [False, True])
def test_no_climb_without_requests_waiting_in_the_proxy(waiting):
    """Demand grows to exactly the held limit (at the limit all along): with nothing waiting in
    the proxy the limit only moves by the periodic probe's headroom; with waiters (more clients
    than the limit) it climbs toward the knee (200 here)."""
    lim = adaptive(floor=8)
    drive(lim, KneeModel(knee=200, seed=26, demand=20), 60)
    held = lim.limit
    model = KneeModel(knee=200, seed=27, demand=held * 10 if waiting else held)
    history = drive(lim, model, 60, t0=60)
    resumed = any("demand above" in why for _, _, why in lim.history)
    if waiting:
        assert resumed and max(history) >= 4 * held
    else:
        assert not resumed
        assert max(history) < 1.5 * held and lim.limit < 1.5 * held


@pytest.mark.parametrize("seed", [64, 65])
def test_slow_start_under_a_backlog_takes_in_what_waits_at_once(seed):
    """A surge (8 clients -> 128): the first step takes in this backend's share of the queue, up
    to 4x, instead of doubling once per measurement while the surge waits; a backlog of a few
    requests still doubles."""
    lim = adaptive(floor=1)
    drive(lim, KneeModel(knee=64, seed=seed, demand=8), 40)
    held = lim.limit
    assert held <= 12
    surge = copy.deepcopy(lim)
    drive(surge, KneeModel(knee=64, seed=seed, demand=128), 1, t0=40)
    assert surge.limit == min(4 * held, 64)
    drive(lim, KneeModel(knee=64, seed=seed, demand=held + 2), 1, t0=40)
    assert lim.limit == 2 * held


def test_a_limit_held_for_lack_of_demand_does_not_back_off_on_the_prefill_of_a_surge():
    """A surge filling a demand-held limit (requests wait in the proxy) lands in SGLang's queue
    for prefill, as after a raise: no congestion (backing off there left a surge waiting ~15 s).
    Without a backlog the same queue below the same limit is congestion: it backs off."""
    lim = adaptive(floor=1)
    drive(lim, KneeModel(knee=64, seed=66, demand=20), 40)
    held = lim.limit
    assert held > 20
    quiet = copy.deepcopy(lim)
    surge = KneeModel(knee=64, seed=67, demand=held + 10)
    lim.update(dataclasses.replace(surge.window(held, 40.0), queue_reqs=6.0, ttft=1.0))
    assert lim.limit >= held and "back off" not in lim.reason
    steady = KneeModel(knee=64, seed=67, demand=held)
    quiet.update(dataclasses.replace(steady.window(held, 40.0), queue_reqs=6.0, ttft=1.0))
    assert quiet.limit < held and "back off" in quiet.reason
