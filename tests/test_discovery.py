"""Backends from DNS (proxy/discovery.py) on real sockets: a name resolving to 127.0.0.1 and
127.0.0.2 (an injected resolver, no DNS traffic) becomes two backends on the same port; an
address that leaves is drained and removed; a failed resolution keeps what is there."""

from __future__ import annotations

import aiohttp
from aiohttp import web
from conftest import free_port
from proxy_support import proxy_settings, wait_for

from proxy.app import ProxyServer
from proxy.backends import State


async def _upstream(host: str, port: int) -> web.AppRunner:
    async def chat(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"host": host, "usage": {"completion_tokens": 1}})

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


async def test_one_backend_per_resolved_address_added_and_drained_as_they_change():
    port = free_port()
    runners = [await _upstream(h, port) for h in ("127.0.0.1", "127.0.0.2")]
    answers: dict[str, list[str] | OSError] = {"sglang-headless": ["127.0.0.1"]}

    async def resolver(host: str, p: int) -> list[str]:
        assert p == port
        answer = answers[host]
        if isinstance(answer, OSError):
            raise answer
        return answer

    settings = proxy_settings(
        [{"url": f"http://sglang-headless:{port}", "name": "fleet", "discover": "dns",
          "discover_interval_s": 0.1}],
        scrape={"enabled": False},
    )  # fmt: skip
    server = ProxyServer(settings, resolver=resolver)
    await server.start()
    pool = server.proxy.pool
    try:
        assert pool.names() == ["fleet@127.0.0.1"]
        answers["sglang-headless"] = ["127.0.0.1", "127.0.0.2"]
        await wait_for(lambda: len(pool.names()) == 2)
        await wait_for(lambda: all(b.state is State.HEALTHY for b in pool.all()))
        seen = set()
        async with aiohttp.ClientSession() as s:
            for _ in range(6):
                async with s.post(server.url + "/v1/chat/completions", json={"messages": []}) as r:
                    assert r.status == 200
                    seen.add(r.headers["X-Pipefill-Backend"])
            assert seen == {"fleet@127.0.0.1", "fleet@127.0.0.2"}
            answers["sglang-headless"] = OSError("resolver down")  # nothing changes
            await wait_for(lambda: server.proxy.discovery._task is not None)
            answers["sglang-headless"] = ["127.0.0.2"]  # a pod left
            await wait_for(lambda: pool.names() == ["fleet@127.0.0.2"])
            async with s.post(server.url + "/v1/chat/completions", json={"messages": []}) as r:
                assert r.headers["X-Pipefill-Backend"] == "fleet@127.0.0.2"
        # SIGHUP reload keeps discovered backends (they follow their template)
        server.proxy.reload_backends(settings.backends)
        assert pool.names() == ["fleet@127.0.0.2"]
    finally:
        await server.stop(0.5)
        for r in runners:
            await r.cleanup()
