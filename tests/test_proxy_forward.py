"""The forwarding path against a fake SGLang upstream: pass-through, streaming, retries,
timeouts, disconnects, health. Driven with the official openai client and raw aiohttp."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import aiohttp
import openai
import orjson
import pytest
from proxy_support import MODEL, FakeUpstream, fakes, running_proxy, wait_for

from proxy.backends import State
from proxy.limits import LimitSettings


def client(url: str, key: str = "none") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=10)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_openai_chat_streaming_and_not():
    async with fakes(1) as (up,), running_proxy([up.url]) as px:
        c = client(px.url)
        stream = await c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers={"X-Fake-Delay": "0.01"},
        )
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if chunk.usage:
                usage = chunk.usage
        assert text == " w0 w1 w2 w3 w4"
        assert usage.completion_tokens == 5
        r = await c.chat.completions.create(model=MODEL, messages=[], max_tokens=3)
        assert r.choices[0].message.content == " w0 w1 w2"
        assert r.usage.completion_tokens == 3
        comp = await c.completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert comp.choices[0].text == " w0 w1"
        emb = await c.embeddings.create(model=MODEL, input="x")
        assert emb.data[0].embedding == [0.1, 0.2]
        models = await c.models.list()
        assert [m.id for m in models.data] == [MODEL]
        metrics = (await _get(px.url + "/metrics"))[1].decode()
        name = px.proxy.pool.all()[0].name
        assert f'pipefill_output_tokens_total{{backend="{name}"}} 10.0' in metrics
        assert f'pipefill_ttft_seconds_count{{backend="{name}"}} 1.0' in metrics
        itl = metrics.split(f'pipefill_itl_seconds_count{{backend="{name}"}} ')[1].split()[0]
        assert 1 <= float(itl) <= 4  # events that arrive in one read count as one
        b = px.proxy.pool.all()[0]
        assert b.stats.ttft_count == 1 and b.stats.tokens_total >= 10


async def _get(url: str, **kw):
    async with aiohttp.ClientSession() as s, s.get(url, **kw) as r:
        return r, await r.read()


async def _post(url: str, body: bytes | dict, headers: dict | None = None):
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    h = {"Content-Type": "application/json", **(headers or {})}
    async with aiohttp.ClientSession() as s, s.post(url, data=data, headers=h) as r:
        return r, await r.read()


async def test_headers_request_id_backend_and_hop_by_hop():
    async with fakes(1) as (up,), running_proxy([up.url]) as px:
        r, body = await _post(
            px.url + "/v1/chat/completions",
            {"model": MODEL, "messages": [], "stream": True, "max_tokens": 2},
            headers={
                "X-Request-ID": "abc123",
                "Keep-Alive": "timeout=5",
                "X-Custom": "1",
                "Connection": "keep-alive, X-Drop-Me",
                "X-Drop-Me": "1",
            },
        )
        assert r.status == 200
        assert r.headers["X-Request-ID"] == "abc123"
        assert r.headers["X-Pipefill-Backend"] == px.proxy.pool.all()[0].name
        assert r.headers["Content-Type"] == "text/event-stream"
        assert r.headers["X-Upstream"] == "fake0"
        sent = up.requests[-1]["headers"]
        assert sent["X-Request-ID"] == "abc123" and sent["X-Custom"] == "1"
        assert "Keep-Alive" not in sent and "X-Drop-Me" not in sent
        assert body.endswith(b"data: [DONE]\n\n")
        r2, _ = await _post(px.url + "/v1/chat/completions", {"model": MODEL, "messages": []})
        assert len(r2.headers["X-Request-ID"]) >= 16  # made when absent


async def test_generate_stream_and_passthrough_route():
    async with fakes(1) as (up,), running_proxy([up.url]) as px:
        r, body = await _post(
            px.url + "/generate",
            {"text": "a b", "sampling_params": {"max_new_tokens": 3}, "stream": True},
        )
        assert r.status == 200 and body.count(b"data: ") == 4
        name = px.proxy.pool.all()[0].name
        assert px.proxy.pool.get(name).stats.tokens_total == 3
        r, body = await _post(px.url + "/generate", {"text": "a", "sampling_params": {}})
        assert orjson.loads(body)["meta_info"]["completion_tokens"] == 3
        r, body = await _get(px.url + "/get_model_info")
        assert r.status == 200 and orjson.loads(body)["served_by"] == "fake0"
        r, body = await _get(px.url + "/no_such_route")
        assert r.status == 404  # not on the allow-list: the proxy answers, nothing forwarded


async def test_upstream_error_body_and_status_preserved():
    async with fakes(1) as (up,), running_proxy([up.url]) as px:
        r, body = await _post(
            px.url + "/v1/chat/completions",
            {"model": MODEL, "messages": []},
            headers={"X-Fake-Status": "400"},
        )
        assert r.status == 400
        assert orjson.loads(body) == {
            "object": "error",
            "message": "injected 400",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
        assert len(up.requests) == 1  # 4xx is never retried
        assert px.proxy.pool.all()[0].state is State.HEALTHY


async def test_5xx_retried_on_another_backend():
    async with (
        fakes(2) as ups,
        running_proxy([u.url for u in ups], routing={"policy": "round_robin"}) as px,
    ):
        ups[0].fail_next = [503, 503]
        for _ in range(2):
            r, body = await _post(
                px.url + "/v1/chat/completions", {"model": MODEL, "messages": [], "stream": True}
            )
            assert r.status == 200 and body.endswith(b"[DONE]\n\n")
            assert r.headers["X-Pipefill-Backend"] == f"127.0.0.1:{ups[1].port}"
        retries = len(ups[0].requests)
        assert retries >= 1 and len(ups[1].requests) == 2
        metrics = (await _get(px.url + "/metrics"))[1].decode()
        assert f'pipefill_retries_total{{reason="http_503"}} {retries}.0' in metrics


async def test_5xx_everywhere_returns_the_backend_error():
    async with fakes(2) as ups, running_proxy([u.url for u in ups]) as px:
        r, body = await _post(
            px.url + "/v1/chat/completions",
            {"model": MODEL, "messages": []},
            headers={"X-Fake-Status": "503"},
        )
        assert r.status == 503
        assert orjson.loads(body)["message"] == "injected 503"
        assert sum(len(u.requests) for u in ups) == 2  # each backend once


async def test_connection_refused_retried_then_ejected():
    async with (
        fakes(2) as (a, b),
        running_proxy(
            [a.url, b.url], routing={"policy": "round_robin"}, health={"interval_s": 30}
        ) as px,
    ):
        dead_b = px.proxy.pool.get(f"127.0.0.1:{a.port}")
        assert dead_b.state is State.HEALTHY
        await a.stop()  # the backend dies: connections are refused from now on
        for _ in range(6):
            r, _ = await _post(px.url + "/v1/chat/completions", {"model": MODEL, "messages": []})
            assert r.status == 200
            assert r.headers["X-Pipefill-Backend"] == f"127.0.0.1:{b.port}"
        assert dead_b.state is State.UNHEALTHY  # passively ejected
        metrics = (await _get(px.url + "/metrics"))[1].decode()
        assert (
            f'pipefill_upstream_errors_total{{backend="{dead_b.name}",kind="connect"}}' in metrics
        )
        assert f'pipefill_backend_healthy{{backend="{dead_b.name}"}} 0.0' in metrics


async def test_no_healthy_backend_is_503_openai_shaped():
    dead = f"http://127.0.0.1:{closed_port()}"
    async with running_proxy([dead]) as px:
        r, body = await _post(px.url + "/v1/chat/completions", {"model": MODEL, "messages": []})
        assert r.status == 503
        err = orjson.loads(body)["error"]
        assert err["code"] == "no_healthy_backend" and err["type"] and err["message"]
        r, body = await _get(px.url + "/health")
        assert r.status == 503 and "error" in orjson.loads(body)


async def test_mid_stream_death_ends_with_sse_error_event():
    async with fakes(1) as (up,), running_proxy([up.url]) as px:
        r, body = await _post(
            px.url + "/v1/chat/completions",
            {"model": MODEL, "messages": [], "stream": True, "max_tokens": 5},
            headers={"X-Fake-Die-After": "2"},
        )
        assert r.status == 200
        events = [e for e in body.split(b"\n\n") if e]
        assert events[-1] == b"data: [DONE]"
        err = orjson.loads(events[-2].removeprefix(b"data: "))["error"]
        assert err["code"] == "upstream_error" and err["type"] == "server_error"
        assert b'" w1"' in body and b'" w2"' not in body
        assert len(up.requests) == 1  # never retried after bytes were sent


async def test_idle_timeout_mid_stream_and_first_byte_timeout():
    async with (
        fakes(1) as (up,),
        running_proxy([up.url], timeouts={"idle_s": 0.3, "first_byte_s": 0.3}) as px,
    ):
        c = client(px.url)
        stream = await c.chat.completions.create(
            model=MODEL,
            messages=[],
            max_tokens=5,
            stream=True,
            extra_headers={"X-Fake-Stall-After": "1"},
        )
        with pytest.raises(openai.APIError) as info:
            async for _ in stream:
                pass
        assert "idle timeout" in str(info.value)
        await wait_for(lambda: up.running == 0)  # the stalled upstream request was closed
        # Non-streaming: the whole answer must come within first_byte_s.
        r, _body = await _post(
            px.url + "/v1/chat/completions",
            {"model": MODEL, "messages": [], "max_tokens": 3},
            headers={"X-Fake-Delay": "0"},
        )
        assert r.status == 200


async def test_first_byte_timeout_is_504():
    async def slow(request):
        await asyncio.sleep(1)
        return aiohttp.web.Response(text="late")

    app = aiohttp.web.Application()
    app.router.add_get("/health", _ok)
    app.router.add_post("/v1/chat/completions", slow)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        async with running_proxy(
            [f"http://127.0.0.1:{port}"],
            timeouts={"first_byte_s": 0.2},
            retries={"max_attempts": 1},
        ) as px:
            r, body = await _post(px.url + "/v1/chat/completions", {"messages": []})
            assert r.status == 504
            assert orjson.loads(body)["error"]["code"] == "upstream_timeout"
    finally:
        await runner.cleanup()


async def _ok(request):
    return aiohttp.web.Response(text="ok")


async def test_client_disconnect_aborts_upstream_at_once():
    async with fakes(1) as (up,), running_proxy([up.url]) as px:
        async with aiohttp.ClientSession() as s:
            resp = await s.post(
                px.url + "/v1/chat/completions",
                json={"model": MODEL, "messages": [], "stream": True, "max_tokens": 1000},
                headers={"X-Fake-Delay": "0.05"},
            )
            await resp.content.readline()
            await wait_for(lambda: up.running == 1)
            resp.close()  # client goes away mid-stream
        await wait_for(lambda: up.running == 0, within=2)
        assert up.cancelled == 1
        await wait_for(lambda: px.proxy.pool.all()[0].in_flight == 0)
        metrics = (await _get(px.url + "/metrics"))[1].decode()
        assert "pipefill_client_disconnects_total" in metrics
        assert 'pipefill_client_disconnects_total{backend="' in metrics
        assert metrics.count("pipefill_client_disconnects_total{") == 1


async def test_stale_pooled_connection_retried_on_fresh_one():
    """A server that closes a keep-alive connection just as the proxy reuses it."""
    served = {"n": 0}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        first = True
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
                if not first or head.startswith(b"GET /health"):
                    if not first:
                        writer.close()  # "idle timeout" raced with the reuse
                        return
                body = b'{"ok": true}'
                served["n"] += 1
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
                )
                await writer.drain()
                first = False
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with running_proxy([f"http://127.0.0.1:{port}"], health={"interval_s": 30}) as px:
            for _ in range(3):
                r, body = await _post(px.url + "/v1/chat/completions", {"messages": []})
                assert r.status == 200, body
            metrics = (await _get(px.url + "/metrics"))[1].decode()
            assert 'pipefill_retries_total{reason="stale_connection"}' in metrics
            assert px.proxy.pool.all()[0].state is State.HEALTHY
    finally:
        server.close()


async def test_active_health_check_ejects_and_recovers():
    async with (
        fakes(2) as (a, b),
        running_proxy(
            [a.url, b.url], health={"unhealthy_threshold": 1, "healthy_threshold": 1}
        ) as px,
    ):
        ba = px.proxy.pool.get(f"127.0.0.1:{a.port}")
        a.healthy = False
        await wait_for(lambda: ba.state is State.UNHEALTHY)
        for _ in range(4):
            r, _ = await _post(px.url + "/v1/chat/completions", {"messages": []})
            assert r.headers["X-Pipefill-Backend"] != ba.name  # unhealthy gets no traffic
        a.healthy = True
        await wait_for(lambda: ba.state is State.HEALTHY)


async def test_half_open_probe_after_passive_ejection():
    up = await FakeUpstream().start()
    try:
        async with running_proxy(
            [up.url],
            health={"passive_failures": 2, "eject_s": 0.3, "interval_s": 30},
            retries={"max_attempts": 1},
        ) as px:
            b = px.proxy.pool.all()[0]
            for _ in range(2):
                r, _ = await _post(
                    px.url + "/v1/chat/completions",
                    {"messages": []},
                    headers={"X-Fake-Status": "500"},
                )
                assert r.status == 500
            assert b.state is State.UNHEALTHY
            r, _body = await _post(px.url + "/v1/chat/completions", {"messages": []})
            assert r.status == 503  # ejected: no traffic
            px.proxy.health.kick()  # the next check after eject_s is the half-open probe
            await asyncio.sleep(0.35)
            px.proxy.health.kick()
            await wait_for(lambda: b.state is not State.UNHEALTHY)
            r, _ = await _post(px.url + "/v1/chat/completions", {"messages": []})
            assert r.status == 200
            await wait_for(lambda: b.state is State.HEALTHY)
    finally:
        await up.stop()


async def test_total_timeout_ends_a_long_stream_cleanly():
    async with fakes(1) as (up,), running_proxy([up.url], timeouts={"total_s": 0.4}) as px:
        r, body = await _post(
            px.url + "/v1/chat/completions",
            {"model": MODEL, "messages": [], "stream": True, "max_tokens": 50},
            headers={"X-Fake-Delay": "0.05"},
        )
        assert r.status == 200
        events = [e for e in body.split(b"\n\n") if e]
        assert events[-1] == b"data: [DONE]"
        err = orjson.loads(events[-2].removeprefix(b"data: "))["error"]
        assert err["code"] == "upstream_timeout" and "total timeout" in err["message"]
        await wait_for(lambda: up.running == 0)


async def test_priority_header_reaches_the_queue():
    async with (
        fakes(1) as (up,),
        running_proxy([up.url], limits={"algorithm": "fixed", "initial": 1}) as px,
    ):
        await _post(px.url + "/v1/chat/completions", {"messages": [], "max_tokens": 1})
        first = asyncio.create_task(_post(
            px.url + "/v1/chat/completions",
            {"messages": [], "stream": True, "max_tokens": 10, "tag": "first"},
            headers={"X-Fake-Delay": "0.03"},
        ))  # fmt: skip
        await wait_for(lambda: up.running == 1)
        batch = asyncio.create_task(_post(
            px.url + "/v1/chat/completions", {"messages": [], "tag": "batch"},
            headers={"X-Priority": "batch"},
        ))  # fmt: skip
        await wait_for(lambda: px.proxy.admission.depth == 1)
        inter = asyncio.create_task(_post(
            px.url + "/v1/chat/completions", {"messages": [], "tag": "interactive"}
        ))  # fmt: skip
        await wait_for(lambda: px.proxy.admission.depth == 2)
        for t in (first, batch, inter):
            r, _ = await t
            assert r.status == 200
        order = [q["body"].get("tag") for q in up.requests[1:]]
        assert order == ["first", "interactive", "batch"]


async def test_streamed_bytes_pass_through_exactly_however_chunked():
    """Whatever the upstream sends, and however it is split, the client gets the same bytes."""
    import random

    rng = random.Random(7)
    pieces = [
        b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n',
        b'data: {"choices":[{"index":0,"delta":{"content":"\\u00e9\\r\\n"}}]}\r\n\r\n',
        b": keep-alive comment\n\n",
        b"data: not json\n\n",
        b'data: {"choices":[{"index":0,\ndata: "delta":{"content":"b"}}]}\n\n',
        b'data: {"error": {"message": "boom"}}\n\n',
        'data: {"choices":[{"delta":{"content":"日本"}}]}\n\n'.encode(),
        b"data: [DONE]\n\n",
    ]
    payload = b"".join(rng.choice(pieces) for _ in range(60)) + pieces[-1]
    splits: list[list[bytes]] = []
    for _ in range(6):
        cuts = sorted(rng.sample(range(1, len(payload)), 25))
        splits.append(
            [payload[a:b] for a, b in zip([0, *cuts], [*cuts, len(payload)], strict=True)]
        )
    splits.append([payload[i : i + 1] for i in range(0, 200)] + [payload[200:]])

    current: dict[str, list[bytes]] = {}

    async def stream(request):
        await request.read()
        resp = aiohttp.web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for part in current["parts"]:
            await resp.write(part)
            await asyncio.sleep(0)
        return resp

    app = aiohttp.web.Application()
    app.router.add_get("/health", _ok)
    app.router.add_post("/v1/chat/completions", stream)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        async with running_proxy([f"http://127.0.0.1:{port}"]) as px:
            for parts in splits:
                current["parts"] = parts
                r, body = await _post(px.url + "/v1/chat/completions", {"stream": True})
                assert r.status == 200 and body == payload
    finally:
        await runner.cleanup()


async def test_connect_timeout_is_retried_elsewhere():
    # A listener whose accept queue is full: the kernel drops further SYNs, connect hangs.
    blackhole = socket.socket()
    blackhole.bind(("127.0.0.1", 0))
    blackhole.listen(0)
    port = blackhole.getsockname()[1]
    fillers = []
    for _ in range(3):
        c = socket.socket()
        c.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            c.connect(("127.0.0.1", port))
        fillers.append(c)
    try:
        async with (
            fakes(1) as (up,),
            running_proxy(
                [f"http://127.0.0.1:{port}", up.url],
                timeouts={"connect_s": 0.2},
                health={"interval_s": 30, "timeout_s": 0.3},
                routing={"policy": "round_robin"},
            ) as px,
        ):
            hole = px.proxy.pool.get(f"127.0.0.1:{port}")
            hole.set_state(State.HEALTHY)  # it was fine until now
            for _ in range(3):
                r, _ = await _post(px.url + "/v1/chat/completions", {"messages": []})
                assert r.status == 200 and r.headers["X-Pipefill-Backend"] != hole.name
            metrics = (await _get(px.url + "/metrics"))[1].decode()
            assert f'backend="{hole.name}",kind="connect_timeout"' in metrics
    finally:
        for c in fillers:
            c.close()
        blackhole.close()


class _HandLimit:
    """A limit the test moves by hand: the next window sets it to ``next``."""

    name = "hand"
    knee = None
    settings = LimitSettings()

    def __init__(self, n: int) -> None:
        self._limit = n
        self.next: int | None = None

    @property
    def limit(self) -> int:
        return self._limit

    def update(self, window) -> None:
        if self.next is not None:
            self._limit, self.next = self.next, None

    def reset(self) -> None:
        return None

    def snapshot(self) -> dict:
        return {"algorithm": self.name, "limit": self._limit, "knee": None}

    describe = snapshot


async def test_a_request_queued_by_a_backend_is_recalled_when_its_limit_falls():
    """SGLang queues what exceeds its running cap and answers nothing until it runs it. When
    the backend's limit falls below its in-flight count, the proxy takes back such a request
    (closing the upstream connection) and serves it from the backend that frees first."""
    async with fakes(2) as (slow, fast), running_proxy([slow.url, fast.url]) as px:
        a, b = px.proxy.pool.all()
        a.limit, b.limit = _HandLimit(1), _HandLimit(0)  # the first request can only go to a
        slow.hold_s = 30.0
        adm = px.proxy.admission
        calls: list[tuple[float | None, bool]] = []
        acquire = adm.acquire

        def spy(priority="interactive", exclude=frozenset(), deadline=None, *, front=False, **kw):
            calls.append((deadline, front))
            return acquire(priority, exclude, deadline, front=front, **kw)

        adm.acquire = spy
        task = asyncio.create_task(
            _post(
                px.url + "/v1/chat/completions",
                {"model": MODEL, "messages": [], "stream": True, "max_tokens": 3},
            )
        )
        await wait_for(lambda: slow.held == 1)
        assert a.stats.snapshot()["awaiting_first_token"] == 1
        metrics = (await _get(px.url + "/metrics"))[1].decode()
        assert f'pipefill_backend_awaiting_first_token{{backend="{a.name}"}} 1.0' in metrics
        a.limit.next = 0  # the next window lowers a's limit below its in-flight count
        b.limit._limit = 1
        r, body = await asyncio.wait_for(task, 10)
        assert r.status == 200 and b'" w2"' in body
        assert r.headers["X-Pipefill-Backend"] == b.name
        await wait_for(lambda: slow.cancelled == 1)  # the upstream request was closed
        assert slow.held == 0 and a.in_flight == 0
        assert a.stats.snapshot()["awaiting_first_token"] == 0 and a.stats.recalling == 0
        metrics = (await _get(px.url + "/metrics"))[1].decode()
        assert 'pipefill_retries_total{reason="recalled"} 1.0' in metrics
        # Back in the proxy's queue, first, with what was left of its queue deadline.
        assert calls[0] == (None, False)
        deadline, front = calls[1]
        assert front and deadline is not None and deadline < adm.queue_deadline_s


async def test_a_non_streamed_request_is_never_recalled():
    async with fakes(1) as (up,), running_proxy([up.url]) as px:
        (a,) = px.proxy.pool.all()
        a.limit = _HandLimit(1)
        up.hold_s = 0.5
        task = asyncio.create_task(
            _post(
                px.url + "/v1/chat/completions",
                {"model": MODEL, "messages": [], "max_tokens": 3},
                headers={"X-Fake-Delay": "0"},
            )
        )
        await wait_for(lambda: up.held == 1)
        assert a.stats.recall_unanswered(1) == 0  # no first token to tell queued from running
        r, _ = await asyncio.wait_for(task, 10)
        assert r.status == 200
        assert a.stats.snapshot()["awaiting_first_token"] == 0


async def test_an_ejected_backends_unanswered_requests_are_retried_elsewhere_at_once():
    """A hung backend: its streamed requests without a token would wait for their first-byte
    timeout; ejecting it sends them to another backend at once."""
    async with fakes(2) as (hung, ok), running_proxy([hung.url, ok.url]) as px:
        a, b = px.proxy.pool.all()
        a.limit, b.limit = _HandLimit(1), _HandLimit(0)
        hung.hold_s = 30.0
        task = asyncio.create_task(
            _post(
                px.url + "/v1/chat/completions",
                {"model": MODEL, "messages": [], "stream": True, "max_tokens": 2},
            )
        )
        await wait_for(lambda: hung.held == 1)
        b.limit._limit = 1
        px.proxy.health.eject(a, "test")
        r, body = await asyncio.wait_for(task, 10)
        assert r.status == 200 and b'" w1"' in body
        assert r.headers["X-Pipefill-Backend"] == b.name
        await wait_for(lambda: hung.cancelled == 1)


async def test_loadtest_records_which_backend_served():
    from loadtest.client import Target, execute, make_session
    from loadtest.records import RequestRecord
    from loadtest.workload import RequestSpec

    async with fakes(2) as ups, running_proxy([u.url for u in ups]) as px:
        target = Target(url=px.url, api="chat")
        body = {"model": MODEL, "messages": [], "max_tokens": 2, "stream": True}
        names = {b.name for b in px.proxy.pool.all()}
        async with make_session(target, 2) as session:
            seen = set()
            for _ in range(4):
                rec = RequestRecord(level=1, worker=0, t_scheduled=0.0, t_send=0.0)
                spec = RequestSpec(0, "/v1/chat/completions", orjson.dumps(body), 1, 2)
                rec = await execute(session, target, spec, rec)
                assert rec.ok, rec.error_message
                seen.add(rec.served_by)
        assert seen <= names and seen
        direct = Target(url=ups[0].url, api="chat")
        async with make_session(direct, 1) as session:
            rec = RequestRecord(level=1, worker=0, t_scheduled=0.0, t_send=0.0)
            spec = RequestSpec(0, "/v1/chat/completions", orjson.dumps(body), 1, 2)
            rec = await execute(session, direct, spec, rec)
        assert rec.ok and rec.served_by is None
