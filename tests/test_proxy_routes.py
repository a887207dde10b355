"""Every generation route SGLang serves is admitted, with its stream format's tokens counted, and
a request of N sequences holds N of a backend's slots: on real sockets, through the proxy, in
front of the simulator (native /generate batches) and of a fake upstream that answers the
Anthropic, Responses, Ollama, SageMaker and Vertex routes in SGLang's shapes (the simulator
does not serve those)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest
from aiohttp import web
from proxy_support import running_proxy, wait_for
from sim_util import running_sim

TOKENS = ("to", "ken", "s")  # every fake answer generates these three tokens


def _sse(event: str | None, obj: dict) -> bytes:
    head = b"event: " + event.encode() + b"\n" if event else b""
    return head + b"data: " + orjson.dumps(obj) + b"\n\n"


def _messages_events() -> list[bytes]:
    """Anthropic Messages as SGLang's AnthropicServing streams it."""
    out = [
        _sse(
            "message_start",
            {
                "type": "message_start",
                "message": {
                    "id": "msg_1",
                    "content": [],
                    "usage": {"input_tokens": 5, "output_tokens": 0},
                },
            },
        )
    ]
    out.append(
        _sse(
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            },
        )
    )
    for t in TOKENS:
        out.append(
            _sse(
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": 0,
                    "delta": {"type": "text_delta", "text": t},
                },
            )
        )
    out.append(_sse("content_block_stop", {"type": "content_block_stop", "index": 0}))
    out.append(
        _sse(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": "max_tokens"},
                "usage": {"input_tokens": 5, "output_tokens": 3},
            },
        )
    )
    out.append(_sse("message_stop", {"type": "message_stop"}))
    return out


def _responses_events() -> list[bytes]:
    out = [
        _sse(
            "response.created",
            {"type": "response.created", "response": {"id": "resp_1", "status": "in_progress"}},
        )
    ]
    for t in TOKENS:
        out.append(
            _sse("response.output_text.delta", {"type": "response.output_text.delta", "delta": t})
        )
    out.append(
        _sse(
            "response.completed",
            {
                "type": "response.completed",
                "response": {"id": "resp_1", "usage": {"input_tokens": 5, "output_tokens": 3}},
            },
        )
    )
    return out


def _ollama_lines(field: str) -> list[bytes]:
    def one(text: str, done: bool) -> bytes:
        value = {"role": "assistant", "content": text} if field == "message" else text
        line = {"model": "m", "created_at": "2026-01-01T00:00:00.000Z", field: value, "done": done}
        if done:
            line["done_reason"] = "stop"
        return orjson.dumps(line) + b"\n"

    return [one(t, False) for t in TOKENS] + [one("", True)]


def _chat_events() -> list[bytes]:
    base = {"id": "x", "object": "chat.completion.chunk", "model": "m"}
    out = [
        _sse(
            None, {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
        )
    ]
    for t in TOKENS:
        out.append(_sse(None, {**base, "choices": [{"index": 0, "delta": {"content": t}}]}))
    out.append(b"data: [DONE]\n\n")
    return out


WHOLE = {
    "/v1/messages": {
        "id": "msg_1",
        "type": "message",
        "content": [{"type": "text", "text": "tokens"}],
        "usage": {"input_tokens": 5, "output_tokens": 3},
    },
    "/v1/responses": {
        "id": "resp_1",
        "object": "response",
        "usage": {"input_tokens": 5, "output_tokens": 3},
    },
    "/api/chat": {
        "model": "m",
        "message": {"role": "assistant", "content": "tokens"},
        "done": True,
        "eval_count": 3,
    },
    "/api/generate": {"model": "m", "response": "tokens", "done": True, "eval_count": 3},
    "/invocations": {
        "id": "x",
        "object": "chat.completion",
        "choices": [],
        "usage": {"prompt_tokens": 5, "completion_tokens": 3},
    },
    "/vertex_generate": {
        "predictions": [{"text": "tok", "meta_info": {"completion_tokens": 1}}] * 3
    },
}
STREAMS = {
    "/v1/messages": ("text/event-stream", _messages_events),
    "/v1/responses": ("text/event-stream", _responses_events),
    "/api/chat": ("application/x-ndjson", lambda: _ollama_lines("message")),
    "/api/generate": ("application/x-ndjson", lambda: _ollama_lines("response")),
    "/invocations": ("text/event-stream", _chat_events),
}


class FormatsUpstream:
    """Answers each route in its format; ``hold``: streams wait on it before their events."""

    def __init__(self) -> None:
        self.hold = asyncio.Event()
        self.hold.set()
        self.seen: list[str] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append(request.path)
        default = request.path.startswith("/api/")  # Ollama streams unless told not to
        if request.path not in STREAMS or not body.get("stream", default):
            return web.json_response(WHOLE[request.path])
        ctype, events = STREAMS[request.path]
        await self.hold.wait()
        resp = web.StreamResponse(headers={"Content-Type": ctype})
        await resp.prepare(request)
        for e in events():
            await resp.write(e)
        return resp

    async def health(self, request: web.Request) -> web.Response:
        return web.Response()


@contextlib.asynccontextmanager
async def formats_upstream() -> AsyncIterator[tuple[FormatsUpstream, str]]:
    up = FormatsUpstream()
    app = web.Application()
    app.router.add_get("/health", up.health)
    app.router.add_post("/{path:.*}", up.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield up, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def _tokens(px, name: str) -> float:
    value = px.proxy.metrics.registry.get_sample_value(
        "pipefill_output_tokens_total", {"backend": name}
    )
    return value or 0.0


def _requests(px, route: str) -> float:
    value = px.proxy.metrics.registry.get_sample_value(
        "pipefill_requests_total", {"backend": "up", "route": route, "status": "200"}
    )
    return value or 0.0


BODIES = {
    "/v1/messages": {
        "model": "m",
        "max_tokens": 3,
        "messages": [{"role": "user", "content": "hi"}],
    },
    "/v1/responses": {"model": "m", "input": "hi"},
    "/api/chat": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    "/api/generate": {"model": "m", "prompt": "hi"},
    "/invocations": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    "/vertex_generate": {"instances": [{"text": "a"}, {"text": "b"}, {"text": "c"}]},
}


@pytest.mark.parametrize("path", sorted(BODIES))
@pytest.mark.parametrize("stream", [True, False])
async def test_every_generation_route_is_admitted_with_its_tokens_counted(path, stream):
    if stream and path not in STREAMS:
        pytest.skip("answered whole only")
    body = dict(BODIES[path])
    if path.startswith("/api/"):
        body["stream"] = stream  # Ollama streams by default: say it both ways
    elif stream:
        body["stream"] = True
    async with formats_upstream() as (up, url):
        async with running_proxy(
            [{"url": url, "name": "up"}],
            limits={"algorithm": "fixed", "initial": 1},
            scrape={"enabled": False},
        ) as px:
            async with aiohttp.ClientSession() as s:
                up.hold.clear()
                first = asyncio.create_task(s.post(px.url + path, json=body))
                if stream:  # the first holds the backend's only slot: the second waits
                    await wait_for(lambda: px.proxy.pool.get("up").in_flight == 1)
                    second = asyncio.create_task(s.post(px.url + path, json=body))
                    await wait_for(lambda: px.proxy.admission.depth == 1)
                    assert len(up.seen) == 1
                up.hold.set()
                answers = [await first] + ([await second] if stream else [])
                for r in answers:
                    raw = await r.read()
                    assert r.status == 200 and raw
                    assert r.headers["X-Pipefill-Backend"] == "up"
            assert _tokens(px, "up") == 3 * len(answers)  # each stream's or body's own count
            assert _requests(px, path) == len(answers)  # labelled as an admitted route


async def test_a_generate_batch_holds_one_slot_per_prompt_on_the_simulator():
    async with running_sim("tp8", time_scale=0.05) as (url, _sim):
        async with running_proxy(
            [{"url": url, "name": "tp8"}],
            limits={"algorithm": "fixed", "initial": 4},
            scrape={"enabled": False},
        ) as px:
            b = px.proxy.pool.get("tp8")
            params = {"max_new_tokens": 20000, "ignore_eos": True}
            batch = {"text": ["a", "b", "c"], "sampling_params": params, "stream": True}
            async with aiohttp.ClientSession() as s:
                warm = {"text": "w", "sampling_params": {"max_new_tokens": 1}}
                async with s.post(px.url + "/generate", json=warm) as r:  # its first answer
                    assert r.status == 200  # makes the backend trusted past the probe's one slot
                r = await s.post(px.url + "/generate", json=batch)
                assert r.status == 200
                await r.content.readline()  # streaming: all three run
                assert b.in_flight == 3
                one = await s.post(
                    px.url + "/generate",
                    json={"text": "d", "sampling_params": {"max_new_tokens": 1}},
                )
                assert one.status == 200 and b.in_flight == 3  # one more fit beside them
                await one.read()
                n2 = {"text": "e", "sampling_params": {**params, "n": 2}, "stream": True}
                waiting = asyncio.create_task(s.post(px.url + "/generate", json=n2))
                await wait_for(lambda: px.proxy.admission.depth == 1)
                assert b.in_flight == 3  # n=2 is two sequences: they do not fit in one slot
                r.close()  # the batch ends (its client left): its three slots free
                second = await waiting
                assert second.status == 200
                await second.content.readline()
                assert b.in_flight == 2
                second.close()
            await wait_for(lambda: b.in_flight == 0)
