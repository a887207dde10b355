"""A tiny SGLang-shaped fake server for the load generator's unit tests.

It speaks the three APIs' response shapes (streaming and not), counts one token per output
chunk, tracks the peak number of requests in flight, and misbehaves on request: the
prompt/text word ``FAIL400``/``FAIL500`` gives that status, ``CUT`` ends the stream without
``[DONE]``, ``ERRCHUNK`` sends an in-stream error, ``NOUSAGE`` omits usage.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import orjson
from aiohttp import web


@dataclass
class FakeState:
    delay: float = 0.0  # seconds between chunks
    in_flight: int = 0
    peak: int = 0
    requests: int = 0
    bodies: list[dict] = field(default_factory=list)


def _prompt_of(body: dict) -> str:
    if "messages" in body:
        return " ".join(m.get("content", "") for m in body["messages"])
    return str(body.get("prompt", body.get("text", "")))


def make_app(state: FakeState) -> web.Application:
    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model"}]})

    async def handle(request: web.Request) -> web.StreamResponse:
        api = request.match_info.get("api", "generate")
        body = await request.json()
        state.bodies.append(body)
        state.requests += 1
        prompt = _prompt_of(body)
        words = prompt.split()
        if "FAIL400" in words:
            return web.json_response(
                {
                    "object": "error",
                    "message": "bad thing",
                    "type": "BadRequestError",
                    "param": None,
                    "code": 400,
                },
                status=400,
            )
        if "FAIL500" in words:
            return web.json_response({"error": {"message": "boom"}}, status=500)
        if api == "generate":
            n = body["sampling_params"]["max_new_tokens"]
        else:
            n = body["max_tokens"]
        usage_ok = "NOUSAGE" not in words
        state.in_flight += 1
        state.peak = max(state.peak, state.in_flight)
        try:
            if not body.get("stream"):
                await asyncio.sleep(state.delay * n)
                return web.json_response(_whole(api, n, len(words), usage_ok))
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            cont = bool((body.get("stream_options") or {}).get("continuous_usage_stats"))
            if api == "chat":
                await resp.write(_sse(_chat_chunk({"role": "assistant", "content": ""})))
            for i in range(1, n + 1):
                await asyncio.sleep(state.delay)
                if "ERRCHUNK" in words and i == 2:
                    await resp.write(_sse({"error": {"message": "went wrong", "code": 500}}))
                    break
                if "CUT" in words and i == 2:
                    return resp
                usage = {"prompt_tokens": len(words), "completion_tokens": i} if cont else None
                if api == "chat":
                    chunk = _chat_chunk({"content": f" w{i}"}, usage=usage)
                elif api == "completions":
                    chunk = {
                        "choices": [
                            {
                                "index": 0,
                                "text": f" w{i}",
                                "finish_reason": "length" if i == n else None,
                            }
                        ]
                    }
                    if usage:
                        chunk["usage"] = usage
                else:
                    chunk = {
                        "text": "x" * i,
                        "meta_info": {
                            "prompt_tokens": len(words),
                            "completion_tokens": i,
                            "finish_reason": {"type": "length", "length": n} if i == n else None,
                        },
                    }
                await resp.write(_sse(chunk))
            if api == "chat":
                await resp.write(_sse(_chat_chunk({}, finish="length")))
            if api != "generate" and usage_ok and body.get("stream_options"):
                await resp.write(
                    _sse(
                        {
                            "choices": [],
                            "usage": {"prompt_tokens": len(words), "completion_tokens": n},
                        }
                    )
                )
            await resp.write(b"data: [DONE]\n\n")
            return resp
        finally:
            state.in_flight -= 1

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/{api:chat}/completions", handle)
    app.router.add_post("/v1/{api:completions}", handle)
    app.router.add_post("/generate", handle)
    return app


def _sse(obj: dict) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _chat_chunk(delta: dict, finish: str | None = None, usage: dict | None = None) -> dict:
    chunk = {
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    if usage:
        chunk["usage"] = usage
    return chunk


def _whole(api: str, n: int, prompt: int, usage_ok: bool) -> dict:
    if api == "generate":
        return {
            "text": "x",
            "meta_info": {
                "prompt_tokens": prompt,
                "completion_tokens": n,
                "finish_reason": {"type": "length", "length": n},
            },
        }
    out: dict = {
        "choices": [
            {
                "index": 0,
                "finish_reason": "length",
                **({"message": {"content": "x"}} if api == "chat" else {"text": "x"}),
            }
        ]
    }
    if usage_ok:
        out["usage"] = {"prompt_tokens": prompt, "completion_tokens": n}
    return out


async def start_fake(state: FakeState, port: int) -> web.AppRunner:
    runner = web.AppRunner(make_app(state))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


class ThreadedFake:
    """The fake server on its own event loop in a thread (for tests that call the CLI)."""

    def __init__(self, state: FakeState, port: int) -> None:
        import threading

        self.state, self.port = state, port
        self.url = f"http://127.0.0.1:{port}"
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def __enter__(self) -> ThreadedFake:
        self._thread.start()
        self._runner = asyncio.run_coroutine_threadsafe(
            start_fake(self.state, self.port), self._loop
        ).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
