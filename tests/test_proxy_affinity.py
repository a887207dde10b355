"""Routing that keeps state where it is (proxy/affinity.py), on real sockets: by model and LoRA
adapter (model lists read again after an adapter load through the proxy, and on a timer), by
response id (/v1/responses), by session (/open_session). The simulator has no responses store,
sessions or adapters, so two fake upstreams answer in SGLang's shapes."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web
from proxy_support import running_proxy, wait_for

ADMIN = {"Authorization": "Bearer adm"}


class Stateful:
    def __init__(self, name: str, model: str) -> None:
        self.name = name
        self.models = [model]
        self.ids = itertools.count()
        self.url = ""

    def app(self) -> web.Application:
        app = web.Application()
        r = app.router
        r.add_get("/health", self.health)
        r.add_get("/v1/models", self.list_models)
        r.add_post("/load_lora_adapter", self.load)
        r.add_post("/v1/responses", self.respond)
        r.add_get("/v1/responses/{id}", self.served)
        r.add_post("/open_session", self.open_session)
        r.add_post("/close_session", self.served)
        r.add_post("/generate", self.served)
        r.add_post("/v1/chat/completions", self.served)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def list_models(self, request: web.Request) -> web.Response:
        cards = [{"id": m, "object": "model", "owned_by": "sglang"} for m in self.models]
        return web.json_response({"object": "list", "data": cards})

    async def load(self, request: web.Request) -> web.Response:
        self.models.append((await request.json())["lora_name"])
        return web.json_response({"success": True, "message": "Success."})

    async def respond(self, request: web.Request) -> web.Response:
        await request.read()
        rid = f"resp_{self.name}_{next(self.ids)}"
        return web.json_response({"id": rid, "object": "response", "usage": {"output_tokens": 1}})

    async def open_session(self, request: web.Request) -> web.Response:
        await request.read()
        return web.json_response(f"sess_{self.name}_{next(self.ids)}")  # SGLang: the id, a string

    async def served(self, request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"served_by": self.name})


@contextlib.asynccontextmanager
async def two_servers() -> AsyncIterator[tuple[Stateful, Stateful]]:
    ups = [Stateful("a", "model-a"), Stateful("b", "model-b")]
    runners = []
    try:
        for up in ups:
            runner = web.AppRunner(up.app(), access_log=None)
            await runner.setup()
            runners.append(runner)
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            up.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        yield ups[0], ups[1]
    finally:
        for runner in runners:
            await runner.cleanup()


@contextlib.asynccontextmanager
async def fleet(**extra) -> AsyncIterator[tuple[str, aiohttp.ClientSession, object]]:
    async with two_servers() as (a, b):
        async with running_proxy(
            [{"url": a.url, "name": "a"}, {"url": b.url, "name": "b"}],
            server={"admin_key": "adm"},
            scrape={"enabled": False},
            routing={"policy": "round_robin"},
            **extra,
        ) as px:
            await wait_for(lambda: all(b.models for b in px.proxy.pool.all()))
            async with aiohttp.ClientSession() as s:
                yield px.url, s, (px, a, b)


async def _served(s: aiohttp.ClientSession, method: str, url: str, **kw) -> tuple[int, str, object]:
    async with s.request(method, url, **kw) as r:
        return r.status, r.headers.get("X-Pipefill-Backend", ""), await r.json()


async def test_requests_go_to_the_backends_serving_their_model_or_adapter():
    async with fleet() as (url, s, _):
        chat = url + "/v1/chat/completions"
        for _ in range(4):
            _, backend, _ = await _served(
                s, "POST", chat, json={"model": "model-b", "messages": []}
            )
            assert backend == "b"
        seen = {
            (await _served(s, "POST", chat, json={"model": "other", "messages": []}))[1]
            for _ in range(4)
        }
        assert seen == {"a", "b"}  # a model nobody lists restricts nothing
        status, _, out = await _served(
            s,
            "POST",
            url + "/load_lora_adapter",
            json={"lora_name": "my-adapter", "lora_path": "/adapters/x"},
            headers={**ADMIN, "X-Pipefill-Backend": "a"},
        )
        assert status == 200 and out["backends"]["a"]["status"] == 200
        for _ in range(4):  # its model list was read again at once: the adapter routes to a
            body = {"text": "hi", "lora_path": "my-adapter"}
            assert (await _served(s, "POST", url + "/generate", json=body))[1] == "a"


async def test_model_lists_are_read_again_on_a_timer():
    async with fleet(health={"models_refresh_s": 0.1}) as (_url, _s, (px, _a, b)):
        b.models.append("loaded-elsewhere")
        backend = px.proxy.pool.get("b")
        await wait_for(lambda: any(m["id"] == "loaded-elsewhere" for m in backend.models))


async def test_responses_and_sessions_stay_where_they_were_made():
    async with fleet() as (url, s, _):
        _, first, out = await _served(s, "POST", url + "/v1/responses", json={"input": "hi"})
        rid = out["id"]
        for _ in range(4):
            body = {"input": "more", "previous_response_id": rid}
            assert (await _served(s, "POST", url + "/v1/responses", json=body))[1] == first
        assert (await _served(s, "GET", url + f"/v1/responses/{rid}"))[1] == first

        _, holder, sid = await _served(
            s, "POST", url + "/open_session", json={"capacity_of_str_len": 64}
        )
        assert isinstance(sid, str)
        for _ in range(4):
            body = {"text": "hi", "session_params": {"id": sid}}
            assert (await _served(s, "POST", url + "/generate", json=body))[1] == holder
        status, backend, _ = await _served(
            s, "POST", url + "/close_session", json={"session_id": sid}
        )
        assert (status, backend) == (200, holder)
