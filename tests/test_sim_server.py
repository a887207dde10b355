"""The simulator's HTTP side: every route, SGLang's shapes and SSE framing, errors, aborts."""

from __future__ import annotations

import asyncio
import itertools
import logging

import aiohttp
import orjson
import pytest
from sim_util import running_sim, sse_json, sse_payloads, trace_lines, wait_until

from proxy.sse import SSEFramer, TokenCounter

CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "say something nice"}]


@pytest.fixture
async def sim():
    async with running_sim("tp8", trace=True) as (url, backend):
        async with aiohttp.ClientSession(url) as session:
            yield session, backend


def running(backend) -> int:
    return int(backend.engine.live_stats().num_running_reqs)


# ---- chat ---------------------------------------------------------------------------------


async def test_chat_non_stream_shape_and_exact_usage(sim):
    s, _backend = sim
    body = {"model": "m", "messages": MSGS, "max_tokens": 7, "ignore_eos": True}
    async with s.post(CHAT, json=body) as r:
        assert r.status == 200
        assert r.content_type == "application/json"
        out = await r.json()
    assert out["object"] == "chat.completion"
    assert out["model"] == "m"
    choice = out["choices"][0]
    assert choice["index"] == 0
    assert choice["message"]["role"] == "assistant"
    assert set(choice["message"]) >= {"content", "reasoning_content", "tool_calls"}
    assert choice["finish_reason"] == "length"
    assert "matched_stop" in choice
    assert len(choice["message"]["content"].split()) == 7
    usage = out["usage"]
    assert usage["completion_tokens"] == 7
    assert usage["prompt_tokens"] > 3
    assert usage["total_tokens"] == usage["prompt_tokens"] + 7
    assert out["metadata"] == {"weight_version": "default"}


async def test_chat_stream_sglang_event_order(sim):
    s, _backend = sim
    body = {
        "messages": MSGS,
        "max_tokens": 12,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with s.post(CHAT, json=body) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        raw = await r.read()
    events = sse_json(raw)
    role, *contents, finish, usage = events
    assert role["choices"][0]["delta"]["role"] == "assistant"
    assert role["choices"][0]["delta"]["content"] == ""
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert len({e["id"] for e in events}) == 1
    assert role["id"].startswith("chatcmpl-")
    # a chunk carries every token generated since the last write (SGLang coalesces too)
    text = "".join(c["choices"][0]["delta"]["content"] for c in contents)
    assert len(text.split()) == 12
    assert all(c["choices"][0]["delta"]["content"] for c in contents)
    assert all(c["choices"][0]["finish_reason"] is None for c in contents)
    fin = finish["choices"][0]
    assert fin["finish_reason"] == "length"
    assert "matched_stop" in fin
    assert fin["delta"].get("content") is None and "role" not in fin["delta"]
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 12
    # the shared token accounting agrees with the server's count
    counter = TokenCounter("chat")
    framer = SSEFramer()
    n = sum(counter.observe(p) for p in framer.feed(raw))
    assert counter.completion_tokens == 12 and counter.done
    assert n == len(contents)  # without continuous usage a chunk counts as one token


async def test_error_after_stream_began_is_an_error_event_then_done(sim):
    s, backend = sim
    body = {"messages": MSGS, "max_tokens": 3000, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    async with s.post(CHAT, json=body) as r:
        assert r.status == 200
        await r.content.readuntil(b"\n\n")
        backend.engine.abort_all(message="KV cache exhausted", status_code=503)
        events = sse_json(await r.read())
    err = next(e for e in events if "error" in e)["error"]
    assert err == {"object": "error", "message": "KV cache exhausted",
                   "type": "SERVICE_UNAVAILABLE", "param": None, "code": 503}  # fmt: skip
    assert not any(e.get("choices") and e["choices"][0]["finish_reason"] for e in events)


async def test_chat_stream_without_usage_option_has_no_usage_chunk(sim):
    s, _ = sim
    body = {"messages": MSGS, "max_tokens": 3, "ignore_eos": True, "stream": True}
    async with s.post(CHAT, json=body) as r:
        events = sse_json(await r.read())
    assert all(e["choices"] for e in events)
    assert all("usage" not in e or e["usage"] is None for e in events)


async def test_chat_continuous_usage_stats_on_every_content_chunk(sim):
    s, _ = sim
    body = {
        "messages": MSGS,
        "max_tokens": 5,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    async with s.post(CHAT, json=body) as r:
        events = sse_json(await r.read())
    contents = [e for e in events if e["choices"] and e["choices"][0]["delta"].get("content")]
    counts = [c["usage"]["completion_tokens"] for c in contents]
    assert counts == sorted(set(counts)) and counts[-1] == 5
    assert [len(c["choices"][0]["delta"]["content"].split()) for c in contents] == [
        b - a for a, b in zip([0, *counts], counts, strict=False)
    ]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 5


async def test_natural_length_without_ignore_eos_stops(sim):
    s, _ = sim
    body = {"messages": MSGS, "max_tokens": 4000}
    async with s.post(CHAT, json=body) as r:
        out = await r.json()
    choice = out["choices"][0]
    assert choice["finish_reason"] in ("stop", "length")
    assert out["usage"]["completion_tokens"] >= 1


# ---- completions --------------------------------------------------------------------------


async def test_completions_stream_finish_on_last_content_chunk(sim):
    s, _ = sim
    body = {
        "prompt": "one two three",
        "max_tokens": 6,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with s.post("/v1/completions", json=body) as r:
        events = sse_json(await r.read())
    *contents, usage = events
    assert len("".join(c["choices"][0]["text"] for c in contents).split()) == 6
    assert all(e["object"] == "text_completion" for e in events)
    reasons = [c["choices"][0]["finish_reason"] for c in contents]
    assert reasons == [None] * (len(contents) - 1) + ["length"]
    assert all(c["choices"][0]["text"] for c in contents)
    assert usage["choices"] == []
    assert usage["usage"]["prompt_tokens"] == 3
    assert usage["usage"]["completion_tokens"] == 6


async def test_completions_non_stream(sim):
    s, _ = sim
    body = {"prompt": "one two three", "max_tokens": 4, "ignore_eos": True}
    async with s.post("/v1/completions", json=body) as r:
        out = await r.json()
    assert out["object"] == "text_completion"
    assert len(out["choices"][0]["text"].split()) == 4
    assert out["usage"] == {
        "prompt_tokens": 3,
        "total_tokens": 7,
        "completion_tokens": 4,
        "prompt_tokens_details": None,
        "reasoning_tokens": 0,
    }


# ---- /generate ----------------------------------------------------------------------------


async def test_generate_text_and_input_ids(sim):
    s, _ = sim
    for prompt in ({"text": "a b c d"}, {"input_ids": [5, 6, 7, 8]}):
        body = {**prompt, "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}}
        async with s.post("/generate", json=body) as r:
            assert r.status == 200
            out = await r.json()
        meta = out["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": 5}
        assert meta["prompt_tokens"] == 4
        assert meta["completion_tokens"] == 5
        assert len(out["output_ids"]) == 5
        assert len(out["text"].split()) == 5
        for key in ("id", "weight_version", "num_retractions", "cached_tokens", "e2e_latency"):
            assert key in meta


async def test_generate_stream_is_cumulative(sim):
    s, _ = sim
    body = {"text": "a b", "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}}
    async with s.post("/generate", json={**body, "stream": True}) as r:
        events = sse_json(await r.read())
    counts = [e["meta_info"]["completion_tokens"] for e in events]
    assert counts == sorted(set(counts)) and counts[-1] == 8
    for prev, cur in itertools.pairwise(events):
        assert cur["text"].startswith(prev["text"])
        assert cur["output_ids"][: len(prev["output_ids"])] == prev["output_ids"]
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    assert "e2e_latency" in events[-1]["meta_info"]
    assert all("e2e_latency" not in e["meta_info"] for e in events[:-1])
    assert all("index" not in e for e in events)


async def test_generate_batch_list_and_stream_index(sim):
    s, _ = sim
    body = {"text": ["a", "b c", "d e f"], "sampling_params": {"max_new_tokens": 3,
                                                              "ignore_eos": True}}  # fmt: skip
    async with s.post("/generate", json=body) as r:
        outs = await r.json()
    assert isinstance(outs, list) and len(outs) == 3
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [1, 2, 3]
    async with s.post("/generate", json={**body, "stream": True}) as r:
        events = sse_json(await r.read())
    by_index: dict[int, list[dict]] = {}
    for e in events:
        by_index.setdefault(e["index"], []).append(e)
    assert sorted(by_index) == [0, 1, 2]
    for chunks in by_index.values():
        assert chunks[-1]["meta_info"]["completion_tokens"] == 3
    counter = TokenCounter("generate")
    for p in sse_payloads(await _raw_stream(s, body)):
        counter.observe(p)
    assert counter.completion_tokens == 9


async def _raw_stream(s, body) -> bytes:
    async with s.post("/generate", json={**body, "stream": True}) as r:
        return await r.read()


async def test_generated_text_is_deterministic_per_rid_and_stop_strings(sim):
    s, _ = sim
    body = {"text": "x", "rid": "fixed-rid", "sampling_params": {"max_new_tokens": 10,
                                                                "ignore_eos": True}}  # fmt: skip
    texts = []
    for _ in range(2):
        async with s.post("/generate", json=body) as r:
            texts.append((await r.json())["text"])
    assert texts[0] == texts[1]
    full = texts[0]
    stop = full.split()[4]
    at = full.find(stop)  # may match inside an earlier word: the first occurrence counts
    ends = [len(" ".join(full.split()[: k + 1])) + 1 for k in range(10)]
    expect_tokens = next(k for k, end in enumerate(ends) if end >= at + len(stop)) + 1
    body["sampling_params"] = {**body["sampling_params"], "stop": [stop]}
    async with s.post("/generate", json=body) as r:
        out = await r.json()
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == full[:at]
    assert out["meta_info"]["completion_tokens"] == expect_tokens


# ---- errors -------------------------------------------------------------------------------


def _assert_openai_error(out: dict, status: int = 400) -> None:
    assert set(out) == {"object", "message", "type", "param", "code"}
    assert out["object"] == "error" and out["code"] == status


@pytest.mark.parametrize(
    ("body", "err_type"),
    [
        ({"max_tokens": 3}, "Bad Request"),  # messages missing
        ({"messages": "nope"}, "Bad Request"),
        ({"messages": MSGS, "max_tokens": -1}, "BadRequestError"),
        ({"messages": MSGS, "max_tokens": 10**7}, "BadRequestError"),
        ({"messages": [{"role": "user", "content": "w " * 200_000}]}, "BadRequestError"),
    ],
)
async def test_chat_validation_errors_are_400(sim, body, err_type):
    s, _ = sim
    for stream in (False, True):
        async with s.post(CHAT, json={**body, "stream": stream}) as r:
            assert r.status == 400
            out = await r.json()
        _assert_openai_error(out)
        assert out["type"] == err_type


async def test_chat_bad_json_and_content_type(sim):
    s, _ = sim
    headers = {"Content-Type": "application/json"}
    async with s.post(CHAT, data=b"{not json", headers=headers) as r:
        assert r.status == 400
        _assert_openai_error(await r.json())
    async with s.post(CHAT, data=orjson.dumps({"messages": MSGS}),
                      headers={"Content-Type": "text/plain"}) as r:  # fmt: skip
        assert r.status == 400
        out = await r.json()
        _assert_openai_error(out)
        assert "application/json" in out["message"]


async def test_context_length_messages(sim):
    s, backend = sim
    ctx = backend.profile.context_length
    body = {"prompt": "w " * (ctx + 5), "max_tokens": 1}
    async with s.post("/v1/completions", json=body) as r:
        out = await r.json()
    assert r.status == 400
    assert "longer than the model's context length" in out["message"]
    body = {"prompt": "w w", "max_tokens": ctx}
    async with s.post("/v1/completions", json=body) as r:
        out = await r.json()
    assert "Requested token count exceeds the model's maximum context length" in out["message"]


@pytest.mark.parametrize(
    "body",
    [
        {"sampling_params": {"max_new_tokens": 3}},
        {"text": "a", "input_ids": [1]},
        {"text": "a", "sampling_params": {"max_new_tokens": -2}},
        {"text": "a", "sampling_params": {"max_new_tokens": 10**8}},
        {"text": 5},
    ],
)
async def test_generate_errors(sim, body):
    s, _ = sim
    async with s.post("/generate", json=body) as r:
        assert r.status == 400
        out = await r.json()
    assert set(out) == {"error"} and isinstance(out["error"]["message"], str)


async def test_generate_malformed_json_is_400(sim):
    s, _backend = sim
    headers = {"Content-Type": "application/json"}
    async with s.post("/generate", data=b"[1, 2", headers=headers) as r:
        assert r.status == 400
    async with s.get("/health") as r:  # still alive
        assert r.status == 200


# ---- info routes --------------------------------------------------------------------------


async def test_info_routes(sim):
    s, backend = sim
    name = backend.model_name
    async with s.get("/v1/models") as r:
        models = await r.json()
    assert models["object"] == "list"
    card = models["data"][0]
    assert card["id"] == name and card["owned_by"] == "sglang"
    assert card["max_model_len"] == backend.profile.context_length
    async with s.get("/v1/models/nope") as r:
        assert r.status == 404
        assert (await r.json())["error"]["code"] == "model_not_found"
    for path in ("/get_model_info", "/model_info"):
        async with s.get(path) as r:
            info = await r.json()
        assert info["model_path"] == name and info["is_generation"] is True
    for path in ("/get_server_info", "/server_info"):
        async with s.get(path) as r:
            info = await r.json()
        assert isinstance(info["internal_states"], list) and info["internal_states"]
        assert info["tp_size"] == backend.profile.tp_size
        assert "version" in info
    async with s.get("/get_load") as r:
        loads = await r.json()
    assert len(loads) == backend.profile.dp_size
    assert set(loads[0]) >= {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"}
    async with s.get("/v1/loads") as r:
        v1 = await r.json()
    assert v1["loads"][0]["max_total_num_tokens"] == backend.profile.max_total_tokens
    assert v1["loads"][0]["num_running_reqs"] == 0
    async with s.get("/v1/loads?format=prometheus") as r:
        assert 'sglang_token_usage{dp_rank="0"} 0.0' in await r.text()
    for path in ("/health", "/health_generate", "/ping"):
        async with s.get(path) as r:
            assert r.status == 200, path
    async with s.post("/flush_cache") as r:
        assert r.status == 200
        assert (await r.text()).startswith("Cache flushed")


async def test_metrics_names_labels_and_counts(sim):
    s, backend = sim
    body = {"messages": MSGS, "max_tokens": 9, "ignore_eos": True, "stream": True}
    async with s.post(CHAT, json=body) as r:
        await r.read()
    async with s.get("/metrics") as r:
        assert r.status == 200
        text = await r.text()
    for name in (
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:token_usage",
        "sglang:num_used_tokens",
        "sglang:max_total_num_tokens",
        "sglang:gen_throughput",
        "sglang:prompt_tokens_total",
        "sglang:generation_tokens_total",
        "sglang:time_to_first_token_seconds_bucket",
        "sglang:inter_token_latency_seconds_bucket",
        "sglang:e2e_request_latency_seconds_bucket",
    ):
        assert name in text, name
    model = backend.model_name
    assert f'sglang:num_running_reqs{{engine_type="unified",model_name="{model}"' in text
    assert 'tp_rank="0"' in text and 'pp_rank="0"' in text
    samples = _samples(text)
    assert samples[f'sglang:e2e_request_latency_seconds_count{{model_name="{model}"}}'] == 1
    assert samples[f'sglang:generation_tokens_total{{model_name="{model}"}}'] >= 9
    # the scheduler gauges are the engine's logged (stale) values, not the live ones
    logged = backend.engine.logged_stats()
    key = next(k for k in samples if k.startswith("sglang:max_total_num_tokens{"))
    assert samples[key] == logged.max_total_num_tokens


async def test_metrics_one_series_per_dp_rank():
    async with running_sim("ep8") as (url, backend):
        async with aiohttp.ClientSession(url) as s:
            async with s.get("/metrics") as r:
                samples = _samples(await r.text())
            async with s.get("/get_load") as r:
                assert len(await r.json()) == backend.profile.dp_size
    dp = backend.profile.dp_size
    totals = [v for k, v in samples.items() if k.startswith("sglang:max_total_num_tokens{")]
    assert len(totals) == dp > 1
    assert sum(totals) == backend.engine.logged_stats().max_total_num_tokens
    keys = [k for k in samples if k.startswith("sglang:token_usage{")]
    ranks = {
        label: {k.split(f'{label}="')[1].split('"')[0] for k in keys}
        for label in ("dp_rank", "tp_rank", "moe_ep_rank")
    }
    # DP attention (tp 8, dp 8): each DP rank's scheduler is TP rank r and EP rank r, as SGLang's
    assert (
        ranks["dp_rank"] == ranks["tp_rank"] == ranks["moe_ep_rank"] == {str(r) for r in range(dp)}
    )
    assert all(f'dp_rank="{r}"' in k and f'tp_rank="{r}"' in k for k in keys for r in [_dp(k)])


async def test_without_metrics_only_metrics_is_404():
    # SGLang started without --enable-metrics: no /metrics, the rest as always
    async with running_sim("pp8", enable_metrics=False) as (url, backend):
        async with aiohttp.ClientSession(url) as s:
            async with s.get("/metrics") as r:
                assert r.status == 404
            async with s.get("/server_info") as r:
                info = await r.json()
            async with s.get("/get_load") as r:
                assert r.status == 200
    assert info["enable_metrics"] is False
    assert info["max_running_requests"] == backend.profile.max_running_requests


async def test_an_inference_only_server_says_nothing_of_itself_but_serves():
    # an OpenAI-compatible server that is not SGLang: inference, health and models only
    async with running_sim("pp8", inference_only=True) as (url, _backend):
        async with aiohttp.ClientSession(url) as s:
            for path in ("/metrics", "/server_info", "/get_server_info", "/v1/loads", "/get_load"):
                async with s.get(path) as r:
                    assert r.status == 404, path
            for path in ("/health", "/v1/models"):
                async with s.get(path) as r:
                    assert r.status == 200, path
            body = {"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            async with s.post("/v1/chat/completions", json=body) as r:
                assert r.status == 200
                assert (await r.json())["usage"]["completion_tokens"] == 2


async def test_max_running_left_to_the_scheduler_is_only_in_the_load_report():
    async with running_sim("ep8", max_running_arg=False) as (url, backend):
        async with aiohttp.ClientSession(url) as s:
            async with s.get("/server_info") as r:
                info = await r.json()
            async with s.get("/v1/loads") as r:
                loads = (await r.json())["loads"]
    assert info["max_running_requests"] is None
    assert len(loads) == backend.profile.dp_size > 1
    assert sum(row["max_running_requests"] for row in loads) == (
        backend.profile.max_running_requests
    )


def _dp(key: str) -> str:
    return key.split('dp_rank="')[1].split('"')[0]


def _samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


# ---- aborts -------------------------------------------------------------------------------


async def test_disconnect_mid_stream_aborts_in_engine(sim, caplog):
    caplog.set_level(logging.DEBUG)
    s, backend = sim
    body = {"text": "a", "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True},
            "stream": True}  # fmt: skip
    r = await s.post("/generate", json=body)
    await r.content.readuntil(b"\n\n")
    assert running(backend) == 1
    r.close()  # the client goes away
    await wait_until(lambda: running(backend) == 0)
    await asyncio.sleep(0)
    [record] = trace_lines(backend)
    assert record["finish"] == "disconnect"
    assert 0 < record["completion_tokens"] < 3000
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]


async def test_disconnect_non_stream_aborts_in_engine(sim):
    s, backend = sim
    body = {"messages": MSGS, "max_tokens": 3000, "ignore_eos": True}
    task = asyncio.create_task(s.post(CHAT, json=body))
    await wait_until(lambda: running(backend) == 1)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await wait_until(lambda: running(backend) == 0)


async def test_abort_request_by_rid_and_all(sim):
    s, backend = sim
    body = {"text": "a", "rid": "victim", "stream": True,
            "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}  # fmt: skip
    async with s.post("/generate", json=body) as r:
        await r.content.readuntil(b"\n\n")
        async with s.post("/abort_request", json={"rid": "victim"}) as a:
            assert a.status == 200
        rest = await r.read()
    chunks = [orjson.loads(p) for p in sse_payloads(rest)[:-1]]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    body["rid"] = "victim2"
    body["stream"] = False
    task = asyncio.create_task(s.post("/generate", json=body))
    await wait_until(lambda: running(backend) == 1)
    async with s.post("/abort_request", json={"abort_all": True}) as a:
        assert a.status == 200
    resp = await task
    out = await resp.json()
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    await wait_until(lambda: running(backend) == 0)


async def test_flush_cache_refused_while_busy(sim):
    s, backend = sim
    body = {"messages": MSGS, "max_tokens": 3000, "ignore_eos": True}
    task = asyncio.create_task(s.post(CHAT, json=body))
    await wait_until(lambda: running(backend) == 1)
    async with s.post("/flush_cache") as r:
        assert r.status == 400
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


# ---- trace, keep-alive, HTTP/2 preface ----------------------------------------------------


async def test_trace_records_true_times_and_counts(sim):
    s, backend = sim
    body = {"messages": MSGS, "max_tokens": 5, "ignore_eos": True, "stream": True}
    async with s.post(CHAT, json=body) as r:
        await r.read()
    async with s.post("/generate", json={"text": "a b", "sampling_params": {
            "max_new_tokens": 2, "ignore_eos": True}}) as r:  # fmt: skip
        await r.read()
    chat, gen = trace_lines(backend)
    assert chat["route"] == "chat" and gen["route"] == "generate"
    assert chat["arrival"] <= chat["first_token"] <= chat["last_token"] <= chat["end"]
    assert chat["completion_tokens"] == 5 and chat["finish"] == "length"
    assert gen["prompt_tokens"] == 2 and gen["completion_tokens"] == 2


async def test_idle_keepalive_connection_is_closed():
    async with running_sim("tp8", keepalive_s=0.2) as (_url, backend):
        reader, writer = await asyncio.open_connection("127.0.0.1", backend.port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: sim\r\n\r\n")
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        async with asyncio.timeout(5):
            assert await reader.read() == b""  # the server closed the idle connection
        writer.close()


async def test_http2_preface_is_refused_without_traceback(caplog):
    caplog.set_level(logging.DEBUG)
    async with running_sim("tp8") as (url, backend):
        reader, writer = await asyncio.open_connection("127.0.0.1", backend.port)
        writer.write(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        await writer.drain()
        async with asyncio.timeout(5):
            reply = await reader.read()
        writer.close()
        assert reply.startswith(b"HTTP/1.0 400") or reply.startswith(b"HTTP/1.1 400")
        async with aiohttp.ClientSession(url) as s, s.get("/health") as r:
            assert r.status == 200
    assert not any(r.exc_info for r in caplog.records)
    assert "Traceback" not in caplog.text


async def test_health_503_while_shutting_down(sim):
    s, backend = sim
    backend.status = "shutting_down"
    async with s.get("/health") as r:
        assert r.status == 503
    backend.status = "ready"


async def test_metrics_gauges_are_stale_like_sglang(sim):
    s, backend = sim
    body = {"text": "a b c", "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}}
    async with s.post("/generate", json=body) as r:
        assert (await r.json())["meta_info"]["completion_tokens"] == 5
    # fewer than decode_log_interval steps ran: the gauges still show the prefill log point
    async with s.get("/get_load") as r:
        assert (await r.json())[0]["num_reqs"] == 0  # the truth
    async with s.get("/metrics") as r:
        samples = _samples(await r.text())
    running_gauge = next(v for k, v in samples.items() if k.startswith("sglang:num_running_reqs{"))
    # SGLang's prefill log counts the running batch without the requests it prefills (0 here);
    # the KV gauge still shows the prefill log point although the request has finished
    assert running_gauge == backend.engine.logged_stats().num_running_reqs == 0
    used_gauge = next(v for k, v in samples.items() if k.startswith("sglang:num_used_tokens{"))
    assert used_gauge == backend.engine.logged_stats().num_used_tokens > 0


# ---- CLI ------------------------------------------------------------------------------------


def test_cli_pairs_profiles_and_ports():
    import argparse

    from loadtest.cli import CliError
    from loadtest.sim import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert cli.plan(parser.parse_args([])) == [("pp8", 30000)]
    args = parser.parse_args(["--profile", "pp8", "--profile", "tp8", "--port", "31000"])
    assert cli.plan(args) == [("pp8", 31000), ("tp8", 31001)]
    args = parser.parse_args(["--profile", "pp8", "--port", "5", "--profile", "tp8", "--port", "9"])
    assert cli.plan(args) == [("pp8", 5), ("tp8", 9)]
    for bad in (["--profile", "a", "--profile", "b", "--port", "1", "--port", "1"],
                ["--profile", "a", "--port", "1", "--port", "2", "--port", "3"]):  # fmt: skip
        with pytest.raises(CliError):
            cli.plan(parser.parse_args(bad))


def test_cli_user_errors_are_one_line(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(sys.executable).with_name("loadtest")  # the console script, as users run it
    if not script.exists():
        pytest.skip("loadtest console script not installed")
    for argv in (["--profile", "nope"], ["--time-scale", "0"], ["--fault-drop-rate", "7"]):
        r = subprocess.run(
            [str(script), "sim", *argv],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert r.returncode != 0
        assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr


# ---- when each route sends its headers (as SGLang's) ----------------------------------------


async def test_native_generate_stream_sends_headers_at_once_and_errors_inside_the_stream():
    async with running_sim("tp8", overrides={"max_total_tokens": 64}) as (url, _backend):
        async with aiohttp.ClientSession(url) as s:
            too_long = "word " * 200  # does not fit the 64-token KV pool
            body = {"text": too_long, "stream": True, "sampling_params": {"max_new_tokens": 4}}
            async with s.post("/generate", json=body) as r:
                assert r.status == 200
                events = sse_payloads(await r.read())
            assert events[-1] == b"[DONE]" and "error" in orjson.loads(events[0])
            body["stream"] = False
            async with s.post("/generate", json=body) as r:
                assert r.status == 400  # answered whole: an error status
            chat = {"messages": [{"role": "user", "content": too_long}], "stream": True}
            async with s.post(CHAT, json=chat) as r:
                assert r.status == 400  # OpenAI routes: headers only with the first chunk


async def test_a_queued_generate_stream_has_its_headers_a_queued_chat_stream_does_not():
    async with running_sim("tp8", overrides={"max_running_requests": 1}) as (url, backend):
        async with aiohttp.ClientSession(url) as s:
            params = {"max_new_tokens": 3000, "ignore_eos": True}
            first = {"text": "a", "stream": True, "sampling_params": params}
            busy = await s.post("/generate", json=first)
            await wait_until(lambda: running(backend) == 1)
            gen = asyncio.create_task(
                s.post("/generate", json={"text": "b", "stream": True, "sampling_params": params})
            )
            chat = asyncio.create_task(
                s.post(CHAT, json={"messages": MSGS, "stream": True, "max_tokens": 5})
            )
            await wait_until(lambda: backend.engine.live_stats().num_queue_reqs == 2)
            await wait_until(gen.done)  # headers while queued
            assert (await gen).status == 200 and not chat.done()
            busy.close()
            (await gen).close()
            async with await chat as r:  # once it runs, the chat stream's headers come
                assert r.status == 200
