"""Bad input never reaches a backend and never produces a traceback: malformed JSON, bodies
over the limit, oversized headers, unsupported methods, auth; plus a hypothesis fuzz."""

from __future__ import annotations

import asyncio
import http.client
import threading

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from proxy_support import MODEL, fakes, running_proxy


async def _req(method: str, url: str, data: bytes | None = None, headers: dict | None = None):
    async with (
        aiohttp.ClientSession() as s,
        s.request(method, url, data=data, headers=headers) as r,
    ):
        return r, await r.read()


def _is_error(body: bytes, code: str | None = None) -> dict:
    err = orjson.loads(body)["error"]
    assert set(err) >= {"message", "type", "code"}, err
    if code is not None:
        assert err["code"] == code, err
    return err


async def test_malformed_json_and_non_object_bodies_are_400_and_not_forwarded():
    async with fakes(1) as (up,), running_proxy([up.url]) as px:
        for body in (b"{not json", b"[1, 2]", b'"text"', b"\xff\xfe"):
            r, out = await _req(
                "POST", px.url + "/v1/chat/completions", body, {"Content-Type": "application/json"}
            )
            assert r.status == 400
            assert r.headers["Content-Type"].startswith("application/json")
            _is_error(out, "invalid_json")
        r, out = await _req("POST", px.url + "/generate", b"")
        assert r.status == 400
        assert up.requests == []


async def test_body_over_limit_is_413():
    async with fakes(1) as (up,), running_proxy([up.url], server={"max_body_bytes": 1000}) as px:
        big = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * 2000}]})
        r, out = await _req(
            "POST", px.url + "/v1/chat/completions", big, {"Content-Type": "application/json"}
        )
        assert r.status == 413
        _is_error(out, "body_too_large")

        async def chunked():
            for _ in range(4):
                yield b"x" * 400

        async with (
            aiohttp.ClientSession() as s,
            s.post(px.url + "/v1/chat/completions", data=chunked()) as r,
        ):
            assert r.status == 413
            _is_error(await r.read(), "body_too_large")
        assert up.requests == []


async def _raw(port: int, data: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    out = await asyncio.wait_for(reader.read(65536), 5)
    writer.close()
    return out


async def test_oversized_headers_and_garbage_requests_are_openai_shaped():
    async with fakes(1) as (up,), running_proxy([up.url], server={"max_header_bytes": 1024}) as px:
        out = await _raw(
            px.port, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 5000 + b"\r\n\r\n"
        )
        head, _, body = out.partition(b"\r\n\r\n")
        assert head.split()[1] == b"431"
        _is_error(body, "headers_too_large")
        out = await _raw(px.port, b"\x16\x03\x01 garbage\r\n\r\n")
        head, _, body = out.partition(b"\r\n\r\n")
        assert head.split()[1] in (b"400", b"405")
        _is_error(body)
        assert b"Traceback" not in out
        assert up.requests == []


async def test_unsupported_methods_are_405():
    async with fakes(1) as (up,), running_proxy([up.url]) as px:
        r, out = await _req("GET", px.url + "/v1/chat/completions")
        assert r.status == 405 and "POST" in r.headers["Allow"]
        _is_error(out, "method_not_allowed")
        r, out = await _req("PATCH", px.url + "/get_model_info")
        assert r.status == 405
        _is_error(out, "method_not_allowed")
        r, out = await _req("POST", px.url + "/health")
        assert r.status == 405
        assert up.requests == []


async def test_client_api_keys():
    async with fakes(1) as (up,), running_proxy([up.url], server={"api_keys": ["k1", "k2"]}) as px:
        bad = openai.AsyncOpenAI(base_url=px.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await bad.chat.completions.create(model=MODEL, messages=[])
        good = openai.AsyncOpenAI(base_url=px.url + "/v1", api_key="k2", max_retries=0)
        r = await good.chat.completions.create(model=MODEL, messages=[], max_tokens=1)
        assert r.choices[0].message.content == " w0"
        assert "Authorization" not in up.requests[-1]["headers"]  # the proxy's key stays here
        with pytest.raises(openai.AuthenticationError):
            await bad.models.list()
        r, _ = await _req("GET", px.url + "/health")
        assert r.status == 200
        r, _ = await _req("GET", px.url + "/metrics")
        assert r.status == 401  # private by default once client keys are set
        r, _ = await _req("GET", px.url + "/metrics", headers={"Authorization": "Bearer k1"})
        assert r.status == 200
        r, out = await _req("GET", px.url + "/get_model_info")
        assert r.status == 401
        _is_error(out, "invalid_api_key")


async def test_admin_key_separate_from_client_keys():
    async with (
        fakes(1) as (up,),
        running_proxy([up.url], server={"api_keys": ["client"], "admin_key": "admin"}) as px,
    ):
        url = px.url + "/admin/backends"
        r, out = await _req("GET", url, headers={"Authorization": "Bearer client"})
        assert r.status == 401
        _is_error(out, "invalid_admin_key")
        r, out = await _req("GET", url, headers={"Authorization": "Bearer admin"})
        assert r.status == 200 and orjson.loads(out)["backends"][0]["state"] == "healthy"
    async with fakes(1) as (up,), running_proxy([up.url]) as px:  # no admin key: read-only
        r, _ = await _req("GET", px.url + "/admin/backends")
        assert r.status == 200
        r, out = await _req("POST", px.url + "/admin/backends", orjson.dumps({"url": up.url}))
        assert r.status == 403
        _is_error(out, "admin_disabled")


# ---- fuzz ------------------------------------------------------------------------------


class _Served:
    """An echo upstream and a proxy on a background loop, for the synchronous fuzz test."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.forwarded = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._start())
        self.ready.set()
        self.loop.run_forever()

    async def _start(self) -> None:
        async def echo(request: web.Request) -> web.Response:
            await request.read()
            if request.path != "/health":
                self.forwarded += 1
            return web.json_response({"ok": True})

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", echo)
        self.up = web.AppRunner(app, access_log=None)
        await self.up.setup()
        site = web.TCPSite(self.up, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.cm = running_proxy(
            [f"http://127.0.0.1:{port}"], server={"max_body_bytes": 4096, "max_header_bytes": 2048}
        )
        self.px = await self.cm.__aenter__()

    def close(self) -> None:
        async def stop() -> None:
            await self.cm.__aexit__(None, None, None)
            await self.up.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="module")
def served():
    s = _Served()
    try:
        yield s
    finally:
        s.close()


_token = st.from_regex(r"[A-Za-z][A-Za-z0-9-]{0,20}", fullmatch=True)
_value = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=300)
_json_like = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=50),
    lambda kids: (
        st.lists(kids, max_size=5) | st.dictionaries(st.text(max_size=10), kids, max_size=5)
    ),
    max_leaves=20,
)
_body = st.one_of(
    st.binary(max_size=6000),
    _json_like.map(orjson.dumps),
    st.dictionaries(
        st.sampled_from(["model", "messages", "stream", "max_tokens", "x"]), _json_like, max_size=5
    ).map(orjson.dumps),
)
# Resolve the strategies now, in the main thread at collection: that imports (and, without
# bytecode caching, compiles) hypothesis's regex module before the served proxy's thread runs.
# CPython 3.11's AST validator keeps one recursion counter for all threads, so two threads
# compiling at once can fail with "AST constructor recursion depth mismatch".
for _strategy in (_token, _value, _json_like, _body):
    _strategy.validate()


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]),
    path=st.sampled_from(
        [
            "/v1/chat/completions",
            "/v1/completions",
            "/generate",
            "/v1/models",
            "/health",
            "/admin/backends",
            "/get_model_info",
            "/v1/embeddings",
        ]
    ),
    headers=st.dictionaries(_token, _value, max_size=6),
    body=_body,
)
def test_fuzz_bodies_and_headers(served, method, path, headers, body):
    headers = {
        k: v
        for k, v in headers.items()
        if k.lower()
        not in ("content-length", "transfer-encoding", "host", "connection", "expect", "upgrade")
    }
    conn = http.client.HTTPConnection("127.0.0.1", served.px.port, timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        out = resp.read()
    finally:
        conn.close()
    assert b"Traceback" not in out
    assert resp.status != 500
    if resp.status >= 400 and resp.getheader("Content-Type", "").startswith("application/json"):
        err = orjson.loads(out)
        assert "error" in err and {"message", "type", "code"} <= set(err["error"])
    if path in ("/v1/chat/completions", "/v1/completions", "/generate") and resp.status == 200:
        assert orjson.loads(out) == {"ok": True}
        try:
            assert isinstance(orjson.loads(body), dict)  # only JSON objects were forwarded
        except orjson.JSONDecodeError:
            raise AssertionError("malformed JSON was forwarded") from None
