"""Prefix routing (proxy/prefix.py) with numbers alone: the routing text and its chained blocks,
the index (match, learning, LRU eviction, measured memory), the choice (affinity when load
allows, a hot prefix spread under bounded load, rendezvous shared by replicas, unique prompts
as the latency policy routes them), trust corrected by reported cached tokens, and the queue's
lookahead (a freed slot pulls the waiter its backend's cache fits, never past the age bound)."""

from __future__ import annotations

import asyncio
import gc
import tracemalloc
from collections import Counter

import pytest
from adapt_fakes import FakeBackend, FakeClock

from proxy.admission import Admission
from proxy.policies import Latency, RoutingSettings, make_policy, make_prefix_routing
from proxy.prefix import (
    ENTRY_BYTES,
    HOME_SHARE,
    PrefixIndex,
    PrefixRouting,
    prompt_of,
    routing_text,
)

BLOCK = 64
SYSTEM = "You are a careful assistant. " * 20  # ~580 chars: 9 blocks shared by a group


def chat(*turns: tuple[str, str]) -> dict:
    return {"messages": [{"role": r, "content": c} for r, c in turns]}


def group(system: str, question: str) -> dict:
    return chat(("system", system), ("user", question))


def measured(name, clock, *, ttft=0.5, itl=0.02, limit=32, in_flight=0):
    b = FakeBackend(name, limit, clock=clock)
    b.stats.observe_ttft(ttft)
    b.stats.observe_itl(itl, 10)
    b.stats.observe_completion(True, output_tokens=100)
    b.in_flight = in_flight
    return b


def routing(**kw) -> PrefixRouting:
    kw.setdefault("block_chars", BLOCK)
    index = kw.pop("index", None) or PrefixIndex(kw.pop("max_bytes", 1 << 20))
    return PrefixRouting(index, Latency(), **kw)


def bind(r: PrefixRouting, backends, obj) -> str:
    """What admission does at a bind: pick among those with a free slot, learn, in_flight += 1."""
    p = prompt_of(obj, r.block_chars)
    assert p is not None
    free = [b for b in backends if b.in_flight < b.limit.limit]
    b, blocks = r.pick(free, p, backends)
    r.learn(b, p, blocks, backends)
    b.in_flight += 1
    return b.name


# ---- the routing text and its blocks ---------------------------------------------------------


def test_routing_text_covers_every_prompt_shape():
    assert routing_text(chat(("user", "hi"))) == b"user\nhi\n"
    assert routing_text({"system": "s", "messages": [{"role": "user", "content": "q"}]}) == (
        b"system\ns\nuser\nq\n"
    )
    parts = [{"type": "text", "text": "look"}]
    assert routing_text(chat(("user", parts))) == b'user\n[{"type":"text","text":"look"}]\n'
    assert routing_text({"prompt": "p"}) == b"p"
    assert routing_text({"text": "t"}) == b"t"
    assert routing_text({"input_ids": [1, 2, 3]}) == b"[1,2,3]"
    assert routing_text({"model": "m"}) == b""


def test_blocks_are_chained_so_a_conversation_extends_its_history():
    first = chat(("system", SYSTEM), ("user", "What is a radix tree?"))
    second = chat(
        ("system", SYSTEM),
        ("user", "What is a radix tree?"),
        ("assistant", "A compressed trie. " * 10),
        ("user", "And its cost?"),
    )
    a, b = prompt_of(first, BLOCK), prompt_of(second, BLOCK)
    assert a is not None and b is not None
    assert len(a.hashes) == len(routing_text(first)) // BLOCK
    assert b.hashes[: len(a.hashes)] == a.hashes  # the history's blocks, unchanged
    other = prompt_of(chat(("system", "x" + SYSTEM[1:]), ("user", "What is a radix tree?")), BLOCK)
    assert other is not None and not set(other.hashes) & set(a.hashes)  # chained: all differ
    assert prompt_of(chat(("user", "short")), BLOCK) is None  # no whole block: no key


# ---- the index --------------------------------------------------------------------------------


def test_index_matches_the_leading_blocks_each_backend_was_sent():
    idx = PrefixIndex(1 << 20)
    a = prompt_of(group(SYSTEM, "first question, unique " * 4), BLOCK)
    b = prompt_of(group(SYSTEM, "another question here " * 4), BLOCK)
    idx.learn("A", a)
    got = idx.matches(b, ["A", "B"])
    shared = len(routing_text(group(SYSTEM, ""))) // BLOCK
    assert set(got) == {"A"} and shared - 1 <= got["A"] <= shared
    assert idx.matches(a, ["A"]) == {"A": len(a.hashes)}
    idx.learn("B", b)
    assert idx.matches(b, ["A", "B"]) == {"A": got["A"], "B": len(b.hashes)}


def test_index_is_lru_bounded_and_evicts_tails_before_leading_blocks():
    idx = PrefixIndex(ENTRY_BYTES * 50)
    assert idx.max_entries == 50
    old = prompt_of({"prompt": "o" * (BLOCK * 20)}, BLOCK)
    idx.learn("A", old)
    for i in range(3):
        idx.learn("A", prompt_of({"prompt": f"{i}" * (BLOCK * 15)}, BLOCK))
    assert idx.entries == 50 and idx.evicted == 20 + 3 * 15 - 50
    # what is left of the old prompt is its leading blocks (touched last when learnt)
    assert idx.matched(old, "A") == 5
    assert idx.bytes == 50 * ENTRY_BYTES


@pytest.mark.parametrize("cap_mib", [1, 3, 5, 20])
def test_index_memory_measured_stays_within_its_cap(cap_mib):
    cap = cap_mib * 1024 * 1024
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    idx = PrefixIndex(cap)
    for i in range(2 * idx.max_entries // 12):  # twice what it holds, 12 blocks a prompt
        idx.learn(f"b{i % 8}", prompt_of({"prompt": f"{i:08d}" * 200}, 128))
    gc.collect()
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    used = sum(s.size_diff for s in after.compare_to(before, "filename"))
    assert idx.entries == idx.max_entries and idx.bytes <= cap
    snap = idx.snapshot()  # the home map (one entry per prompt here) is bounded too
    assert snap["home_entries"] == snap["home_max"] == idx.max_entries // HOME_SHARE
    assert used <= cap, f"{used} bytes measured for a cap of {cap}"
    assert used >= 0.5 * cap  # ENTRY_BYTES is no wild overestimate either


# ---- the choice -------------------------------------------------------------------------------


def test_a_shared_prefix_goes_to_the_backend_that_has_it_when_load_allows():
    clock = FakeClock()
    fleet = [measured(n, clock, in_flight=12) for n in "ABCD"]
    r = routing()
    home = bind(r, fleet, group(SYSTEM, "question zero, with some words " * 2))
    picks = [bind(r, fleet, group(SYSTEM, f"question {i}, with words " * 3)) for i in range(3)]
    assert picks == [home] * 3
    # predicted hit rate: the group's share of each later prompt
    bp = r.index.backends[home]
    assert 0.5 < bp.matched_chars / bp.prompt_chars < 1.0


def test_a_hot_prefix_spreads_under_bounded_load():
    clock = FakeClock()
    fleet = [measured(n, clock) for n in "ABCD"]
    r = routing(load_factor=1.25)
    picks = [bind(r, fleet, group(SYSTEM, f"hot question {i} " * 4)) for i in range(40)]
    loads = Counter(picks)
    assert set(loads) == set("ABCD")
    assert max(loads.values()) <= -(-1.25 * 40 // 4)  # ceil(1.25 x average)
    # and once spread, each copy keeps attracting the group while its load allows
    assert all(r.index.matched(prompt_of(group(SYSTEM, ""), BLOCK), n) for n in "ABCD")


def test_replicas_that_share_nothing_agree_on_a_cold_prefix():
    clock = FakeClock()
    systems = [f"System prompt of tenant {g}. " * 12 for g in range(40)]
    one, two = routing(), routing()
    fleet1 = [measured(n, clock) for n in "ABCD"]
    fleet2 = [measured(n, clock) for n in "DCBA"]  # listed in another order
    first = [bind(one, fleet1, group(s, "hello there, a question " * 3)) for s in systems]
    for b in fleet1 + fleet2:
        b.in_flight = 0
    second = [bind(two, fleet2, group(s, "another question entirely " * 3)) for s in systems]
    assert first == second
    assert len(set(first)) == 4  # and the groups spread over the fleet


def test_new_groups_land_evenly_on_the_least_loaded():
    """No backend holds a new group: only load tells the candidates apart, so groups bound one
    after another spread evenly (a hash alone would spread 40 groups over 4 unevenly)."""
    clock = FakeClock()
    fleet = [measured(n, clock) for n in "ABCD"]
    fleet[0].in_flight = 3  # already busier: it takes a new group only once the others are
    r = routing()
    for g in range(40):
        bind(r, fleet, group(f"System prompt of tenant {g}. " * 12, "a question " * 3))
    assert sorted(b.in_flight for b in fleet) == [10, 11, 11, 11]  # 43 in flight, evenly


def test_an_idle_fleet_spreads_new_groups_by_their_hash_whatever_the_limits():
    """Groups arriving one at a time find every backend idle: the backend whose limit happens
    to be largest must not take them all (the cache of the others would stay empty)."""
    clock = FakeClock()
    systems = [f"System prompt of tenant {g}. " * 12 for g in range(12)]
    placed = []
    for limits in ((32, 32, 32), (8, 64, 16)):
        fleet = [measured(n, clock, limit=lim) for n, lim in zip("ABC", limits, strict=True)]
        r = routing()
        picks = []
        for s in systems:
            picks.append(bind(r, fleet, group(s, "a question " * 3)))
            for b in fleet:
                b.in_flight = 0  # the request finished before the next group arrives
        placed.append(picks)
    assert placed[0] == placed[1]  # the limits do not decide; the hash does
    assert len(set(placed[1])) == 3


def test_unique_prompts_route_as_the_latency_policy_does():
    clock = FakeClock()
    fast = measured("fast", clock, ttft=0.1, itl=0.01)
    slow = measured("slow", clock, ttft=1.0, itl=0.05)
    r, latency = routing(), Latency()
    for i in range(20):
        p = prompt_of({"prompt": f"unique prompt number {i} " * 10}, BLOCK)
        b, blocks = r.pick([fast, slow], p, [fast, slow])
        assert b is latency.pick([fast, slow]) and blocks == 0


def test_a_prefix_held_by_a_slower_backend_loses_to_a_much_faster_one():
    clock = FakeClock()
    fast = measured("fast", clock, ttft=0.2, itl=0.01)
    slow = measured("slow", clock, ttft=0.4, itl=0.05)
    r = routing()
    p = prompt_of(group(SYSTEM, "question " * 10), BLOCK)
    r.learn(slow, p, 0, [fast, slow])
    b, blocks = r.pick([fast, slow], p, [fast, slow])
    assert b is fast and blocks == 0  # prefill saved (0.4 s) < decoding slower (4 s)


def test_a_busy_backend_holding_the_prefix_wins_the_prefill_it_spares_its_batch():
    """Alone, the hit saves less than the busier backend's extra wait; but the prefill it
    skips would have stalled the 20 requests it runs: it keeps the prefix."""
    clock = FakeClock()
    held = measured("held", clock, ttft=0.5, itl=0.03, in_flight=20)
    idle = measured("idle", clock, ttft=0.5, itl=0.02, in_flight=12)
    r = routing(load_factor=2.0)
    p = prompt_of(group(SYSTEM, "question " * 10), BLOCK)
    r.learn(held, p, 0, [held, idle])
    latency = Latency()
    out = latency.mean_output([held, idle])
    alone = latency.expected_completion(held, out, p.fraction(r.index.matched(p, "held")))
    assert alone > latency.expected_completion(idle, out) * 1.1  # loses on this request alone
    assert r.pick([held, idle], p, [held, idle])[0] is held


def test_a_prefix_stays_at_its_home_when_its_overflow_leaves_copies():
    """A group's home is where it was placed. Its overflow (the home full) leaves a copy
    elsewhere, which takes overflow again, but the group goes back to its home once it has
    room: an overflow does not move it. Only a backend that can no longer take it at all (not
    routable) hands the home to a copy."""
    clock = FakeClock()
    fleet = [measured(n, clock, limit=16, in_flight=8) for n in "ABCD"]
    r = routing()
    p = prompt_of(group(SYSTEM, "question " * 10), BLOCK)
    home = fleet[[b.name for b in fleet].index(bind(r, fleet, group(SYSTEM, "first " * 10)))]
    assert r.home(p, fleet) is home and r.index.away == 0
    home.in_flight = home.limit.limit  # full: the next one overflows
    copy = bind(r, fleet, group(SYSTEM, "second " * 10))
    assert copy != home.name and r.index.away == 1
    assert r.home(p, fleet) is home  # a copy, not a move
    home.in_flight = 8
    assert bind(r, fleet, group(SYSTEM, "third " * 10)) == home.name
    home.in_flight = home.limit.limit  # full again: the overflow goes to the copy, a hit
    assert bind(r, fleet, group(SYSTEM, "fourth " * 10)) == copy
    assert r.home(p, fleet) is home and r.index.away == 2
    home.routable = False  # down: the copy is where the group lives now
    assert r.home(p, fleet).name == copy
    assert bind(r, fleet, group(SYSTEM, "fifth " * 10)) == copy
    home.routable, home.in_flight = True, 8  # back: the group stays where it went on
    assert r.home(p, fleet).name == copy
    assert bind(r, fleet, group(SYSTEM, "sixth " * 10)) == copy


def test_copies_none_of_which_is_home_spread_by_the_prefix_hash():
    """Equal copies of unknown age (no home among them): rendezvous hashing of the leading
    block chooses, so groups spread over the copies rather than onto one backend."""
    clock = FakeClock()
    backends = [measured(f"b{i}", clock) for i in range(4)]
    picks = Counter()
    for g in range(20):
        r = routing()
        p = prompt_of(group(f"{g} " + SYSTEM, "question " * 10), BLOCK)
        for b in backends:
            r.index.learn(b.name, p, home=False)
        chosen = r.pick(backends, p, backends)[0]
        assert all(r.pick(backends, p, backends)[0] is chosen for _ in range(5))
        picks[chosen.name] += 1
    assert len(picks) == 4


def test_stale_claims_lose_their_weight_when_the_backend_reports_fewer_cached_tokens():
    clock = FakeClock()
    a, b = measured("A", clock), measured("B", clock)
    r = routing()
    p = prompt_of(group(SYSTEM, "a question " * 5), BLOCK)
    r.learn(a, p, 0, [a, b])
    r.learn(b, p, 0, [a, b])  # both were sent it; A's copy is gone (evicted, flushed)
    predicted = p.fraction(r.index.matched(p, "A"))
    for _ in range(10):
        r.report("A", predicted, 200, 0)
        r.report("B", predicted, 200, int(200 * predicted))
    assert r.index.trust("A") < 0.2 and r.index.trust("B") > 0.99
    assert r.index.backends["A"].stale == 10
    assert all(r.pick([a, b], p, [a, b])[0] is b for _ in range(5))
    for _ in range(20):  # A holds it again: its reports restore its claims
        r.report("A", predicted, 200, int(200 * predicted))
    assert r.index.trust("A") > 0.9


def test_prefix_routing_is_built_for_the_latency_policy_only():
    on = RoutingSettings()
    assert make_prefix_routing(on, make_policy(on)) is not None
    off = RoutingSettings(prefix_affinity=False)
    assert make_prefix_routing(off, make_policy(off)) is None
    rr = RoutingSettings(policy="round_robin")
    assert make_prefix_routing(rr, make_policy(rr)) is None


# ---- the queue's lookahead -------------------------------------------------------------------


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


def queue_of(fleet, clock, **kw) -> Admission:
    r = routing(**kw)
    return Admission(fleet, r.estimate, prefix=r, clock=clock, max_queue=100)  # type: ignore[arg-type]


async def test_a_freed_slot_pulls_the_waiter_its_cache_fits():
    clock = FakeClock()
    a, b = measured("A", clock, limit=1), measured("B", clock, limit=1)
    adm = queue_of([a, b], clock, lookahead=4, lookahead_age_s=5.0)
    other = "Another tenant's system prompt. " * 20
    pa = adm.prefix.prompt(group(SYSTEM, "first " * 20))
    pb = adm.prefix.prompt(group(other, "first " * 20))
    la = await adm.acquire(prompt=pa)
    lb = await adm.acquire(prompt=pb)
    assert {la.backend.name, lb.backend.name} == {"A", "B"}
    home_a = la.backend
    head = asyncio.create_task(adm.acquire(prompt=adm.prefix.prompt(group(other, "q " * 30))))
    await settle()
    clock.advance(0.1)
    fits = asyncio.create_task(adm.acquire(prompt=adm.prefix.prompt(group(SYSTEM, "q " * 30))))
    await settle()
    la.release()  # A frees: it takes the later waiter whose prefix it holds, not the head
    await settle()
    assert fits.done() and not head.done()
    assert fits.result().backend is home_a and fits.result().predicted > 0.5
    lb.release()
    await settle()
    assert head.done() and head.result().backend is lb.backend  # the head's own prefix home
    fits.result().release()
    head.result().release()


async def full_home(clock, *, spread: bool = False, age: float | None = 0.5):
    """Two backends of limit 8: SYSTEM's home full (8 running), the other with 4 and a free
    slot (holding SYSTEM too when ``spread``). (admission, home, elsewhere)"""
    a, b = measured("A", clock, limit=8), measured("B", clock, limit=8)
    adm = queue_of([a, b], clock, lookahead=4, lookahead_age_s=age, load_factor=2.0)
    first = await adm.acquire(prompt=adm.prefix.prompt(group(SYSTEM, "first " * 20)))
    home = first.backend
    elsewhere = b if home is a else a
    if spread:
        adm.prefix.index.learn(elsewhere.name, adm.prefix.prompt(group(SYSTEM, "other " * 20)))
    home.in_flight, elsewhere.in_flight = 8, 4
    return adm, home, elsewhere


async def test_a_request_waits_for_its_full_home_when_a_miss_elsewhere_costs_more():
    """E2E 2.5 s: the full home (8 running) frees a slot every ~0.3 s; a miss on the other
    backend (4 running) costs ~0.45 s of prefill for it and each of them: worth waiting."""
    clock = FakeClock()
    adm, home, elsewhere = await full_home(clock)
    again = asyncio.create_task(adm.acquire(prompt=adm.prefix.prompt(group(SYSTEM, "q " * 30))))
    await settle()
    assert not again.done()  # a slot is free on the other backend, yet it waits
    home.in_flight -= 1
    adm.wake()
    await settle()
    assert again.done() and again.result().backend is home
    # past the age bound it takes the free slot instead
    late = asyncio.create_task(adm.acquire(prompt=adm.prefix.prompt(group(SYSTEM, "z " * 30))))
    await settle()
    assert not late.done()
    clock.advance(0.6)
    adm.wake()
    await settle()
    assert late.done() and late.result().backend is elsewhere


async def test_a_request_stops_holding_out_for_its_home_once_lookahead_per_backend_went_first():
    clock = FakeClock()
    adm, _, elsewhere = await full_home(clock, age=None)
    again = asyncio.create_task(adm.acquire(prompt=adm.prefix.prompt(group(SYSTEM, "q " * 30))))
    await settle()
    bound = adm.prefix.lookahead * 2  # two backends
    for i in range(bound):  # unique prompts behind it take a free slot elsewhere, one by one
        assert not again.done()  # it holds out for its full home
        prompt = adm.prefix.prompt({"prompt": f"unique prompt number {i} " * 10})
        behind = asyncio.create_task(adm.acquire(prompt=prompt))
        await settle()
        adm.wake()
        await settle()
        assert behind.done() and behind.result().backend is elsewhere
        behind.result().release()
        await settle()
    # that many went before it: it takes a free slot elsewhere now, though its home is full
    assert again.done() and again.result().backend is elsewhere


async def test_a_request_does_not_wait_for_its_home_when_a_free_backend_holds_the_prefix_too():
    """As above (waiting would be worth it against a miss), but the other backend holds the
    same prefix (a hot prefix that spread): there is nothing to miss, it goes there at once."""
    adm, _, elsewhere = await full_home(FakeClock(), spread=True)
    again = asyncio.create_task(adm.acquire(prompt=adm.prefix.prompt(group(SYSTEM, "q " * 30))))
    await settle()
    assert again.done() and again.result().backend is elsewhere
    assert again.result().predicted > 0.5


async def test_a_request_does_not_wait_when_its_home_frees_slowly_and_a_miss_is_cheap():
    """One request runs on the home (a slot in 2.5 s), the other backend is idle (a miss costs
    ~0.45 s): it goes there at once."""
    clock = FakeClock()
    a, b = measured("A", clock, limit=1), measured("B", clock, limit=1)
    adm = queue_of([a, b], clock, lookahead=4, lookahead_age_s=5.0)
    first = await adm.acquire(prompt=adm.prefix.prompt(group(SYSTEM, "first " * 20)))
    second = await adm.acquire(prompt=adm.prefix.prompt(group(SYSTEM, "q " * 30)))
    assert second.backend is not first.backend


async def test_the_head_is_not_passed_over_past_its_age_bound():
    clock = FakeClock()
    a, b = measured("A", clock, limit=1), measured("B", clock, limit=1)
    adm = queue_of([a, b], clock, lookahead=4, lookahead_age_s=0.5)
    other = "Another tenant's system prompt. " * 20
    la = await adm.acquire(prompt=adm.prefix.prompt(group(SYSTEM, "first " * 20)))
    lb = await adm.acquire(prompt=adm.prefix.prompt(group(other, "first " * 20)))
    head = asyncio.create_task(adm.acquire(prompt=adm.prefix.prompt(group(other, "q " * 30))))
    await settle()
    fits = asyncio.create_task(adm.acquire(prompt=adm.prefix.prompt(group(SYSTEM, "q " * 30))))
    await settle()
    clock.advance(0.6)  # the head has waited past the bound: FIFO again
    la.release()
    await settle()
    assert head.done() and not fits.done()
    lb.release()
    await settle()
    assert fits.done()
    head.result().release()
    fits.result().release()


async def test_the_head_is_passed_over_at_most_lookahead_times_per_backend_however_long_it_waited():
    """No age bound: a queue whose waits are seconds long (every waiter old) still binds by
    prefix, and the head goes first once ``lookahead`` x backends later requests went first."""
    clock = FakeClock()
    a, b = measured("A", clock, limit=1), measured("B", clock, limit=1)
    adm = queue_of([a, b], clock, lookahead=2)
    bound = 2 * 2  # lookahead x two backends
    other = "Another tenant's system prompt. " * 20
    la = await adm.acquire(prompt=adm.prefix.prompt(group(SYSTEM, "first " * 20)))
    lb = await adm.acquire(prompt=adm.prefix.prompt(group(other, "first " * 20)))
    head = asyncio.create_task(adm.acquire(prompt=adm.prefix.prompt(group(other, "q " * 30))))
    await settle()
    fits = []
    for i in range(bound + 1):
        prompt = adm.prefix.prompt(group(SYSTEM, f"question {i} " * 10))
        fits.append(asyncio.create_task(adm.acquire(prompt=prompt)))
        await settle()
    clock.advance(100.0)  # every waiter is old: age alone decides nothing
    lease = la
    for i in range(bound):  # each time A frees, a later waiter whose prefix A holds goes
        lease.release()
        await settle()
        assert fits[i].done() and not head.done()
        lease = fits[i].result()
        assert lease.backend is a
    lease.release()  # passed over `bound` times: the head goes, though A fits the next one
    await settle()
    assert head.done() and head.result().backend is a and not fits[bound].done()
    lb.release()
    await settle()
    assert fits[bound].done()
    head.result().release()
    fits[bound].result().release()


async def test_lookahead_never_lets_batch_pass_interactive():
    clock = FakeClock()
    a = measured("A", clock, limit=1)
    adm = queue_of([a], clock, lookahead=4, lookahead_age_s=5.0)
    la = await adm.acquire(prompt=adm.prefix.prompt(group(SYSTEM, "first " * 20)))
    other = "Another tenant's system prompt. " * 20
    head = asyncio.create_task(adm.acquire(prompt=adm.prefix.prompt(group(other, "q " * 30))))
    await settle()
    batch = asyncio.create_task(
        adm.acquire("batch", prompt=adm.prefix.prompt(group(SYSTEM, "q " * 30)))
    )
    await settle()
    la.release()
    await settle()
    assert head.done() and not batch.done()
    head.result().release()
    await settle()
    assert batch.done()
    batch.result().release()


async def test_an_arrival_behind_a_waiter_holding_out_takes_a_free_slot_at_once():
    """A waiter holds out for its full home while the other backend has a free slot: a unique
    prompt arriving behind it is bound there at once, not at the next release or tick."""
    clock = FakeClock()
    adm, home, elsewhere = await full_home(clock, age=None)
    held = asyncio.create_task(adm.acquire(prompt=adm.prefix.prompt(group(SYSTEM, "q " * 30))))
    await settle()
    assert not held.done() and adm.depth == 1
    prompt = adm.prefix.prompt({"prompt": "a unique prompt, nothing like it cached " * 4})
    behind = asyncio.create_task(adm.acquire(prompt=prompt))
    await settle()  # no release, no wake, no tick
    assert behind.done() and behind.result().backend is elsewhere
    assert not held.done() and adm.depth == 1
    behind.result().release()
    home.in_flight -= 1
    adm.wake()
    await settle()
    assert held.done() and held.result().backend is home
