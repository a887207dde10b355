"""The simulator's engine model on a virtual clock: tokens, lengths, caps, KV pool, staleness."""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import statistics

import pytest

from loadtest.sim import tokens
from loadtest.sim.clock import VirtualClock, WallClock
from loadtest.sim.engine import DuplicateRequestError, Engine, GenRequest, TokenEvent
from loadtest.sim.profiles import PROFILE_DIR, ProfileError, load_profile
from loadtest.sim.scheduler import Scheduler, step_cost_ms

TP8 = load_profile("tp8")
PP8 = load_profile("pp8")


async def collect(stream) -> tuple[list[int], TokenEvent]:
    ids: list[int] = []
    last = None
    async for ev in stream:
        ids.extend(ev.token_ids)
        last = ev
    assert last is not None and last.finish is not None
    return ids, last


@pytest.fixture
async def make_engine():
    engines: list[Engine] = []

    async def make(profile=TP8, seed=0, clock=None) -> Engine:
        e = Engine(profile, clock or VirtualClock(), seed=seed)
        await e.start()
        engines.append(e)
        return e

    yield make
    for e in engines:
        await e.stop()


async def settle(n: int = 50) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


# --- tokens / profiles ------------------------------------------------------------------------


def test_prompt_token_rules():
    assert tokens.count_prompt_tokens("the cat  sat\non the mat") == 6
    assert tokens.count_prompt_tokens("") == 1
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    assert tokens.chat_prompt_tokens(msgs) == 4 + 2 * tokens.CHAT_TOKENS_PER_MESSAGE + 3
    parts = [{"role": "user", "content": [{"type": "text", "text": "a b c"}]}]
    assert tokens.chat_prompt_tokens(parts) == 3 + tokens.CHAT_TOKENS_PER_MESSAGE + 3
    assert tokens.token_text(0) == " the"
    assert tokens.token_text(tokens.EOS_TOKEN_ID) == ""


def test_generated_ids_deterministic_for_seed():
    a = tokens.generate_token_ids(7, "req-1", 50)
    assert a == tokens.generate_token_ids(7, "req-1", 50)
    assert a != tokens.generate_token_ids(8, "req-1", 50)
    assert a != tokens.generate_token_ids(7, "req-2", 50)
    assert a[:10] == tokens.generate_token_ids(7, "req-1", 10)
    assert all(0 <= t < len(tokens.VOCAB) for t in a)


def test_profiles_load_and_validate(tmp_path):
    for name in ("tp8", "pp8", "ep8"):
        p = load_profile(name)
        assert p.name == name and p.parallelism == name[:2]
        assert p.decode_log_interval == 40
    assert PP8.stages == 8 and PP8.num_slots == 8
    assert PP8.micro_batch_cap == max(PP8.max_running_requests // 8, 1)
    assert TP8.stages == 1 and TP8.num_slots == 1
    assert load_profile(str(PROFILE_DIR / "tp8.toml")) == TP8
    with pytest.raises(ProfileError, match="no profile 'nope'"):
        load_profile("nope")
    bad = tmp_path / "bad.toml"
    bad.write_text(
        (PROFILE_DIR / "tp8.toml")
        .read_text()
        .replace("max_running_requests = 128", "max_running_requests = 0")
    )
    with pytest.raises(ProfileError, match="max_running_requests"):
        load_profile(str(bad))
    bad.write_text("name = [")
    with pytest.raises(ProfileError, match="invalid TOML"):
        load_profile(str(bad))


def test_step_cost_grows_with_batch_and_prefill():
    for p in (TP8, PP8, load_profile("ep8")):
        costs = [step_cost_ms(p, b) for b in (1, 2, 8, 32, 128)]
        assert costs == sorted(costs) and costs[0] < costs[-1]
        assert step_cost_ms(p, 4, 1000) > step_cost_ms(p, 4, 0)


def test_tp_is_allreduce_bound_and_ep_scales_per_rank():
    ep = load_profile("ep8")
    tp_comm = TP8.num_layers * TP8.comm_ops_per_layer * TP8.comm_latency_us / 1000
    assert tp_comm > 0.5 * step_cost_ms(TP8, 1)  # fixed all-reduce latency dominates
    # EP's per-request increment is smaller than TP's: tokens are split over DP ranks
    assert step_cost_ms(ep, 128) - step_cost_ms(ep, 1) < step_cost_ms(TP8, 128) - step_cost_ms(
        TP8, 1
    )


def _token_gaps(profile, n: int = 40) -> list[float]:
    """Gaps between one lone request's tokens on the plain scheduler (each gap = one pass)."""
    times: list[float] = []
    sched = Scheduler(profile, seed=3, emit=lambda req, ids, fin: times.append(sched._now))
    sched.submit(GenRequest("r", prompt_tokens=100, max_new_tokens=n, ignore_eos=True), 0.0)
    while (t := sched.next_time()) is not None:
        sched.advance(t)
    return [b - a for a, b in itertools.pairwise(times)]


def test_no_step_noise_leaves_every_pass_at_its_step_cost():
    sched = Scheduler(TP8, seed=1)
    for b, n in ((1, 0), (7, 300), (128, 0)):
        assert sched.pass_cost_ms(b, n) == step_cost_ms(TP8, b, n)
    gaps = _token_gaps(TP8)
    assert gaps == pytest.approx([step_cost_ms(TP8, 1) / 1000] * len(gaps), rel=1e-9)


def test_step_noise_varies_passes_around_their_step_cost():
    noisy = TP8.with_overrides(step_noise=0.2)
    base = step_cost_ms(TP8, 16)
    sched = Scheduler(noisy, seed=1)
    costs = [sched.pass_cost_ms(16, 0) for _ in range(4000)]
    again = Scheduler(noisy, seed=1)  # the same seed draws the same factors
    assert [again.pass_cost_ms(16, 0) for _ in range(5)] == costs[:5]
    assert len(set(costs)) == len(costs)
    assert statistics.fmean(costs) == pytest.approx(base, rel=0.02)  # mean factor 1
    logs = [math.log(c / base) for c in costs]
    assert statistics.stdev(logs) == pytest.approx(0.2, rel=0.1)
    other = Scheduler(noisy, seed=2)
    assert [other.pass_cost_ms(16, 0) for _ in range(5)] != costs[:5]
    gaps = _token_gaps(noisy)  # the scheduler's passes take the noisy cost
    assert len(set(gaps)) == len(gaps)
    assert statistics.fmean(gaps) == pytest.approx(step_cost_ms(TP8, 1) / 1000, rel=0.15)


def test_wall_clock_scales(monkeypatch):
    t = [100.0]
    monkeypatch.setattr("loadtest.sim.clock.time.monotonic", lambda: t[0])
    c = WallClock(0.1)
    t[0] = 101.0
    assert c.now() == pytest.approx(10.0)
    assert c.to_wall(10.0) == pytest.approx(101.0)
    with pytest.raises(ValueError):
        WallClock(0)


async def test_virtual_clock_orders_sleeps():
    clock = VirtualClock()
    order: list[tuple[str, float]] = []

    async def sleeper(name: str, d: float) -> None:
        await clock.sleep(d)
        order.append((name, clock.now()))

    await asyncio.gather(sleeper("b", 2.0), sleeper("a", 1.0), sleeper("c", 2.0))
    assert order == [("a", 1.0), ("b", 2.0), ("c", 2.0)]


# --- token counts and lengths -----------------------------------------------------------------


async def test_ignore_eos_gives_exact_token_count(make_engine):
    e = await make_engine()
    ids, last = await collect(e.submit(GenRequest("r1", 100, 37, ignore_eos=True)))
    assert len(ids) == 37
    assert last.finish.type == "length" and last.finish.length == 37
    c = e.counters
    assert (c.requests_total, c.generation_tokens_total, c.prompt_tokens_total) == (1, 37, 100)


async def test_max_new_tokens_zero_finishes_after_prefill(make_engine):
    e = await make_engine()
    ids, last = await collect(e.submit(GenRequest("r0", 10, 0, ignore_eos=True)))
    assert ids == [] and last.finish.type == "length" and last.finish.length == 0


async def test_natural_lengths_follow_profile_and_are_deterministic(make_engine):
    p = TP8.with_overrides(output_len_median=40.0, output_len_sigma=0.5)
    runs = []
    for seed in (3, 3, 4):
        e = await make_engine(p, seed=seed)
        streams = [e.submit(GenRequest(f"q{i}", 20, 10_000)) for i in range(60)]
        results = await asyncio.gather(*(collect(s) for s in streams))
        runs.append([(ids, last.finish) for ids, last in results])
    assert runs[0] == runs[1]  # same seed: same lengths and same tokens
    assert runs[0] != runs[2]
    lengths = [len(ids) for ids, _ in runs[0]]
    assert 30 <= statistics.median(lengths) <= 53  # log-normal median 40
    assert len(set(lengths)) > 20
    for ids, fin in runs[0]:
        assert fin.type == "stop" and fin.matched == tokens.EOS_TOKEN_ID and ids[-1] == fin.matched


async def test_natural_length_capped_by_max_new_tokens(make_engine):
    e = await make_engine(TP8.with_overrides(output_len_median=1000.0, output_len_sigma=0.0))
    ids, last = await collect(e.submit(GenRequest("r", 5, 12)))
    assert len(ids) == 12 and last.finish.type == "length"


async def test_same_seed_key_gives_same_text(make_engine):
    e = await make_engine()
    a, _ = await collect(e.submit(GenRequest("x1", 5, 20, ignore_eos=True, seed_key="prompt")))
    b, _ = await collect(e.submit(GenRequest("x2", 5, 20, ignore_eos=True, seed_key="prompt")))
    assert a == b == tokens.generate_token_ids(0, "prompt", 20)


# --- capacity: running cap, KV pool, retraction ----------------------------------------------


async def test_max_running_requests_caps_and_queues(make_engine):
    e = await make_engine(TP8.with_overrides(max_running_requests=3))
    streams = [e.submit(GenRequest(f"r{i}", 10, 20, ignore_eos=True)) for i in range(5)]
    await e.clock.sleep(0.2)
    s = e.live_stats()
    assert (s.num_running_reqs, s.num_queue_reqs) == (3, 2)
    results = await asyncio.gather(*(collect(st) for st in streams))
    assert all(len(ids) == 20 for ids, _ in results)
    assert e.live_stats().num_running_reqs == 0


async def test_full_kv_pool_queues_new_requests(make_engine):
    # room for two 400-token prompts, not three
    p = TP8.with_overrides(max_total_tokens=1000, new_token_ratio=0.0)
    e = await make_engine(p)
    streams = [e.submit(GenRequest(f"r{i}", 400, 50, ignore_eos=True)) for i in range(3)]
    await e.clock.sleep(0.2)
    s = e.live_stats()
    assert (s.num_running_reqs, s.num_queue_reqs) == (2, 1)
    assert s.num_used_tokens > 800 and s.token_usage == pytest.approx(s.num_used_tokens / 1000)
    results = await asyncio.gather(*(collect(st) for st in streams))
    assert [len(ids) for ids, _ in results] == [50, 50, 50]


async def test_decode_outgrowing_pool_retracts_and_requeues(make_engine):
    # two 300-token prompts admitted; both decoding 300 tokens outgrows a 1000-token pool
    p = TP8.with_overrides(max_total_tokens=1000, new_token_ratio=0.0)
    e = await make_engine(p)
    streams = [e.submit(GenRequest(f"r{i}", 300, 300, ignore_eos=True)) for i in range(2)]
    results = await asyncio.gather(*(collect(st) for st in streams))
    assert [len(ids) for ids, _ in results] == [300, 300]  # tokens already sent are kept
    assert [ids for ids, _ in results] == [
        tokens.generate_token_ids(0, f"r{i}", 300) for i in range(2)
    ]
    assert e.counters.retractions_total >= 1
    assert sum(s.num_retractions for s in streams) == e.counters.retractions_total
    assert e.live_stats().num_used_tokens == 0


def test_retraction_picks_least_advanced_and_wastes_kv():
    p = TP8.with_overrides(max_total_tokens=1000, new_token_ratio=0.0)
    s = Scheduler(p)
    s.submit(GenRequest("old", 300, 400, ignore_eos=True), 0.0)
    t = 0.0
    for _ in range(20):  # "old" gets ahead
        t = s.next_time()
        s.advance(t)
    s.submit(GenRequest("new", 300, 400, ignore_eos=True), t)
    while s.counters.retractions_total == 0:
        t = s.next_time()
        s.advance(t)
    assert [r.rid for r in s.waiting] == ["new"]
    assert s.used_tokens == s.reqs["old"].kv  # the retracted request's KV was dropped


async def test_abort_frees_slot_and_kv(make_engine):
    e = await make_engine()
    stream = e.submit(GenRequest("victim", 500, 1000, ignore_eos=True))
    other = e.submit(GenRequest("other", 500, 30, ignore_eos=True))
    await e.clock.sleep(0.5)
    assert e.live_stats().num_running_reqs == 2
    assert e.abort("victim") is True
    s = e.live_stats()
    assert s.num_running_reqs == 1 and s.num_used_tokens == e.scheduler.reqs["other"].kv
    ids, last = await collect(stream)
    assert last.finish.type == "abort" and 0 < len(ids) < 1000
    assert e.abort("victim") is False and e.abort("never") is False
    await collect(other)
    assert e.live_stats().num_used_tokens == 0
    assert e.counters.aborted_total == 1


async def test_abort_waiting_and_abort_all(make_engine):
    e = await make_engine(TP8.with_overrides(max_running_requests=1))
    a = e.submit(GenRequest("a", 10, 100, ignore_eos=True))
    b = e.submit(GenRequest("b", 10, 100, ignore_eos=True))
    await e.clock.sleep(0.1)
    assert e.live_stats().num_queue_reqs == 1
    assert e.abort("b")
    assert e.live_stats().num_queue_reqs == 0
    _, lb = await collect(b)
    assert lb.finish.type == "abort"
    assert e.abort_all() == 1
    _, la = await collect(a)
    assert la.finish.type == "abort" and e.live_stats().num_running_reqs == 0


async def test_stop_ends_live_streams(make_engine):
    e = await make_engine()
    s = e.submit(GenRequest("r", 10, 10_000, ignore_eos=True))
    await e.clock.sleep(0.2)
    await e.stop()
    _, last = await collect(s)
    assert last.finish.type == "abort" and last.finish.status_code == 503


async def test_prompt_larger_than_pool_rejected(make_engine):
    e = await make_engine(TP8.with_overrides(max_total_tokens=100))
    _, last = await collect(e.submit(GenRequest("big", 200, 5)))
    assert last.finish.type == "abort" and last.finish.status_code == 400


# --- pipeline parallelism ---------------------------------------------------------------------


def test_pp_requests_keep_their_slot_and_respect_micro_batch_cap():
    s = Scheduler(PP8)
    cap = PP8.micro_batch_cap
    for i in range(cap + 3):
        s.submit(GenRequest(f"r{i}", 10, 50, ignore_eos=True), 0.0)
    s.advance(0.0)
    seen: dict[str, int] = {}
    t = 0.0
    for _ in range(200):
        t = s.next_time()
        if t is None:
            break
        s.advance(t)
        for m, slot in enumerate(s.slots):
            assert len(slot) <= cap
            for r in slot:
                assert seen.setdefault(r.rid, m) == m  # a request keeps its slot for life
    assert len(set(seen.values())) == 2  # cap in one micro-batch, the rest in the next


async def test_pp_single_request_advances_once_per_loop(make_engine):
    e = await make_engine(PP8)
    s = e.submit(GenRequest("r", 10, 11, ignore_eos=True))
    await collect(s)
    loop = (s.t_last - s.t_first) / 10
    stage = step_cost_ms(PP8, 1) / 1000 / PP8.stages
    hop = (PP8.p2p_latency_ms + PP8.p2p_us_per_token / 1000) / 1000
    assert loop == pytest.approx(PP8.stages * (stage + hop))


# --- stats: live vs logged (stale) ------------------------------------------------------------


async def test_logged_stats_stale_live_stats_current(make_engine):
    p = TP8.with_overrides(decode_log_interval=1000)  # only prefill batches log here
    e = await make_engine(p)
    assert e.logged_stats().num_running_reqs == 0
    a = e.submit(GenRequest("a", 10, 100, ignore_eos=True))
    await settle()
    # a prefill batch logs the running batch without the requests it prefills (SGLang's
    # running_bs), and the KV tokens in use
    logged = e.logged_stats()
    assert logged.num_running_reqs == 0 and logged.num_used_tokens == 11
    await e.clock.sleep(1.0)
    b = e.submit(GenRequest("b", 10, 400, ignore_eos=True))
    await e.clock.sleep(step_cost_ms(p, 1) / 1000 * 1.5)
    logged = e.logged_stats()  # b's prefill batch: a was running
    assert logged.num_running_reqs == 1
    at_b = logged.num_used_tokens
    await collect(a)
    await e.clock.sleep(1.0)
    live, logged = e.live_stats(), e.logged_stats()
    assert live.num_running_reqs == 1 and logged.num_used_tokens == at_b  # stale
    assert live.num_used_tokens != at_b and logged.time < live.time
    await collect(b)
    await e.clock.sleep(5.0)  # idle: live goes to zero, logged keeps its last value
    live, logged = e.live_stats(), e.logged_stats()
    assert live.num_running_reqs == 0 and live.num_used_tokens == 0
    assert logged.num_running_reqs == 1 and logged.num_used_tokens == at_b


async def test_pp_logged_running_is_the_micro_batch():
    """Under PP, SGLang's num_running_reqs gauge shows the micro-batch being scheduled."""
    p = PP8.with_overrides(decode_log_interval=1)
    s = Scheduler(p)
    for i in range(3 * p.micro_batch_cap):
        s.submit(GenRequest(f"r{i}", 10, 50, ignore_eos=True), 0.0)
    while s.counters.decode_steps_total < 10:
        s.advance(s.next_time())
    assert s.live_stats().num_running_reqs == 3 * p.micro_batch_cap
    assert s.logged_stats().num_running_reqs == p.micro_batch_cap


async def test_logged_refresh_every_decode_log_interval():
    p = TP8.with_overrides(decode_log_interval=40)
    s = Scheduler(p)
    s.submit(GenRequest("r", 10, 500, ignore_eos=True), 0.0)
    log_times = set()
    t = 0.0
    while s.counters.decode_steps_total < 200:
        t = s.next_time()
        s.advance(t)
        log_times.add(s.logged_stats().time)
    # the prefill + one log per 40 decode steps
    assert len(log_times) == 1 + 200 // 40
    logged = s.logged_stats()
    assert logged.num_running_reqs == 1 and logged.gen_throughput > 0
    assert logged.num_used_tokens == 10 + 1 + 200  # prompt, first token, 200 decode passes


async def test_idle_engine_does_not_spin(make_engine):
    clock = VirtualClock()
    engines = [await make_engine(TP8, clock=clock) for _ in range(3)]
    await collect(engines[0].submit(GenRequest("r", 10, 5, ignore_eos=True)))
    t = clock.now()
    await settle(200)
    assert clock.now() == t  # nobody sleeps: every engine waits for a submit
    assert not clock._heap
    ids, _ = await collect(engines[2].submit(GenRequest("r", 10, 5, ignore_eos=True)))
    assert len(ids) == 5


async def test_engine_matches_pure_scheduler_timing(make_engine):
    """The async engine on a virtual clock reproduces the synchronous scheduler's times."""
    e = await make_engine(PP8)
    streams = [e.submit(GenRequest(f"r{i}", 64, 30, ignore_eos=True)) for i in range(12)]
    await asyncio.gather(*(collect(s) for s in streams))
    ref = Scheduler(PP8)
    done = {}
    ref.emit = lambda req, ids, fin: done.setdefault(req.rid, req) if fin else None
    for i in range(12):
        ref.submit(GenRequest(f"r{i}", 64, 30, ignore_eos=True), 0.0)
    while (t := ref.next_time()) is not None:
        ref.advance(t)
    for s in streams:
        assert s.t_first == pytest.approx(done[s.rid].t_first)
        assert s.t_last == pytest.approx(done[s.rid].t_last)


async def test_get_load_rows_per_dp_rank(make_engine):
    e = await make_engine(load_profile("ep8"))
    rows = e.get_load()
    assert [r["dp_rank"] for r in rows] == list(range(8))
    assert set(rows[0]) == {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"}


async def test_duplicate_live_rid_rejected(make_engine):
    e = await make_engine()
    s = e.submit(GenRequest("dup", 10, 5, ignore_eos=True))
    with pytest.raises(DuplicateRequestError):
        e.submit(GenRequest("dup", 10, 5, ignore_eos=True))
    ids, _ = await collect(s)
    assert len(ids) == 5
    ids, _ = await collect(e.submit(GenRequest("dup", 10, 3, ignore_eos=True)))  # finished: ok
    assert len(ids) == 3


async def test_wall_clock_engine_runs_scaled(make_engine):
    """The same engine on a (very fast) wall clock: exact tokens, several engines at once."""
    engines = [await make_engine(load_profile(n), clock=WallClock(0.001)) for n in ("tp8", "pp8")]
    streams = [
        e.submit(GenRequest(f"w{i}", 50, 40, ignore_eos=True)) for e in engines for i in range(6)
    ]
    results = await asyncio.wait_for(asyncio.gather(*(collect(s) for s in streams)), 30)
    assert all(len(ids) == 40 and last.finish.type == "length" for ids, last in results)
    assert all(e.live_stats().num_running_reqs == 0 for e in engines)


@pytest.mark.parametrize("profile", [TP8, PP8], ids=["tp8", "pp8"])
def test_invariants_under_random_load(profile):
    """Random submits/aborts on a tight pool: KV accounting never drifts or overflows, every
    request ends exactly once, ignore_eos requests get exactly max_new_tokens."""
    p = profile.with_overrides(max_total_tokens=3000, new_token_ratio=0.1, chunked_prefill_size=512)
    rng = random.Random(1)
    got: dict[str, int] = {}
    finishes: dict[str, str] = {}

    def emit(req, ids, fin):
        assert req.rid not in finishes
        got[req.rid] = got.get(req.rid, 0) + len(ids)
        if fin is not None:
            finishes[req.rid] = fin.type

    s = Scheduler(p, seed=2, emit=emit)
    wanted: dict[str, int] = {}
    t = 0.0
    for i in range(400):
        if rng.random() < 0.5:
            rid = f"r{i}"
            wanted[rid] = rng.randint(0, 300)
            s.submit(GenRequest(rid, rng.randint(1, 1500), wanted[rid], ignore_eos=True), t)
        if rng.random() < 0.05 and s.reqs:
            s.abort(rng.choice(sorted(s.reqs)))
        nt = s.next_time()
        t = nt if nt is not None else t + 0.1
        s.advance(t)
        running = [q for slot in s.slots for q in slot]
        assert s.used_tokens == sum(q.kv for q in running) <= p.max_total_tokens
        assert s.num_running == len(running) <= p.max_running_requests
        assert all(len(slot) <= s.cap for slot in s.slots)
    while (nt := s.next_time()) is not None:
        s.advance(nt)
    assert s.used_tokens == 0 and not s.reqs
    assert set(finishes) == set(wanted)
    for rid, n in wanted.items():
        if finishes[rid] == "length":
            assert got[rid] == n
        else:
            assert finishes[rid] == "abort" and got[rid] <= n
    assert s.counters.retractions_total > 0  # the pool was tight enough to exercise retraction


async def test_virtual_clock_cancelled_sleep_does_not_move_time():
    clock = VirtualClock()
    long = asyncio.ensure_future(clock.sleep(100.0))
    await asyncio.sleep(0)
    long.cancel()
    await clock.sleep(1.0)
    assert clock.now() == 1.0
    await asyncio.sleep(0)
    for _ in range(50):
        await asyncio.sleep(0)
    assert clock.now() == 1.0


@pytest.mark.parametrize("profile", [TP8, PP8], ids=["tp8", "pp8"])
async def test_engine_matches_scheduler_with_staggered_submits(profile, make_engine):
    """Submits that arrive while the engine sleeps (early wake-ups) keep exact timing."""
    gaps = [0.0, 0.013, 0.2, 0.0, 0.37, 1.1, 0.05, 0.9, 0.0, 2.5]
    e = await make_engine(profile)
    streams = []
    for i, gap in enumerate(gaps):
        if gap:
            await e.clock.sleep(gap)
        streams.append(e.submit(GenRequest(f"r{i}", 200 + 50 * i, 20 + 3 * i, ignore_eos=True)))
    await asyncio.gather(*(collect(s) for s in streams))
    ref = Scheduler(profile)
    done = {}
    ref.emit = lambda req, ids, fin: done.setdefault(req.rid, req) if fin else None
    t = 0.0
    for i, gap in enumerate(gaps):
        t += gap
        ref.advance(t)
        ref.submit(GenRequest(f"r{i}", 200 + 50 * i, 20 + 3 * i, ignore_eos=True), t)
        ref.advance(t)
    while (nt := ref.next_time()) is not None:
        ref.advance(nt)
    for s in streams:
        assert s.t_arrival == pytest.approx(done[s.rid].arrival)
        assert s.t_first == pytest.approx(done[s.rid].t_first)
        assert s.t_last == pytest.approx(done[s.rid].t_last)


def test_long_run_keeps_bounded_state():
    """Hours of modelled time do not grow the scheduler's bookkeeping."""
    s = Scheduler(TP8)
    n = 0

    def resubmit(req, ids, fin):
        nonlocal n
        if fin is not None:
            n += 1
            s.submit(GenRequest(f"r{n}", 100, 50, ignore_eos=True), s._now)

    s.emit = resubmit
    for i in range(8):
        s.submit(GenRequest(f"first{i}", 100, 50, ignore_eos=True), 0.0)
    while s._now < 600.0:
        s.advance(s.next_time())
    assert n > 1000
    assert len(s._recent) < 100 and len(s._passes) <= 1 and len(s.reqs) == 8
