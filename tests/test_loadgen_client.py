"""The load generator's HTTP client, runner and CLI against a tiny in-process fake server."""

from __future__ import annotations

import asyncio
import os
import sys

import orjson
import pytest

from loadtest import runner
from loadtest.client import Target, execute, make_session
from loadtest.records import RequestRecord
from loadtest.runner import LevelPlan, Live, run_level
from loadtest.workload import LengthDist, RequestSpec, Workload, WorkloadConfig, build_payload

sys.path.insert(0, os.path.dirname(__file__))
import itertools

from loadgen_fake import FakeState, start_fake


@pytest.fixture
async def fake(unused_port):
    state = FakeState()
    runner = await start_fake(state, unused_port)
    try:
        yield state, f"http://127.0.0.1:{unused_port}"
    finally:
        await runner.cleanup()


def _spec(api: str, prompt: str, n: int, stream: bool = True) -> RequestSpec:
    body = build_payload(
        api,  # type: ignore[arg-type]
        model="fake-model",
        messages=[{"role": "user", "content": prompt}],
        text=prompt,
        max_tokens=n,
        stream=stream,
        ignore_eos=True,
    )
    path = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}.get(api, "/generate")
    return RequestSpec(0, path, orjson.dumps(body), len(prompt.split()), n)


async def _one(url: str, api: str, prompt: str, n: int, stream: bool = True) -> RequestRecord:
    target = Target(url=url, api=api, stream=stream)
    async with make_session(target, 4) as session:
        rec = RequestRecord(level=1, worker=0, t_scheduled=0.0, t_send=0.0)
        return await execute(session, target, _spec(api, prompt, n, stream), rec)


@pytest.mark.parametrize("api", ["chat", "completions", "generate"])
@pytest.mark.parametrize("stream", [True, False])
async def test_exact_token_counts_from_usage_and_chunks(fake, api, stream):
    _, url = fake
    rec = await _one(url, api, "one two three", 7, stream)
    assert rec.ok, rec.error_message
    assert rec.completion_tokens == 7
    assert rec.chunk_tokens == 7
    assert rec.prompt_tokens == 3
    assert rec.t_send == rec.t_scheduled  # closed loop
    assert rec.t_send <= rec.t_first <= rec.t_last <= rec.t_end
    if stream:
        # one token-carrying event per token: the role-only, finish and usage chunks carry none
        assert rec.token_counts == [1] * 7
        assert rec.token_times == sorted(rec.token_times)
    else:
        assert rec.token_counts == [7]
        assert rec.ttft == rec.e2e


async def test_streaming_requests_ask_for_exact_usage(fake):
    state, url = fake
    await _one(url, "chat", "hello", 2)
    assert state.bodies[-1]["stream_options"] == {
        "include_usage": True,
        "continuous_usage_stats": True,
    }
    assert state.bodies[-1]["ignore_eos"] is True


@pytest.mark.parametrize(
    ("word", "kind", "message"),
    [
        ("FAIL400", "http_4xx", "bad thing"),  # SGLang's top-level error shape
        ("FAIL500", "http_5xx", "boom"),  # nested OpenAI shape
        ("CUT", "incomplete", "[DONE]"),
        ("ERRCHUNK", "stream_error", "went wrong"),
    ],
)
async def test_errors_are_classified_with_their_message(fake, word, kind, message):
    _, url = fake
    rec = await _one(url, "chat", f"a {word} b", 5)
    assert rec.error == kind
    assert message in (rec.error_message or "")
    assert rec.t_end is not None


async def test_missing_usage_falls_back_to_chunks_and_is_flagged(fake):
    _, url = fake
    target = Target(url=url, api="chat", stream=True)
    body = orjson.loads(_spec("chat", "NOUSAGE x", 4).body)
    body.pop("stream_options")
    spec = RequestSpec(0, "/v1/chat/completions", orjson.dumps(body), 2, 4)
    async with make_session(target, 1) as session:
        rec = await execute(
            session, target, spec, RequestRecord(level=1, worker=0, t_scheduled=0, t_send=0)
        )
    assert rec.ok
    assert rec.completion_tokens is None
    assert rec.output_tokens == 4  # counted from chunks, never from max_tokens


async def test_unreachable_server_is_a_connect_error(unused_port):
    rec = await _one(f"http://127.0.0.1:{unused_port}", "chat", "x", 2)
    assert rec.error == "connect"


def _workload(api="chat", out=5, words=8) -> Workload:
    return Workload(
        WorkloadConfig(
            api=api,
            model="fake-model",
            input_len=LengthDist("fixed", words),
            output_len=LengthDist("fixed", out),
        )
    )


async def test_closed_loop_keeps_exactly_c_requests_in_flight(fake):
    state, url = fake
    state.delay = 0.002
    target = Target(url=url)
    async with make_session(target, 8) as session:
        res = await run_level(
            session,
            target,
            _workload(),
            LevelPlan(concurrency=3, warmup=0.0, duration=None, requests=12),
            stop=asyncio.Event(),
        )
    assert state.peak == 3
    measured = [r for r in res.records]
    assert len(measured) >= 12
    assert all(r.ok for r in measured)
    by_worker: dict[int, list[RequestRecord]] = {}
    for r in measured:
        by_worker.setdefault(r.worker, []).append(r)
    assert sorted(by_worker) == [0, 1, 2]
    for rs in by_worker.values():  # each worker sends its next request only after the last ended
        rs.sort(key=lambda r: r.t_send)
        for a, b in itertools.pairwise(rs):
            assert b.t_send >= a.t_end
    assert len(res.dispatch_delays) == len(measured) - 3  # none for the first sends
    assert res.window is not None and res.window[0] < res.window[1]


async def test_open_loop_latency_counts_from_the_scheduled_time(fake):
    _state, url = fake
    target = Target(url=url)
    async with make_session(target, 8) as session:
        res = await run_level(
            session,
            target,
            _workload(out=2),
            LevelPlan(
                rate=50.0,
                arrival="constant",
                warmup=0.0,
                duration=None,
                requests=6,
                max_in_flight=1,
            ),
            stop=asyncio.Event(),
        )
    recs = sorted(res.records, key=lambda r: r.t_scheduled)
    assert len(recs) == 6
    gaps = [b.t_scheduled - a.t_scheduled for a, b in itertools.pairwise(recs)]
    assert gaps == pytest.approx([0.02] * 5, abs=1e-9)  # an absolute schedule, no drift
    assert all(r.level == 0 and r.t_send >= r.t_scheduled for r in recs)
    assert all(r.ttft == r.t_first - r.t_scheduled for r in recs)


async def test_requests_cut_at_the_end_of_a_level_are_outside_its_window(fake, monkeypatch):
    """uvloop's timers have millisecond resolution: the end-of-level cut may fire just before
    ``stop_at``. The requests it cancels ended after the window, not inside it as failures."""
    state, url = fake
    state.delay = 0.01
    real_wait = asyncio.wait

    async def early_wait(fs, *, timeout=None, return_when=asyncio.ALL_COMPLETED):  # noqa: ASYNC109
        early = None if timeout is None else max(timeout - 0.005, 0.0)
        return await real_wait(fs, timeout=early, return_when=return_when)

    monkeypatch.setattr(runner.asyncio, "wait", early_wait)
    target = Target(url=url)
    async with make_session(target, 4) as session:
        res = await run_level(
            session,
            target,
            _workload(out=1000),
            LevelPlan(concurrency=2, warmup=0.0, duration=0.2, drain_timeout=0.0),
            stop=asyncio.Event(),
        )
    cut = [r for r in res.records if r.error == "cancelled"]
    assert len(cut) == 2
    assert res.window is not None
    assert all(r.t_end >= res.window[1] for r in cut)
    # A cut stream keeps the times of the tokens it received (for --save-records).
    assert all(r.t_first is not None and r.t_first <= r.t_last <= r.t_end for r in cut)


async def test_stop_event_ends_a_level_and_keeps_its_records(fake):
    state, url = fake
    state.delay = 0.01
    target = Target(url=url)
    stop = asyncio.Event()
    live = Live()
    async with make_session(target, 4) as session:
        task = asyncio.create_task(
            run_level(
                session,
                target,
                _workload(out=1000),
                LevelPlan(concurrency=2, warmup=0.0, duration=60.0),
                stop=stop,
                live=live,
            )
        )
        while live.tokens() < 4:  # noqa: ASYNC110 - polling the live counters is the point
            await asyncio.sleep(0.01)
        stop.set()
        res = await task
    assert res.interrupted
    assert len(res.records) == 2
    assert all(r.error == "cancelled" and r.chunk_tokens > 0 for r in res.records)


async def test_a_proxy_target_is_recorded_as_a_proxy_with_what_it_fronts():
    """Through pipefill, /get_server_info is answered by any one backend: the run records
    the proxy and its backends instead of passing one backend off as the target."""
    from proxy_support import fakes, running_proxy

    from loadtest.client import server_info
    from loadtest.runner import _server_summary

    async with fakes(2) as ups, running_proxy([u.url for u in ups]) as px:
        names = sorted(b.name for b in px.proxy.pool.all())
        target = Target(px.url)
        session = make_session(target, 2)
        try:
            keyless = await server_info(session, target)  # the route is the admin's: refused
            direct = await server_info(session, Target(ups[0].url))
        finally:
            await session.close()
    assert keyless["proxy"] == "pipefill"
    assert sorted(f.split(" ")[0] for f in keyless["fronts"]) == names
    assert "proxy" not in direct  # a server is recorded as itself
    async with (
        fakes(2) as ups,
        running_proxy([u.url for u in ups], server={"admin_key": "adm"}) as px,
    ):
        names = sorted(b.name for b in px.proxy.pool.all())
        target = Target(px.url, headers={"Authorization": "Bearer adm"})
        session = make_session(target, 2)
        try:
            info = await server_info(session, target)
        finally:
            await session.close()
    assert info["proxy"] == "pipefill" and info["answered_by"] in names
    assert sorted(f.split(" ")[0] for f in info["fronts"]) == names
    assert info["backend_info"]["served_by"] in ("fake0", "fake1")
    summary = _server_summary(info)
    assert summary["proxy"] == "pipefill" and "answered_by" not in summary
