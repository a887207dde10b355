"""The simulator's prefix cache: the radix tree, the scheduler's use of it, what SGLang reports."""

from __future__ import annotations

import aiohttp
import pytest
from sim_util import running_sim

from loadtest.sim.prefix_cache import PrefixCache
from loadtest.sim.profiles import load_profile
from loadtest.sim.scheduler import GenRequest, Req, Scheduler
from loadtest.sim.tokens import chat_prompt_ids, prompt_token_ids

# ---- the tree ------------------------------------------------------------------------------


def test_match_splits_an_edge_and_counts_tokens_once():
    c = PrefixCache()
    c.insert([1, 2, 3, 4])
    node, hit = c.match([1, 2, 9])
    assert hit == 2
    assert node.key == (1, 2)  # the edge was cut where the match ended
    assert c.total_size == 4
    _, already = c.insert([1, 2, 7, 8, 9])
    assert already == 2
    assert c.total_size == 7


def test_locked_prefix_is_never_evicted():
    c = PrefixCache()
    a, _ = c.insert([1, 2, 3, 4])
    c.insert([5, 6, 7, 8])
    assert c.lock(a) == 4
    assert c.evictable_size == 4
    assert c.evict(8) == 4  # only the unlocked one could go
    assert c.match([1, 2, 3, 4])[1] == 4
    assert c.match([5, 6])[1] == 0
    assert c.unlock(a) == 4
    assert c.evictable_size == 4


def test_eviction_is_least_recently_used_leaf_first():
    c = PrefixCache()
    c.insert([1, 2, 3])
    c.insert([4, 5, 6])
    c.match([1, 2, 3])  # touched: the other is older
    assert c.evict(1) == 3
    assert c.match([1, 2, 3])[1] == 3
    assert c.match([4, 5, 6])[1] == 0


def test_a_parent_becomes_a_leaf_and_goes_after_its_children():
    c = PrefixCache()
    c.insert([1, 2, 3, 4])
    c.insert([1, 2, 5, 6])  # shared [1, 2], two leaves of 2
    assert c.evict(6) == 6
    assert c.total_size == 0


def test_flush_refuses_while_a_prefix_is_locked():
    c = PrefixCache()
    a, _ = c.insert([1, 2])
    c.lock(a)
    with pytest.raises(RuntimeError):
        c.reset()
    c.unlock(a)
    c.reset()
    assert c.total_size == 0


# ---- the scheduler ---------------------------------------------------------------------------


def _run(s: Scheduler, reqs: list[GenRequest], gap: float = 0.0) -> list[Req]:
    """Submit ``reqs`` (``gap`` modelled seconds apart, each after the previous finished when
    gap is 0) and run the scheduler to the end."""
    out, t = [], 0.0
    for g in reqs:
        out.append(s.submit(g, t))
        while (nxt := s.next_time()) is not None and (gap == 0 or nxt <= t + gap):
            s.advance(nxt)
            t = max(t, nxt)
            assert s.used_tokens <= s.profile.max_total_tokens
        t += gap
    while (nxt := s.next_time()) is not None:
        s.advance(nxt)
    return out


def _ids(*parts: list[int]) -> tuple[int, ...]:
    return tuple(x for p in parts for x in p)


PREFIX = list(range(5000, 7048))  # 2048 shared tokens


def _gen(rid: str, ids: tuple[int, ...], out: int = 16) -> GenRequest:
    return GenRequest(rid, len(ids), out, ignore_eos=True, prompt_ids=ids)


def test_a_shared_prefix_is_not_prefilled_again():
    s = Scheduler(load_profile("tp8"), seed=1)
    a, b = _run(
        s,
        [
            _gen("a", _ids(PREFIX, list(range(100, 300)))),
            _gen("b", _ids(PREFIX, list(range(300, 500)))),
        ],
    )
    assert a.cached_tokens == 0
    assert b.cached_tokens == len(PREFIX)
    assert (b.t_first - b.arrival) < (a.t_first - a.arrival)  # its prefill was 200, not 2248
    assert s.counters.cached_tokens_total == len(PREFIX)
    # a's prompt and answer stay cached after it finished, and count as evictable, not used
    assert s.cache.total_size >= len(a.prompt_ids) + 16
    assert s.live_stats().num_used_tokens == 0


def test_a_prompt_is_cached_once_prefilled_not_only_when_its_request_finishes():
    """SGLang's cache_unfinished_req: b arrives while a still decodes (a's prefill is done)
    and matches a's prompt; c, admitted in the same batch as d, does not (d's prefill is not
    done), and the copies they both computed are freed, not counted twice."""
    s = Scheduler(load_profile("tp8"), seed=1)
    a = s.submit(_gen("a", _ids(PREFIX, list(range(100, 300))), out=64), 0.0)
    while a.generated < 8:
        s.advance(s.next_time())
    b = s.submit(_gen("b", _ids(PREFIX, list(range(300, 500)))), s._now)
    other = list(range(20_000, 22_048))
    c = s.submit(_gen("c", _ids(other, [1, 2, 3])), s._now)
    d = s.submit(_gen("d", _ids(other, [4, 5, 6])), s._now)
    while (nxt := s.next_time()) is not None:
        s.advance(nxt)
        assert s.used_tokens <= s.profile.max_total_tokens
    assert a.finish is not None and b.t_first < a.t_last  # b ran beside a
    assert b.cached_tokens == len(PREFIX)
    assert c.cached_tokens == d.cached_tokens == 0
    assert s.used_tokens == s.cache.total_size  # nothing runs: all that is used is cache
    assert s.live_stats().num_used_tokens == 0


def test_a_conversation_hits_its_whole_history():
    s = Scheduler(load_profile("tp8"), seed=1)
    (first,) = _run(s, [_gen("t1", tuple(range(100, 400)))])
    history = first.prompt_ids + tuple(first.out_ids)
    (second,) = _run(s, [_gen("t2", history + tuple(range(900, 950)))])
    assert second.cached_tokens == len(history)


def test_without_ids_or_with_disjoint_prompts_timing_is_unchanged():
    """Unique prompts: the cache changes no decision (its tokens are room to admit)."""
    prof = load_profile("tp8").with_overrides(max_total_tokens=20000)
    reqs = [_gen(f"r{i}", tuple(range(10_000 * i + 1, 10_000 * i + 1500)), 64) for i in range(40)]
    on = _run(Scheduler(prof, seed=3), reqs, gap=0.05)
    off = _run(Scheduler(prof, seed=3, radix_cache=False), reqs, gap=0.05)
    assert [(r.t_first, r.t_last, r.num_retractions) for r in on] == [
        (r.t_first, r.t_last, r.num_retractions) for r in off
    ]
    assert all(r.cached_tokens == 0 for r in on)


def test_the_cache_is_evicted_to_make_room_and_never_overfills_the_pool():
    prof = load_profile("tp8").with_overrides(max_total_tokens=8000)
    s = Scheduler(prof, seed=1)
    reqs = [_gen(f"r{i}", tuple(range(10_000 * i + 1, 10_000 * i + 1000)), 32) for i in range(30)]
    done = _run(s, reqs, gap=0.02)  # _run asserts used <= max_total_tokens at every step
    assert all(r.finish is not None and r.finish.type == "length" for r in done)
    assert s.cache.total_size <= prof.max_total_tokens
    assert s.used_tokens == s.cache.total_size  # nothing runs: all that is used is cache
    assert s.cache.total_size < 30 * 1032  # old prompts were evicted
    assert s.cache.match(reqs[-1].prompt_ids)[1] == len(reqs[-1].prompt_ids)  # newest stays


def test_flush_cache_empties_it_when_idle_only():
    s = Scheduler(load_profile("tp8"), seed=1)
    _run(s, [_gen("a", tuple(range(1, 500)))])
    s.submit(_gen("b", tuple(range(1, 500))), s._now)
    assert not s.flush_cache()  # b waits
    while (nxt := s.next_time()) is not None:
        s.advance(nxt)
    assert s.flush_cache()
    assert s.cache.total_size == 0
    assert s.used_tokens == 0


def test_cache_hit_rate_gauge_is_the_batch_hit_share():
    s = Scheduler(load_profile("tp8"), seed=1)
    _run(s, [_gen("a", _ids(PREFIX, [1, 2])), _gen("b", _ids(PREFIX, [3, 4]))])
    assert s.logged_stats().cache_hit_rate == pytest.approx(len(PREFIX) / (len(PREFIX) + 2))


# ---- what a client sees ----------------------------------------------------------------------

SYSTEM = " ".join(["the"] * 10 + ["of"] * 500)
CHAT = "/v1/chat/completions"


def _chat(question: str) -> dict:
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return {"messages": msgs, "max_tokens": 4, "ignore_eos": True}


@pytest.mark.parametrize("report", [True, False])
async def test_openai_usage_reports_cached_tokens_only_with_enable_cache_report(report):
    async with running_sim("tp8", enable_cache_report=report) as (url, backend):
        async with aiohttp.ClientSession(url) as s:
            for q in ("first question", "second question"):
                async with s.post(CHAT, json=_chat(q)) as r:
                    assert r.status == 200
                    usage = (await r.json())["usage"]
    shared = len(chat_prompt_ids([{"role": "system", "content": SYSTEM}])) - 3  # + user header
    if report:
        assert usage["prompt_tokens_details"]["cached_tokens"] == shared + 3
    else:
        assert usage["prompt_tokens_details"] is None
    assert backend.engine.counters.cached_tokens_total == shared + 3


async def test_generate_meta_info_and_metrics_report_the_hit():
    text = " ".join(["word"] * 300)
    async with running_sim("tp8") as (url, _backend):
        async with aiohttp.ClientSession(url) as s:
            metas = []
            for tail in ("alpha", "beta"):
                body = {"text": f"{text} {tail}", "sampling_params": {"max_new_tokens": 2}}
                async with s.post("/generate", json=body) as r:
                    metas.append((await r.json())["meta_info"])
            async with s.get("/metrics") as r:
                metrics = await r.text()
    assert [m["cached_tokens"] for m in metas] == [0, len(prompt_token_ids(text))]
    cached = [line for line in metrics.splitlines() if line.startswith("sglang:cached_tokens")]
    assert cached and float(cached[0].rsplit(" ", 1)[1]) == 300


async def test_disable_radix_cache_prefills_everything():
    text = " ".join(["word"] * 300)
    async with running_sim("tp8", radix_cache=False) as (url, _backend):
        async with aiohttp.ClientSession(url) as s:
            metas = []
            for _ in range(2):
                body = {"text": text, "sampling_params": {"max_new_tokens": 2}}
                async with s.post("/generate", json=body) as r:
                    metas.append((await r.json())["meta_info"])
    assert [m["cached_tokens"] for m in metas] == [0, 0]
