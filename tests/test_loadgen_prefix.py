"""Prefix-cache workloads: shared-prefix groups, multi-turn conversations, the hit rate."""

from __future__ import annotations

import asyncio
import itertools
import os
import sys
from collections import Counter

import orjson
import pytest
from sim_util import running_sim

from loadtest.cli import main
from loadtest.client import Target, make_session
from loadtest.records import RequestRecord
from loadtest.runner import LevelPlan, run_level
from loadtest.stats import cache_summary, summarize_level
from loadtest.workload import TURN_SEPARATOR, LengthDist, Workload, WorkloadConfig

sys.path.insert(0, os.path.dirname(__file__))
from loadgen_fake import FakeState, ThreadedFake


def _config(**kw) -> WorkloadConfig:
    base = dict(input_len=LengthDist("fixed", 20), output_len=LengthDist("fixed", 8))
    return WorkloadConfig(**{**base, **kw})


def _messages(spec) -> list[dict]:
    return orjson.loads(spec.body)["messages"]


def test_shared_prefix_requests_are_one_of_g_system_prompts_and_a_unique_question():
    w = Workload(_config(workload="shared-prefix", prefix_groups=3, prefix_tokens=50))
    specs = [w.next() for _ in range(60)]
    systems = [_messages(s)[0]["content"] for s in specs]
    questions = [_messages(s)[1]["content"] for s in specs]
    assert len(set(systems)) == 3
    assert all(len(t.split()) == 50 for t in systems)
    assert len(set(questions)) == 60
    # groups differ from their first words on (a block-wise matcher tells them apart at once)
    assert len({t.split()[0] for t in systems}) == 3
    assert all(s.input_len == 70 for s in specs)
    again = Workload(_config(workload="shared-prefix", prefix_groups=3, prefix_tokens=50))
    assert [again.next().body for _ in range(60)] == [s.body for s in specs]


def test_completions_carry_the_system_prompt_as_leading_text():
    w = Workload(_config(api="completions", workload="shared-prefix", prefix_groups=2,
                         prefix_tokens=30))  # fmt: skip
    prompt = orjson.loads(w.next().body)["prompt"]
    system, question = prompt.split(TURN_SEPARATOR)
    assert len(system.split()) == 30 and len(question.split()) == 20


def test_prefix_skew_sends_that_share_to_the_first_group():
    w = Workload(_config(workload="shared-prefix", prefix_groups=5, prefix_skew=0.8))
    counts = Counter(w.group_of(i) for i in range(5000))
    assert counts[0] / 5000 == pytest.approx(0.8, abs=0.03)
    assert set(counts) == {0, 1, 2, 3, 4}
    uniform = Workload(_config(workload="shared-prefix", prefix_groups=5))
    counts = Counter(uniform.group_of(i) for i in range(5000))
    assert max(counts.values()) / 5000 < 0.25


def test_multi_turn_resends_history_with_the_answers_then_starts_over():
    w = Workload(_config(workload="multi-turn", turns=3))
    first = w.next(worker=7)
    assert first.keep_answer
    assert [m["role"] for m in _messages(first)] == ["user"]
    w.answered(7, " an answer")
    other = w.next(worker=8)  # another client's conversation is its own
    assert len(_messages(other)) == 1
    second = _messages(w.next(worker=7))
    assert [m["role"] for m in second] == ["user", "assistant", "user"]
    assert second[0] == _messages(first)[0]
    assert second[1]["content"] == " an answer"
    w.answered(7, " two")
    assert len(_messages(w.next(worker=7))) == 5
    w.answered(7, " three")
    assert len(_messages(w.next(worker=7))) == 1  # three turns answered: a new conversation


def test_a_failed_turn_starts_a_new_conversation():
    w = Workload(_config(workload="multi-turn", turns=5))
    w.next(worker=0)
    w.answered(0, " fine")
    w.next(worker=0)
    w.answered(0, None)
    assert len(_messages(w.next(worker=0))) == 1


def _rec(prompt: int, cached: int | None, served: str | None = None) -> RequestRecord:
    r = RequestRecord(level=1, worker=0, t_scheduled=0.0, t_send=0.0)
    r.prompt_tokens, r.cached_tokens, r.served_by = prompt, cached, served
    return r


def test_hit_rate_weighs_tokens_and_tells_unknown_from_zero():
    assert cache_summary([_rec(100, None), _rec(50, None)]) is None
    c = cache_summary([_rec(100, 90, "a"), _rec(300, 0, "b"), _rec(100, 10, "a"), _rec(9, None)])
    assert c["hit_rate"] == pytest.approx(100 / 500)
    assert c["reported"] == 3 and c["unreported"] == 1
    assert c["by_backend"]["a"] == {"hit_rate": pytest.approx(0.5), "requests": 2}
    assert c["by_backend"]["b"]["hit_rate"] == 0.0
    assert cache_summary([_rec(100, 0)])["hit_rate"] == 0.0


@pytest.mark.parametrize("api", ["chat", "generate"])
async def test_multi_turn_against_the_simulator_hits_its_history(api):
    config = _config(api=api, workload="multi-turn", turns=4, ignore_eos=True)
    async with running_sim("tp8", enable_cache_report=True) as (url, _backend):
        target = Target(url, api=api)
        async with make_session(target, 2) as session:
            result = await run_level(
                session, target, Workload(config),
                LevelPlan(concurrency=2, warmup=0.0, duration=None, requests=16),
                stop=asyncio.Event(),
            )  # fmt: skip
    recs = sorted(result.records, key=lambda r: r.t_send)
    assert all(r.ok for r in recs)
    by_worker: dict[int, list[RequestRecord]] = {}
    for r in recs:
        by_worker.setdefault(r.worker, []).append(r)
    for turns in by_worker.values():
        # turn 1 of each conversation has only the template in common; later turns hold the
        # whole previous prompt and its answer
        for k, r in enumerate(turns):
            if k % 4 == 0:
                assert r.cached_tokens < 10
            else:
                assert r.cached_tokens >= turns[k - 1].prompt_tokens
        assert all(r.answer is None for r in turns)  # not kept past the next turn
    w0, w1 = recs[0].t_send, max(r.t_end for r in recs) + 1
    level = summarize_level(recs, concurrency=2, window=(w0, w1))
    assert 0.4 < level.cache["hit_rate"] < 1.0


async def test_a_turn_delay_is_the_clients_think_time_not_a_dispatch_delay():
    """Each client waits an exponential think time (mean ``turn_delay``) between an answer and
    its next turn, as a person reading it would; the runner's dispatch delay (its own lateness)
    leaves that time out."""
    config = _config(workload="multi-turn", turns=4, ignore_eos=True)
    delay = 0.2
    async with running_sim("tp8") as (url, _backend):
        target = Target(url)
        async with make_session(target, 2) as session:
            result = await run_level(
                session, target, Workload(config),
                LevelPlan(concurrency=2, warmup=0.0, duration=None, requests=12,
                          turn_delay=delay),
                stop=asyncio.Event(),
            )  # fmt: skip
    gaps = []
    for w in (0, 1):
        recs = sorted((r for r in result.records if r.worker == w), key=lambda r: r.t_send)
        gaps += [b.t_send - a.t_end for a, b in itertools.pairwise(recs)]
    assert len(gaps) >= 8 and all(g >= 0 for g in gaps)
    assert sum(gaps) / len(gaps) > delay / 4  # mean 0.2 s: below 0.05 s is ~1e-4 likely
    assert sorted(result.dispatch_delays)[len(result.dispatch_delays) // 2] < delay / 4


@pytest.fixture
def fake(unused_port):
    with ThreadedFake(FakeState(), unused_port) as server:
        yield server


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--prefix-groups", "4"], "--prefix-groups is for --workload shared-prefix"),
        (["--workload", "shared-prefix", "--prefix-groups", "0"], "--prefix-groups must be"),
        (["--workload", "shared-prefix", "--prefix-skew", "1.5"], "--prefix-skew"),
        (["--workload", "multi-turn", "--turns", "0"], "--turns must be >= 1"),
        (["--turns", "3"], "--turns is for --workload multi-turn"),
        (["--turn-delay", "1"], "--turn-delay is for --workload multi-turn"),
        (["--workload", "multi-turn", "--turn-delay", "-1"], "--turn-delay must be"),
        (["--workload", "multi-turn", "--turn-delay", "nan"], "--turn-delay must be"),
        (["--workload", "multi-turn", "--rate", "2"], "needs closed-loop"),
        (["--workload", "shared-prefix", "--shared-prefix", "5"], "--shared-prefix is for"),
    ],
)
def test_bad_workload_flags_are_one_line_errors(fake, args, needle, capsys):
    try:
        rc = main(["run", "--url", fake.url, "--requests", "1", *args])
    except SystemExit as exc:
        rc = exc.code
    assert rc == 2
    err = capsys.readouterr().err
    assert needle in err
    assert "Traceback" not in err


def test_reports_show_the_hit_rate_only_when_a_server_reported_one():
    from loadtest.report import level_table, levels_markdown

    def level(records):
        return summarize_level(records, concurrency=2, window=(0.0, 10.0))

    recs = []
    for cached in (90, 10):
        r = _rec(100, cached, "b0")
        r.t_send = r.t_scheduled = 1.0
        r.t_first = r.t_last = r.t_end = 2.0
        r.token_times, r.token_counts, r.completion_tokens = [2.0], [5], 5
        recs.append(r)
    md = levels_markdown([level(recs)])
    assert "cache hit" in md and "50.0%" in md
    assert "cache hit" not in levels_markdown([level([_rec(100, None)])])
    assert any(c.header == "cache\nhit" for c in level_table([level(recs)]).columns)
