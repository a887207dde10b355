"""Helpers for the proxy tests: a tiny fake SGLang upstream and in-process proxies.

The fake speaks just enough of SGLang's API (OpenAI chat/completions SSE and JSON, /generate,
/health, /v1/models) and lets a test script its behaviour per request through headers:
``X-Fake-Status`` (answer that status with an SGLang error body), ``X-Fake-Die-After`` (close
the connection after N tokens), ``X-Fake-Stall-After`` (stop sending after N tokens),
``X-Fake-Delay`` (seconds between tokens), ``X-Fake-Tokens``. With ``prefix_cache`` set (a list
the fake fills), chat/completions answers report a prefix cache in SGLang's usage shape: 4
characters of the messages' text a token, cached what an earlier prompt shares with this one.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from aiohttp import web

from proxy.app import ProxyServer
from proxy.scrape import USER_AGENT
from proxy.settings import load_settings

MODEL = "fake-model"


class FakeUpstream:
    def __init__(self, name: str = "fake") -> None:
        self.name = name
        self.healthy = True
        self.running = 0
        self.started = 0
        self.cancelled = 0
        self.requests: list[dict[str, Any]] = []
        self.fail_next: list[int] = []  # statuses for the next requests
        #: chat/completions wait this long before answering (SGLang sends a stream's headers with
        #: its first token, so a request it queues shows nothing); ``held``: waiting now
        self.hold_s = 0.0
        self.held = 0
        #: prompts seen (their text), when this fake reports a prefix cache; None: it does not
        self.prefix_cache: list[str] | None = None
        self.runner: web.AppRunner | None = None
        self.port: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/health_generate", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/get_model_info", self.model_info)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.chat)
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/v1/embeddings", self.embeddings)
        app.router.add_get("/get_server_info", self.server_info)
        app.router.add_route("*", "/flush_cache", self.flush_cache)
        app.router.add_route("*", "/{tail:.*}", self.other)  # any other path: recorded, 200
        return app

    async def start(self, port: int = 0) -> FakeUpstream:
        self.runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    async def health(self, request: web.Request) -> web.Response:
        if not self.healthy:
            return web.Response(status=503)
        return web.Response(text="")

    async def models(self, request: web.Request) -> web.Response:
        card = {
            "id": MODEL,
            "object": "model",
            "created": 0,
            "owned_by": "sglang",
            "root": MODEL,
            "parent": None,
            "max_model_len": 4096,
        }
        return web.json_response({"object": "list", "data": [card]})

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": MODEL, "served_by": self.name})

    async def server_info(self, request: web.Request) -> web.Response:
        if request.headers.get("User-Agent") == USER_AGENT:
            return web.Response(status=404)  # the proxy's scraper: nothing to say
        self.requests.append({"path": request.path, "headers": dict(request.headers)})
        return web.json_response({"api_key": "backend-secret", "served_by": self.name})

    async def flush_cache(self, request: web.Request) -> web.Response:
        self.requests.append({"path": request.path, "headers": dict(request.headers)})
        if self.running:  # as SGLang: refused while requests run
            return web.Response(status=400, text="Cache not flushed: requests are running.\n")
        return web.Response(text="Cache flushed.\n")

    async def other(self, request: web.Request) -> web.Response:
        await request.read()
        if request.headers.get("User-Agent") == USER_AGENT:
            return web.Response(status=404)  # the proxy's scraper: no metrics, no load report
        self.requests.append({"path": request.path, "headers": dict(request.headers)})
        return web.json_response({"path": request.path, "served_by": self.name})

    async def embeddings(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append({"body": body, "headers": dict(request.headers)})
        return web.json_response(
            {
                "object": "list",
                "model": MODEL,
                "data": [{"object": "embedding", "index": 0, "embedding": [0.1, 0.2]}],
                "usage": {"prompt_tokens": 2, "total_tokens": 2},
            }
        )

    def _script(self, request: web.Request) -> dict[str, Any]:
        h = request.headers
        status = int(h.get("X-Fake-Status", 0)) or (self.fail_next.pop(0) if self.fail_next else 0)
        return {
            "status": status,
            "die_after": int(h["X-Fake-Die-After"]) if "X-Fake-Die-After" in h else None,
            "stall_after": int(h["X-Fake-Stall-After"]) if "X-Fake-Stall-After" in h else None,
            "delay": float(h.get("X-Fake-Delay", 0)),
            "tokens": int(h.get("X-Fake-Tokens", 0)),
        }

    def prompt_usage(self, body: dict) -> dict:
        """``prompt_tokens`` (and, with a prefix cache, ``prompt_tokens_details``) of a body."""
        if self.prefix_cache is None:
            return {"prompt_tokens": 3}
        text = "".join(f"{m.get('role')}:{m.get('content')}|" for m in body.get("messages", []))
        text = text or str(body.get("prompt", ""))
        common = max((_common(text, seen) for seen in self.prefix_cache), default=0)
        self.prefix_cache.append(text)
        tokens = max(len(text) // 4, 1)
        return {"prompt_tokens": tokens, "prompt_tokens_details": {"cached_tokens": common // 4}}

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append({"body": body, "headers": dict(request.headers), "path": request.path})
        prompt_usage = self.prompt_usage(body)
        s = self._script(request)
        if s["status"]:
            return web.json_response(
                {
                    "object": "error",
                    "message": f"injected {s['status']}",
                    "type": "BadRequestError",
                    "param": None,
                    "code": s["status"],
                },
                status=s["status"],
            )
        chat = request.path.endswith("chat/completions")
        n = s["tokens"] or int(body.get("max_tokens") or 4)
        words = [f" w{i}" for i in range(n)]
        if self.hold_s:
            self.held += 1
            try:
                await asyncio.sleep(self.hold_s)
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
            finally:
                self.held -= 1
        if not body.get("stream"):
            text = "".join(words)
            choice = (
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "length",
                }
                if chat
                else {"index": 0, "text": text, "finish_reason": "length"}
            )
            return web.json_response(
                {
                    "id": "x",
                    "object": "chat.completion" if chat else "text_completion",
                    "created": 0,
                    "model": MODEL,
                    "choices": [choice],
                    "usage": {**prompt_usage, "completion_tokens": n, "total_tokens": n + 3},
                }
            )
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "X-Upstream": self.name}
        )
        self.running += 1
        self.started += 1
        try:
            await resp.prepare(request)

            async def send(obj: dict) -> None:
                await resp.write(b"data: " + orjson.dumps(obj) + b"\n\n")

            base = {
                "id": "x",
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": 0,
                "model": MODEL,
            }
            if chat:
                await send(
                    {
                        **base,
                        "choices": [
                            {
                                "index": 0,
                                "delta": {"role": "assistant", "content": ""},
                                "finish_reason": None,
                            }
                        ],
                    }
                )
            for i, w in enumerate(words):
                if s["die_after"] is not None and i >= s["die_after"]:
                    request.transport.close()  # type: ignore[union-attr]
                    return resp
                if s["stall_after"] is not None and i >= s["stall_after"]:
                    await asyncio.sleep(3600)
                if s["delay"]:
                    await asyncio.sleep(s["delay"])
                choice = (
                    {"index": 0, "delta": {"content": w}, "finish_reason": None}
                    if chat
                    else {"index": 0, "text": w, "finish_reason": None}
                )
                await send({**base, "choices": [choice]})
            if chat:
                await send(
                    {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
                )
            if (body.get("stream_options") or {}).get("include_usage"):
                await send(
                    {
                        **base,
                        "choices": [],
                        "usage": {
                            **prompt_usage,
                            "completion_tokens": n,
                            "total_tokens": n + 3,
                        },
                    }
                )
            await resp.write(b"data: [DONE]\n\n")
            return resp
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.running -= 1

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append({"body": body, "headers": dict(request.headers), "path": request.path})
        n = int((body.get("sampling_params") or {}).get("max_new_tokens", 3))

        def item(k: int, done: bool) -> dict:
            return {
                "text": " w" * k,
                "output_ids": list(range(k)),
                "meta_info": {
                    "id": "r",
                    "prompt_tokens": 2,
                    "completion_tokens": k,
                    "finish_reason": {"type": "length", "length": n} if done else None,
                },
            }

        if not body.get("stream"):
            return web.json_response(item(n, True))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for k in range(1, n + 1):
            await resp.write(b"data: " + orjson.dumps(item(k, k == n)) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp


def _common(a: str, b: str) -> int:
    """Length of the longest common prefix of two strings."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def proxy_settings(backends: list[str], **sections: Any):
    """Settings for a test proxy on a free port with fast health checks."""
    sections.setdefault("server", {})
    sections["server"] = {"port": 0, **sections["server"]}
    health = {"interval_s": 0.2, "timeout_s": 1.0, "eject_s": 0.5, **sections.pop("health", {})}
    retries = {"backoff_base_s": 0.0, **sections.pop("retries", {})}
    return load_settings(
        None,
        backends=[{"url": u} if isinstance(u, str) else u for u in backends],
        health=health,
        retries=retries,
        **sections,
    )


@contextlib.asynccontextmanager
async def running_proxy(backends: list[str], **sections: Any) -> AsyncIterator[ProxyServer]:
    server = ProxyServer(proxy_settings(backends, **sections))
    await server.start()
    try:
        yield server
    finally:
        await server.stop(0.5)


@contextlib.asynccontextmanager
async def fakes(n: int = 1) -> AsyncIterator[list[FakeUpstream]]:
    ups = [await FakeUpstream(f"fake{i}").start() for i in range(n)]
    try:
        yield ups
    finally:
        for u in ups:
            await u.stop()


async def wait_for(predicate, within: float = 5.0, interval: float = 0.02) -> None:
    deadline = time.monotonic() + within
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(interval)
