"""Attacks on the proxy, each reproduced on real sockets (issue 15): no client can take a backend
out of service, reach what it should not, or make the proxy fail in ways it should not."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import socket

import aiohttp
import orjson
from aiohttp import web
from proxy_support import MODEL, fakes, proxy_settings, running_proxy, wait_for
from test_proxy_forward import _HandLimit

from proxy.app import ProxyServer
from proxy.backends import State


async def _raw(port: int, data: bytes, within: float = 10.0) -> bytes:
    """Send raw bytes, read until the proxy closes the connection (``Connection: close``)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), within)
    finally:
        writer.close()


def _status_and_body(out: bytes) -> tuple[int, bytes]:
    head, _, body = out.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def _error(body: bytes) -> dict:
    err = orjson.loads(body)["error"]
    assert {"message", "type", "code"} <= set(err), err
    return err


async def _post(url: str, body: dict, headers: dict | None = None):
    async with (
        aiohttp.ClientSession() as s,
        s.post(url, data=orjson.dumps(body), headers=headers) as r,
    ):
        return r, await r.read()


async def _get(url: str, headers: dict | None = None):
    async with aiohttp.ClientSession() as s, s.get(url, headers=headers) as r:
        return r, await r.read()


# ---- 1: request targets, local errors, what error bodies show ------------------------------


async def test_non_origin_form_targets_are_400_and_never_eject_a_backend():
    async with (
        fakes(1) as (up,),
        running_proxy([up.url], health={"interval_s": 30, "passive_failures": 2}) as px,
    ):
        (b,) = px.proxy.pool.all()
        targets = [
            b"GET http://127.0.0.1:1/get_model_info HTTP/1.1",
            b"POST http://127.0.0.1:1/v1/chat/completions HTTP/1.1",
            b"GET //127.0.0.1:1/get_model_info HTTP/1.1",
            b"OPTIONS * HTTP/1.1",
            b"GET /v1/models/%2E%2E/%2E%2E/get_model_info HTTP/1.1",
        ]
        for _ in range(3):
            for line in targets:
                body = orjson.dumps({"model": MODEL, "messages": []})
                out = await _raw(
                    px.port,
                    line + b"\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json"
                    b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body),
                )
                status, err = _status_and_body(out)
                assert status == 400, (line, out)
                assert _error(err)["code"] == "invalid_target"
        assert up.requests == []
        assert b.state is State.HEALTHY and b.consecutive_failures == 0
        r, _ = await _post(px.url + "/v1/chat/completions", {"model": MODEL, "messages": []})
        assert r.status == 200
        metrics = (await _get(px.url + "/metrics"))[1].decode()
        assert "pipefill_upstream_errors_total{" not in metrics
        assert "pipefill_backend_ejections_total{" not in metrics


async def test_a_local_error_is_500_and_never_counts_against_the_backend(monkeypatch):
    """An exception raised on the proxy's side (here: a bug while opening the upstream
    connection) is the proxy's fault: no retry, no health change, no backend stats, and its
    text stays in the log."""
    async with (
        fakes(2) as ups,
        running_proxy([u.url for u in ups], health={"interval_s": 30, "passive_failures": 2}) as px,
    ):
        upstream = px.proxy.forwarder.upstream

        async def broken(*args, **kwargs):
            raise ValueError("http://secret-host:1234/oops")

        monkeypatch.setattr(upstream, "connect", broken)
        for _ in range(4):
            r, body = await _post(px.url + "/v1/chat/completions", {"model": MODEL, "messages": []})
            assert r.status == 500
            err = _error(body)
            assert err["code"] == "internal_error"
            assert b"secret-host" not in body and b"127.0.0.1" not in body
        for b in px.proxy.pool.all():
            assert b.state is State.HEALTHY and b.consecutive_failures == 0
            assert b.stats.snapshot()["awaiting_first_token"] == 0
        metrics = (await _get(px.url + "/metrics"))[1].decode()
        assert "pipefill_upstream_errors_total{" not in metrics
        assert "pipefill_retries_total{" not in metrics
        assert sum(len(u.requests) for u in ups) == 0


async def test_error_bodies_never_show_backend_addresses():
    async with fakes(1) as (up,), running_proxy([up.url], retries={"max_attempts": 1}) as px:
        # the backend closes the connection before its first chunk: a 502 made by the proxy
        r, body = await _post(
            px.url + "/v1/completions",
            {"model": MODEL, "prompt": "x", "stream": True},
            headers={"X-Fake-Die-After": "0"},
        )
        assert r.status == 502
        assert _error(body)["code"] == "upstream_error"
        assert str(up.port).encode() not in body and b"127.0.0.1" not in body
        # ... and after its first chunk: the SSE error event
        r, body = await _post(
            px.url + "/v1/chat/completions",
            {"model": MODEL, "messages": [], "stream": True, "max_tokens": 5},
            headers={"X-Fake-Die-After": "2"},
        )
        assert r.status == 200
        events = [e for e in body.split(b"\n\n") if e]
        assert _error(events[-2].removeprefix(b"data: "))["code"] == "upstream_error"
        assert str(up.port).encode() not in body and b"127.0.0.1" not in body


# ---- 2: an allow-list of forwarded routes ---------------------------------------------------


async def test_unknown_routes_are_404_and_never_forwarded():
    async with fakes(1) as (up,), running_proxy([up.url]) as px:
        for method, path in [
            ("GET", "/no_such_route"),
            ("POST", "/generate_from_file"),
            ("GET", "/openapi.json"),
            ("DELETE", "/v1/models"),
            ("POST", "/sim/faults"),
        ]:
            async with aiohttp.ClientSession() as s, s.request(method, px.url + path) as r:
                body = await r.read()
                assert r.status in (404, 405), (method, path)
                _error(body)
        assert up.requests == []


async def test_management_routes_need_the_admin_key():
    async with (
        fakes(1) as (up,),
        running_proxy([up.url], server={"api_keys": ["client"], "admin_key": "admin"}) as px,
    ):
        client = {"Authorization": "Bearer client"}
        for method, path in [
            ("POST", "/flush_cache"),
            ("POST", "/abort_request"),
            ("GET", "/get_server_info"),
            ("GET", "/server_info"),
            ("POST", "/update_weights_from_disk"),
            ("POST", "/start_profile"),
            ("POST", "/pause_generation"),
            ("POST", "/load_lora_adapter"),
            ("POST", "/init_weights_update_group"),
        ]:
            for headers in (client, {}):
                async with (
                    aiohttp.ClientSession() as s,
                    s.request(method, px.url + path, json={}, headers=headers) as r,
                ):
                    assert r.status == 401, (method, path)
                    assert _error(await r.read())["code"] == "invalid_admin_key"
        assert up.requests == []
        # read-only information passes with a client key
        r, body = await _get(px.url + "/get_model_info", headers=client)
        assert r.status == 200 and orjson.loads(body)["served_by"] == "fake0"
        # the admin key opens them, and is not sent upstream
        r, body = await _get(px.url + "/get_server_info", headers={"Authorization": "Bearer admin"})
        assert r.status == 200 and orjson.loads(body)["served_by"] == "fake0"
        assert "Authorization" not in up.requests[-1]["headers"]
    async with fakes(1) as (up,), running_proxy([up.url]) as px:  # open mode, no admin key
        r, body = await _post(px.url + "/flush_cache", {})
        assert r.status == 403 and _error(body)["code"] == "admin_disabled"
        r, body = await _get(px.url + "/get_server_info")
        assert r.status == 403
        assert up.requests == []


async def test_flush_cache_fans_out_to_every_backend():
    async with (
        fakes(3) as ups,
        running_proxy([u.url for u in ups], server={"admin_key": "admin"}) as px,
    ):
        admin = {"Authorization": "Bearer admin"}
        r, body = await _post(px.url + "/flush_cache", {}, headers=admin)
        assert r.status == 200
        out = orjson.loads(body)
        names = {b.name for b in px.proxy.pool.all()}
        assert out["ok"] is True and set(out["backends"]) == names
        assert all(v["status"] == 200 for v in out["backends"].values())
        assert [len(u.requests) for u in ups] == [1, 1, 1]
        # one backend refuses (busy): the combined answer says which, and is not a success
        ups[1].running = 1
        r, body = await _post(px.url + "/flush_cache", {}, headers=admin)
        out = orjson.loads(body)
        assert r.status == 502 and out["ok"] is False
        assert _error(body)["code"] == "fanout_failed"
        busy = f"127.0.0.1:{ups[1].port}"
        assert out["backends"][busy]["status"] == 400
        ups[1].running = 0
        # the backend header narrows it to one backend
        r, body = await _post(
            px.url + "/flush_cache", {}, headers={**admin, "X-Pipefill-Backend": busy}
        )
        assert r.status == 200 and list(orjson.loads(body)["backends"]) == [busy]
        r, body = await _post(
            px.url + "/flush_cache", {}, headers={**admin, "X-Pipefill-Backend": "nope"}
        )
        assert r.status == 404 and _error(body)["code"] == "backend_not_found"
        for b in px.proxy.pool.all():  # admin calls are not traffic: no health, no stats
            assert b.state is State.HEALTHY and b.consecutive_failures == 0


# ---- 3 (Medium 8): a header that is not UTF-8 ------------------------------------------------


async def test_non_utf8_authorization_is_401_and_other_headers_400():
    body = orjson.dumps({"model": MODEL, "messages": []})
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        b"Content-Type: application/json\r\n%s\r\nContent-Length: %d\r\n\r\n%s"
    )
    for server in ({"api_keys": ["k"]}, {"admin_key": "a"}, {}):
        async with fakes(1) as (up,), running_proxy([up.url], server=server) as px:
            for path in (b"/v1/chat/completions", b"/admin/backends", b"/metrics"):
                head = request.replace(b"/v1/chat/completions", path, 1)
                out = await _raw(
                    px.port, head % (b"Authorization: Bearer \xff\xfe", len(body), body)
                )
                status, err = _status_and_body(out)
                assert status == 401, (server, path, out)
                assert _error(err)["code"] == "invalid_api_key"
                assert b"Traceback" not in out
            out = await _raw(px.port, request % (b"X-Note: caf\xe9", len(body), body))
            status, err = _status_and_body(out)
            assert status == 400 and _error(err)["code"] == "invalid_header"
            assert up.requests == []


# ---- 4 (Medium 9): the priority header may only lower priority ---------------------------------


async def test_priority_header_cannot_lift_a_batch_key():
    async with (
        fakes(1) as (up,),
        running_proxy(
            [up.url],
            server={"api_keys": ["batchkey", "userkey"]},
            queue={"batch_api_keys": ["batchkey"]},
            limits={"algorithm": "fixed", "initial": 1},
        ) as px,
    ):
        url = px.url + "/v1/chat/completions"
        user = {"Authorization": "Bearer userkey"}
        first = asyncio.create_task(_post(
            url, {"messages": [], "stream": True, "max_tokens": 10, "tag": "first"},
            headers={**user, "X-Fake-Delay": "0.03"},
        ))  # fmt: skip
        await wait_for(lambda: up.running == 1)
        lifted = asyncio.create_task(_post(
            url, {"messages": [], "tag": "batch-key"},
            headers={"Authorization": "Bearer batchkey", "X-Priority": "interactive"},
        ))  # fmt: skip
        await wait_for(lambda: px.proxy.admission.depth == 1)
        later = asyncio.create_task(_post(url, {"messages": [], "tag": "user"}, headers=user))
        await wait_for(lambda: px.proxy.admission.depth == 2)
        for t in (first, lifted, later):
            r, _ = await t
            assert r.status == 200
        assert [q["body"].get("tag") for q in up.requests] == ["first", "user", "batch-key"]


# ---- 5 (Medium 10): /admin/* and /metrics ---------------------------------------------------


async def test_admin_reads_need_the_admin_key_whenever_a_key_is_set():
    async with fakes(1) as (up,):
        async with running_proxy([up.url], server={"api_keys": ["client"]}) as px:
            for headers in ({}, {"Authorization": "Bearer client"}):
                for path in (
                    "/admin/backends",
                    "/admin/queue",
                    f"/admin/backends/127.0.0.1:{up.port}",
                ):
                    r, body = await _get(px.url + path, headers=headers)
                    assert r.status == 403, (path, headers)
                    assert _error(body)["code"] == "admin_disabled"
        async with running_proxy([up.url], server={"admin_key": "admin"}) as px:
            r, body = await _get(px.url + "/admin/backends")
            assert r.status == 401 and _error(body)["code"] == "invalid_admin_key"
            r, body = await _get(
                px.url + "/admin/backends", headers={"Authorization": "Bearer admin"}
            )
            assert r.status == 200 and orjson.loads(body)["backends"][0]["url"] == up.url
        async with running_proxy([up.url]) as px:  # no key at all: read-only, no backend URL
            for path in ("/admin/backends", f"/admin/backends/127.0.0.1:{up.port}"):
                r, body = await _get(px.url + path)
                assert r.status == 200
                assert up.url.encode() not in body and b"http://" not in body
            out = orjson.loads((await _get(px.url + "/admin/backends"))[1])
            assert out["backends"][0]["state"] == "healthy" and "url" not in out["backends"][0]


async def test_metrics_need_a_key_when_keys_are_set_unless_explicitly_public():
    async with fakes(1) as (up,):
        async with running_proxy([up.url], server={"api_keys": ["client"], "admin_key": "a"}) as px:
            r, body = await _get(px.url + "/metrics")
            assert r.status == 401 and _error(body)["code"] == "invalid_api_key"
            for key in ("client", "a"):
                r, _ = await _get(px.url + "/metrics", headers={"Authorization": f"Bearer {key}"})
                assert r.status == 200
        async with running_proxy(
            [up.url], server={"api_keys": ["client"], "metrics_public": True}
        ) as px:
            r, _ = await _get(px.url + "/metrics")
            assert r.status == 200
        async with running_proxy([up.url]) as px:  # open mode: public
            r, _ = await _get(px.url + "/metrics")
            assert r.status == 200


# ---- 6 (Medium 6): upstream events of unexpected shape ----------------------------------------


@contextlib.asynccontextmanager
async def _sse_upstream(payloads: dict[str, bytes]):
    """An upstream that answers each path in ``payloads`` with those bytes as an SSE stream."""

    async def stream(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for line in payloads[request.path].split(b"\n\n"):
            if line:
                await resp.write(line + b"\n\n")
                await asyncio.sleep(0)
        return resp

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/health", ok)
    for path in payloads:
        app.router.add_post(path, stream)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    finally:
        await runner.cleanup()


async def test_events_of_unexpected_shape_are_counted_malformed_and_relayed():
    chat = (
        b'data: {"choices":5}\n\n'
        b'data: {"choices":[{"delta":"x"}]}\n\n'
        b'data: {"choices":[7]}\n\n'
        b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
        b"data: [DONE]\n\n"
    )
    generate = (
        b'data: {"text":"a","index":[1],"meta_info":{"completion_tokens":1}}\n\n'
        b'data: {"text":"a","meta_info":5}\n\n'
        b'data: {"text":"a b","meta_info":{"completion_tokens":2}}\n\n'
        b"data: [DONE]\n\n"
    )
    async with (
        _sse_upstream({"/v1/chat/completions": chat, "/generate": generate}) as url,
        running_proxy([url]) as px,
    ):
        (b,) = px.proxy.pool.all()
        r, body = await _post(px.url + "/v1/chat/completions", {"messages": [], "stream": True})
        assert r.status == 200 and body == chat  # every byte relayed, no error event
        r, body = await _post(px.url + "/generate", {"text": "x", "stream": True})
        assert r.status == 200 and body == generate
        assert b.state is State.HEALTHY and b.stats.tokens_total == 3
        metrics = (await _get(px.url + "/metrics"))[1].decode()
        assert f'pipefill_malformed_events_total{{backend="{b.name}"}} 5.0' in metrics


# ---- 7 (Medium 3): slow clients, idle connections, too many connections ------------------------


async def test_a_slow_request_head_or_body_is_closed_with_408():
    async with (
        fakes(1) as (up,),
        running_proxy([up.url], server={"header_timeout_s": 0.3, "body_timeout_s": 0.3}) as px,
    ):
        # slowloris: a head that never ends
        out = await _raw(px.port, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: 1\r\n")
        status, body = _status_and_body(out)
        assert status == 408 and _error(body)["code"] == "request_timeout"
        # a body that never ends
        out = await _raw(
            px.port,
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            b"\r\nContent-Length: 1000\r\n\r\n" + b'{"messages": [',
        )
        status, body = _status_and_body(out)
        assert status == 408 and _error(body)["code"] == "request_timeout"
        assert up.requests == []
        # a request that arrives whole is served as before
        r, _ = await _post(px.url + "/v1/chat/completions", {"model": MODEL, "messages": []})
        assert r.status == 200


async def test_idle_keep_alive_connections_are_closed():
    async with fakes(1) as (up,), running_proxy([up.url], server={"keepalive_s": 0.3}) as px:
        out = await _raw(px.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # keep-alive
        assert out.startswith(b"HTTP/1.1 200")  # then the proxy closed it: read() ended


async def test_connections_beyond_the_cap_get_503():
    async with fakes(1) as (up,), running_proxy([up.url], server={"max_connections": 2}) as px:
        held = []
        for _ in range(2):
            reader, writer = await asyncio.open_connection("127.0.0.1", px.port)
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
            held.append((reader, writer))
        out = await _raw(px.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        status, body = _status_and_body(out)
        assert status == 503 and _error(body)["code"] == "too_many_connections"
        held.pop()[1].close()

        async def served() -> bool:
            out = await _raw(
                px.port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
            )
            return out.startswith(b"HTTP/1.1 200")

        for _ in range(100):  # the freed connection is counted out once the proxy saw it close
            if await served():
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("a freed connection slot was never reused")
        metrics = (await _get(px.url + "/metrics"))[1].decode()
        assert 'pipefill_rejections_total{reason="too_many_connections"}' in metrics
        for _, writer in held:
            writer.close()


# ---- 8 (Medium 7): a client that stops reading --------------------------------------------------


async def test_a_client_that_stops_reading_frees_its_backend_slot():
    state = {"cancelled": 0}

    async def endless(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        event = b'data: {"choices":[{"index":0,"delta":{"content":"' + b"x" * 65536 + b'"}}]}\n\n'
        try:
            while True:
                await resp.write(event)
        except asyncio.CancelledError:
            state["cancelled"] += 1
            raise

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/health", ok)
    app.router.add_post("/v1/chat/completions", endless)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with running_proxy(
            [f"http://127.0.0.1:{port}"], timeouts={"write_stall_s": 0.3}
        ) as px:
            (b,) = px.proxy.pool.all()
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", px.port))
            reader, writer = await asyncio.open_connection(sock=sock)
            body = b'{"messages": [], "stream": true}'
            writer.write(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            await reader.readuntil(b"\r\n\r\n")  # the stream started; now the client reads nothing
            await wait_for(lambda: b.in_flight == 1)
            await wait_for(lambda: b.in_flight == 0, within=10)  # the slot is free again
            await wait_for(lambda: state["cancelled"] == 1)  # and the upstream request closed
            assert b.state is State.HEALTHY and b.consecutive_failures == 0
            metrics = (await _get(px.url + "/metrics"))[1].decode()
            assert f'pipefill_client_disconnects_total{{backend="{b.name}"}} 1.0' in metrics
            writer.close()
    finally:
        await runner.cleanup()


# ---- 9 (Medium 5): an SSE event larger than any SGLang sends -----------------------------------


async def test_an_oversized_event_is_relayed_but_not_read():
    token = b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
    huge = b'data: {"choices":[{"index":0,"delta":{"content":"' + b"x" * 300_000 + b'"}}]}\n\n'
    chat = token + huge + token + token + b"data: [DONE]\n\n"
    async with (
        _sse_upstream({"/v1/chat/completions": chat}) as url,
        running_proxy([url], upstream={"max_event_bytes": 65536}) as px,
    ):
        (b,) = px.proxy.pool.all()
        r, body = await _post(px.url + "/v1/chat/completions", {"messages": [], "stream": True})
        assert r.status == 200 and body == chat
        assert b.stats.tokens_total == 3  # the events around it were read
        metrics = (await _get(px.url + "/metrics"))[1].decode()
        assert f'pipefill_malformed_events_total{{backend="{b.name}"}} 1.0' in metrics


# ---- 9 (Medium 4): bodies that are not event streams ------------------------------------------


async def test_a_large_body_is_streamed_through_and_a_large_5xx_body_is_not_kept():
    release = asyncio.Event()
    first, second = b'{"object": "list", "data": [' + b" " * 100_000, b"]}"

    async def gated(request: web.Request) -> web.StreamResponse:
        await request.read()
        if request.headers.get("X-Big-Error"):
            return web.Response(status=500, body=b'{"error": "' + b"e" * 1_000_000 + b'"}')
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.content_length = len(first) + len(second)
        await resp.prepare(request)
        await resp.write(first)
        await release.wait()  # the rest only once the client has the first part
        await resp.write(second)
        return resp

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/health", ok)
    app.router.add_post("/v1/embeddings", gated)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    try:
        async with running_proxy([url], retries={"max_attempts": 1}) as px:

            async def relayed() -> None:
                async with (
                    aiohttp.ClientSession() as s,
                    s.post(px.url + "/v1/embeddings", json={"input": "x"}) as r,
                ):
                    assert r.status == 200 and r.content_length == len(first) + len(second)
                    got = await r.content.readexactly(len(first))  # before the upstream ended
                    release.set()
                    assert got + await r.read() == first + second

            try:
                await asyncio.wait_for(relayed(), 10)
            finally:
                release.set()
            r, body = await _post(px.url + "/v1/embeddings", {"input": "x"}, {"X-Big-Error": "1"})
            assert r.status == 500 and len(body) < 1000
            assert _error(body)["code"] == "upstream_error"
    finally:
        await runner.cleanup()


async def test_a_5xx_body_cut_short_is_replaced_by_the_proxys_error():
    """Found by tests/test_proxy_fuzz.py: a backend answering 500 that dropped the connection
    halfway through its body had its status and headers relayed with an empty body."""

    async def cut(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(status=500, headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        await resp.write(b'{"error": {"message": "half')
        request.transport.close()  # type: ignore[union-attr]
        return resp

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/health", ok)
    app.router.add_post("/v1/chat/completions", cut)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    try:
        async with running_proxy([url], retries={"max_attempts": 1}) as px:
            r, body = await _post(px.url + "/v1/chat/completions", {"model": MODEL})
            assert r.status == 500
            assert _error(body)["code"] == "upstream_error"
    finally:
        await runner.cleanup()


async def test_queued_request_bytes_are_capped_with_a_counted_429():
    """Bodies waiting in the queue are held in memory: past ``queue.max_queued_bytes`` a request
    that would wait is refused (429 ``queue_bytes_full``, Retry-After) instead of queued."""

    def body(n: int) -> dict:  # a chat request of exactly n bytes
        doc = {"model": MODEL, "messages": [{"role": "user", "content": ""}]}
        pad = n - len(orjson.dumps(doc))
        doc["messages"][0]["content"] = "x" * pad
        assert len(orjson.dumps(doc)) == n
        return doc

    async with (
        fakes(1) as (up,),
        running_proxy([up.url], queue={"max_queued_bytes": 1000}) as px,
    ):
        (a,) = px.proxy.pool.all()
        adm = px.proxy.admission
        a.limit = _HandLimit(1)
        up.hold_s = 1.0
        url = px.url + "/v1/chat/completions"
        running = asyncio.create_task(_post(url, body(100)))
        await wait_for(lambda: up.held == 1)
        first = asyncio.create_task(_post(url, body(700)))
        await wait_for(lambda: adm.depth == 1)
        assert adm.queued_bytes == 700
        r, out = await _post(url, body(400))  # 700 + 400 > 1000
        assert r.status == 429 and int(r.headers["Retry-After"]) >= 1
        assert _error(out)["code"] == "queue_bytes_full"
        second = asyncio.create_task(_post(url, body(300)))  # 700 + 300 fits
        await wait_for(lambda: adm.depth == 2)
        assert adm.queued_bytes == 1000
        a.limit._limit = 3
        adm.wake()
        for task in (running, first, second):
            r, _ = await asyncio.wait_for(task, 10)
            assert r.status == 200
        assert adm.queued_bytes == 0 and adm.depth == 0
        assert adm.snapshot()["rejections"]["queue_bytes_full"] == 1
        assert len(up.requests) == 3
        assert a.state is State.HEALTHY and a.consecutive_failures == 0
        metrics = (await _get(px.url + "/metrics"))[1].decode()
        assert 'pipefill_rejections_total{reason="queue_bytes_full"} 1.0' in metrics


# ---- the Low items ------------------------------------------------------------------------------


async def test_backend_urls_and_names_that_cannot_work_are_refused():
    async with fakes(1) as (up,), running_proxy([up.url], server={"admin_key": "a"}) as px:
        admin = {"Authorization": "Bearer a"}
        for bad in (
            {"url": f"http://user:pw@127.0.0.1:{up.port}", "api_key": "k"},
            {"url": f"{up.url}/?x=1"},
            {"url": f"{up.url}#f"},
            {"url": up.url, "name": "a/b"},
            {"url": up.url, "name": "a b"},
        ):
            r, body = await _post(px.url + "/admin/backends", bad, headers=admin)
            assert r.status == 400, bad
            assert _error(body)["code"] == "invalid_backend"
        assert len(px.proxy.pool.all()) == 1


async def test_a_decoded_request_body_goes_upstream_without_its_content_encoding():
    async with fakes(1) as (up,), running_proxy([up.url]) as px:
        body = gzip.compress(orjson.dumps({"model": MODEL, "messages": [], "max_tokens": 2}))
        async with (
            aiohttp.ClientSession() as s,
            s.post(
                px.url + "/v1/chat/completions",
                data=body,
                headers={"Content-Type": "application/json", "Content-Encoding": "gzip"},
            ) as r,
        ):
            assert r.status == 200
        assert "Content-Encoding" not in up.requests[-1]["headers"]


async def test_client_forwarding_headers_are_replaced_unless_trusted():
    spoof = {"X-Forwarded-For": "6.6.6.6", "Forwarded": "for=6.6.6.6"}
    for trusted, expected in ((False, "127.0.0.1"), (True, "6.6.6.6, 127.0.0.1")):
        async with (
            fakes(1) as (up,),
            running_proxy([up.url], server={"trust_forwarded_for": trusted}) as px,
        ):
            r, _ = await _post(
                px.url + "/v1/chat/completions", {"model": MODEL, "messages": []}, headers=spoof
            )
            assert r.status == 200
            sent = up.requests[-1]["headers"]
            assert sent["X-Forwarded-For"] == expected
            assert ("Forwarded" in sent) is trusted


async def test_expect_100_continue_is_answered():
    async with fakes(1) as (up,), running_proxy([up.url]) as px:
        body = orjson.dumps({"model": MODEL, "messages": []})
        reader, writer = await asyncio.open_connection("127.0.0.1", px.port)
        try:
            writer.write(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                b"Content-Type: application/json\r\nExpect: 100-continue\r\n"
                b"Content-Length: %d\r\n\r\n" % len(body)
            )
            interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert interim.startswith(b"HTTP/1.1 100")
            writer.write(body)
            out = await asyncio.wait_for(reader.read(), 10)
            assert out.startswith(b"HTTP/1.1 200")
        finally:
            writer.close()


async def test_a_long_url_is_414():
    async with fakes(1) as (up,), running_proxy([up.url]) as px:
        out = await _raw(
            px.port, b"GET /v1/models/" + b"m" * 20_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"
        )
        status, body = _status_and_body(out)
        assert status == 414 and _error(body)["code"] == "uri_too_long"
        assert up.requests == []


async def test_stream_is_read_as_sglang_reads_it():
    """SGLang's pydantic takes "yes", "true", 1 for a bool: such a request streams, so it is
    recallable before its first token like any streamed one."""
    async with fakes(1) as (up,), running_proxy([up.url]) as px:
        (a,) = px.proxy.pool.all()
        up.hold_s = 0.5
        task = asyncio.create_task(
            _post(
                px.url + "/v1/chat/completions", {"model": MODEL, "messages": [], "stream": "yes"}
            )
        )
        await wait_for(lambda: up.held == 1)
        assert a.stats.recall_unanswered(1) == 1  # taken back: it was known to stream
        up.hold_s = 0
        r, body = await asyncio.wait_for(task, 10)
        assert r.status == 200 and body.endswith(b"data: [DONE]\n\n")


async def test_the_drain_is_visible_before_the_listener_closes_and_cut_streams_say_why():
    async with fakes(1) as (up,):
        server = ProxyServer(proxy_settings([up.url]))
        await server.start()
        try:
            (b,) = server.proxy.pool.all()
            url = server.url + "/v1/chat/completions"
            long = asyncio.create_task(_post(
                url, {"model": MODEL, "messages": [], "stream": True, "max_tokens": 1000},
                headers={"X-Fake-Delay": "0.05"},
            ))  # fmt: skip
            await wait_for(lambda: up.running == 1)
            stopping = asyncio.create_task(server.stop(grace=0.3, pre_stop=1.0))
            await wait_for(lambda: server.proxy.draining)
            r, body = await _get(server.url + "/health")  # a balancer sees the drain ...
            assert r.status == 503 and _error(body)["code"] == "shutting_down"
            r, _ = await _post(url, {"model": MODEL, "messages": [], "max_tokens": 1})
            assert r.status == 200  # ... while the proxy still serves
            r, body = await asyncio.wait_for(long, 10)
            assert r.status == 200
            events = [e for e in body.split(b"\n\n") if e]
            assert events[-1] == b"data: [DONE]"
            assert _error(events[-2].removeprefix(b"data: "))["code"] == "shutting_down"
            await asyncio.wait_for(stopping, 10)
            assert b.state is State.HEALTHY and b.consecutive_failures == 0
        finally:
            await server.stop(0.1)
