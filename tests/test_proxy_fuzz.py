"""A Hypothesis fuzz of the proxy's HTTP surface on real sockets (issue 15): raw request lines and
headers, JSON bodies of any shape on the admitted routes, and a misbehaving upstream.

Two proxies run on one background loop for the whole module, each in front of its own fake:
``clean`` (an upstream that answers every request 200) for what a client sends, ``wild`` (an
upstream scripted per example) for what a backend sends. After every example:

- status: a client's input never gets a 5xx (the clean upstream gives none, so any 5xx would be
  the proxy's own); a misbehaving upstream gives the client its own status, or 502
  ``upstream_error`` / 504 ``upstream_timeout`` / 503 ``no_healthy_backend`` from the proxy;
- any JSON error body is OpenAI-shaped;
- no log record of the proxy (or of aiohttp's server) carries a traceback or is ERROR or above;
- a client's input leaves the backend healthy with no failure counted;
- nothing leaks: no request in progress, no slot held, nobody queued;
- the process's RSS grew less than a generous bound since the module started.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from dataclasses import dataclass, field

import aiohttp
import orjson
import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from proxy_support import running_proxy

from proxy.backends import State
from proxy.routes import ADMITTED

KEY = "fuzz-key"  # the clean proxy's client key
RSS_BOUND = 256 * 1024 * 1024  # growth of the whole test process over the module
ADMITTED_PATHS = sorted(ADMITTED)
FUZZ = settings(
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Records(logging.Handler):
    """Keeps the proxy's (and aiohttp's) records at WARNING and above, and any with a traceback."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.split(".")[0] in ("pipefill", "proxy", "aiohttp") and (
            record.exc_info or record.levelno >= logging.WARNING
        ):
            self.records.append(record)

    def bad(self) -> list[tuple[str, int, bool]]:
        return [
            (r.name, r.levelno, bool(r.exc_info))
            for r in self.records
            if r.exc_info or r.levelno >= logging.ERROR
        ]


@dataclass
class Script:
    """What the wild upstream answers to the next request."""

    status: int = 200
    content_type: str = "text/event-stream"
    chunks: list[bytes] = field(default_factory=list)
    end: str = "eof"  # "eof": a clean end; "close": the connection drops after the chunks;
    # "drop": the connection drops before any answer


def _drop(request: web.Request) -> None:
    """Close the connection under a request (if the proxy has not already)."""
    if request.transport is not None:
        request.transport.close()


class _Served:
    """The two proxies and their upstreams on a background loop."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.script = Script()
        self.received: list[bytes] = []  # bodies the clean upstream got on admitted routes
        self.records = _Records()
        self.rss0 = _rss()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._start())
        self.ready.set()
        self.loop.run_forever()

    async def _upstream(self, handler) -> tuple[web.AppRunner, str]:
        async def health(request: web.Request) -> web.Response:
            return web.Response(text="")

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_route("*", "/{tail:.*}", handler)
        # its own logger: what the fake logs (e.g. a header over its own limits) is not the proxy's
        runner = web.AppRunner(app, access_log=None, logger=logging.getLogger("fake.upstream"))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]

    async def _clean(self, request: web.Request) -> web.Response:
        body = await request.read()
        if request.path in ADMITTED:
            self.received.append(body)
        return web.json_response({"ok": True})

    async def _wild(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        s = self.script
        if s.end == "drop":
            _drop(request)
            return web.Response()
        resp = web.StreamResponse(status=s.status, headers={"Content-Type": s.content_type})
        with contextlib.suppress(ConnectionError):
            await resp.prepare(request)
            for chunk in s.chunks:
                await resp.write(chunk)
                await asyncio.sleep(0)
            if s.end == "close":
                _drop(request)
                return resp
            await resp.write_eof()
        return resp

    async def _start(self) -> None:
        server = {
            "header_timeout_s": 0.3,
            "body_timeout_s": 0.3,
            "keepalive_s": 1.0,
            "max_body_bytes": 64 * 1024,
        }
        health = {"interval_s": 0.2, "passive_failures": 3, "eject_s": 0.2}
        # the wild backend fails on purpose: it is never ejected, so every example reaches it
        self.clean_up, clean_url = await self._upstream(self._clean)
        keys = {"api_keys": [KEY], "admin_key": "fuzz-admin", "metrics_public": True}
        self.clean_cm = running_proxy([clean_url], server={**server, **keys}, health=health)
        self.clean = await self.clean_cm.__aenter__()
        self.wild_up, wild_url = await self._upstream(self._wild)
        self.wild_cm = running_proxy(
            [wild_url],
            server=server,
            health={**health, "passive_failures": 10**9},
            retries={"max_attempts": 1},
            timeouts={"first_byte_s": 2.0, "idle_s": 2.0},
            upstream={"max_event_bytes": 16 * 1024},
        )
        self.wild = await self.wild_cm.__aenter__()
        for name in ("pipefill", "proxy", "aiohttp"):
            logging.getLogger(name).addHandler(self.records)

    def run(self, coro, within: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(within)

    def close(self) -> None:
        for name in ("pipefill", "proxy", "aiohttp"):
            logging.getLogger(name).removeHandler(self.records)

        async def stop() -> None:
            await self.clean_cm.__aexit__(None, None, None)
            await self.wild_cm.__aexit__(None, None, None)
            await self.clean_up.cleanup()
            await self.wild_up.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)

    # ---- checks after each example ---------------------------------------------------------

    async def settled(self, px) -> None:
        """Nothing in progress, no slot held, nobody queued (within a few seconds)."""
        proxy = px.proxy
        for _ in range(500):
            if (
                not proxy.active
                and not proxy.admission.depth
                and all(b.in_flight == 0 for b in proxy.pool.all())
            ):
                return
            await asyncio.sleep(0.01)
        raise AssertionError(
            {
                "active": proxy.active,
                "queued": proxy.admission.depth,
                "in_flight": [b.in_flight for b in proxy.pool.all()],
            }
        )

    def check(self, px, *, client_side: bool) -> None:
        self.run(self.settled(px))
        bad = self.records.bad()
        self.records.records.clear()  # a failing example must not fail the next one
        assert bad == []
        if client_side:
            for b in px.proxy.pool.all():
                assert (b.state, b.consecutive_failures) == (State.HEALTHY, 0)
        assert _rss() - self.rss0 < RSS_BOUND


@pytest.fixture(scope="module")
def served():
    s = _Served()
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def fresh(served):
    """Each test starts from a healthy clean backend and an empty record list."""
    served.records.records.clear()
    return served


def _error_code(content_type: str, body: bytes) -> str | None:
    """The code of an OpenAI-shaped error body (asserting the shape), or None if not JSON."""
    if not content_type.startswith("application/json"):
        return None
    err = orjson.loads(body)["error"]
    assert {"message", "type", "code"} <= set(err), err
    return err["code"]


def _code_of(content_type: str, body: bytes) -> str | None:
    """The error code in a body, if it is an OpenAI-shaped error (no assertion)."""
    if not content_type.startswith("application/json"):
        return None
    try:
        return orjson.loads(body)["error"]["code"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return None


def _mostly(good, *odd, weight: int = 6):
    """``good`` about ``weight`` times in ``weight + len(odd)``, else one of ``odd``."""
    return st.sampled_from([good] * weight + list(odd)).flatmap(lambda s: s)


# ---- (a) raw request lines, targets, methods, headers ------------------------------------------

_GOOD_METHODS = st.sampled_from([b"GET", b"POST", b"PUT", b"HEAD", b"DELETE", b"OPTIONS"])
_METHODS = _mostly(
    _GOOD_METHODS,
    st.sampled_from([b"PATCH", b"TRACE", b"CONNECT", b"PRI", b"get", b"G\xffT", b"", b"P OST"]),
    st.binary(min_size=1, max_size=12),
)
_PATHS = st.sampled_from(
    [
        *ADMITTED_PATHS,
        "/v1/models",
        "/v1/models/x",
        "/health",
        "/metrics",
        "/admin/backends",
        "/admin/queue",
        "/get_model_info",
        "/get_server_info",
        "/flush_cache",
        "/open_session",
        "/nope",
        "/",
    ]
).map(str.encode)
_TARGETS = _mostly(
    _PATHS,
    st.tuples(_PATHS, st.binary(max_size=40)).map(lambda t: t[0] + b"?" + t[1]),
    _PATHS.map(lambda p: b"http://127.0.0.1:1" + p),
    _PATHS.map(lambda p: b"//127.0.0.1:1" + p),
    _PATHS.map(lambda p: p + b"/%2E%2E/%2e%2e/get_server_info"),
    st.sampled_from([b"*", b"", b"/\xff\xfe", b"/v1/chat/completions#x", b"/%00", b"/" * 9000]),
    st.binary(max_size=60),
)
_VERSIONS = st.sampled_from(
    [b"HTTP/1.1"] * 6 + [b"HTTP/1.0", b"HTTP/2.0", b"HTTP/0.9", b"HTTP/1.1 x", b"", b"http/1.1"]
)
_NAMES = _mostly(
    st.sampled_from(
        [
            b"Content-Length",
            b"Transfer-Encoding",
            b"Authorization",
            b"Host",
            b"Expect",
            b"Connection",
            b"Content-Type",
            b"Content-Encoding",
            b"X-Priority",
            b"X-Pipefill-Backend",
            b"X-Request-ID",
            b"X-Forwarded-For",
            b"Upgrade",
            b"Cookie",
        ]
    ),
    st.just(b"Host"),
    st.from_regex(rb"[A-Za-z][A-Za-z0-9-]{0,20}", fullmatch=True),
    st.binary(min_size=1, max_size=20),
)
_VALUES = _mostly(
    st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40).map(str.encode),
    st.sampled_from(
        [
            b"chunked",
            b"gzip, chunked",
            b"chunked, identity",
            b"-1",
            b"1e3",
            b"0x10",
            b"99999999999999999999",
            b" 5",
            b"100-continue",
            b"close",
            b"keep-alive, Upgrade",
            b"websocket",
            b"application/json",
            b"gzip",
            b"br",
            b"interactive",
            b"batch",
            b"Bearer \xff\xfe",
            b"Bearer x",
            b"Bearer fuzz-key",
            b"Bearer fuzz-admin",
            b"Bearer fuzz-key\xff",
            b"bearer  fuzz-key ",
            b"nope",
        ]
    ),
    st.binary(max_size=100).map(lambda b: b.translate(None, b"\r\n\x00")),
    st.binary(max_size=60).map(
        lambda b: bytes(c | 0x80 if c < 0x20 else c for c in b)
    ),  # not UTF-8
    st.binary(max_size=100),
    st.sampled_from([b"127.0.0.1", b"evil.example", b""]).map(lambda h: b"\x00" + h),
    st.integers(0, 40_000).map(lambda n: b"v" * n),  # huge values
    weight=3,
)
_AUTH = _mostly(
    st.just(b"Bearer " + KEY.encode()),
    st.sampled_from(
        [b"Bearer fuzz-key\xff", b"Bearer \xff\xfe", b"\xe9", b"Bearer fuzz-admin", b"", b"Basic x"]
    ),
    st.binary(max_size=30).map(lambda b: b"Bearer " + bytes(c | 0x80 for c in b)),
    weight=2,
)
_HEADERS = st.lists(st.tuples(_NAMES, _VALUES), max_size=5)
_VERSIONS = _mostly(st.just(b"HTTP/1.1"), _VERSIONS, weight=3)
_BODY = st.one_of(
    st.binary(max_size=300),
    _PATHS.map(lambda p: b'{"model": "m", "prompt": "%s", "stream": true}' % p),
    st.sampled_from([b'{"model": "m", "messages": []}', b'{"stream": true, "prompt": "x"}']),
    st.sampled_from([b"5\r\nhello\r\n0\r\n\r\n", b"zz\r\nhello\r\n0\r\n\r\n", b"3\r\nab"]),
)
# Resolve the strategies now, in the main thread at collection: see tests/test_proxy_input.py
# (CPython 3.11's AST validator is not thread-safe when hypothesis compiles its regex module).
for _strategy in (_METHODS, _TARGETS, _VERSIONS, _NAMES, _VALUES, _HEADERS, _BODY, _AUTH):
    _strategy.validate()


async def _exchange(port: int, data: bytes, head_only: bool) -> tuple[int | None, str, bytes]:
    """Send raw bytes, read one response (skipping 1xx): status, content type, body. Status None:
    the connection closed without an answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
    try:
        writer.write(data)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        async with asyncio.timeout(5):
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError as e:
                    assert e.partial == b"", e.partial[:200]
                    return None, "", b""
                except ConnectionError:
                    return None, "", b""
                lines = head.split(b"\r\n")
                status = int(lines[0].split()[1])
                if status >= 200:
                    break
            headers = {}
            for line in lines[1:]:
                if b":" in line:
                    k, _, v = line.partition(b":")
                    headers[k.strip().lower().decode("latin-1")] = v.strip().decode("latin-1")
            body = b""
            if head_only or status in (204, 304):
                pass
            elif "content-length" in headers:
                body = await reader.readexactly(int(headers["content-length"]))
            else:
                with contextlib.suppress(ConnectionError):
                    body = await reader.read()
            return status, headers.get("content-type", ""), body
    finally:
        writer.close()


@settings(FUZZ, max_examples=300)
@given(
    method=_METHODS,
    target=_TARGETS,
    version=_VERSIONS,
    headers=_HEADERS,
    body=_BODY,
    framing=st.sampled_from(["length", "length", "none", "short", "long"]),
    wellformed=_mostly(st.none(), st.sampled_from(ADMITTED_PATHS), weight=1),
    auth=_AUTH,
)
def test_fuzz_raw_requests(
    fresh, method, target, version, headers, body, framing, wellformed, auth
):
    """Bytes over a raw socket: whatever the request line and headers, a 4xx (or the route's
    answer), never a 5xx, never a traceback, never a backend's health. ``wellformed``: a valid
    request to that admitted route with only the headers fuzzed, so that they reach the
    forwarding code."""
    px = fresh.clean
    if wellformed is not None:
        method, target, version = b"POST", wellformed.encode(), b"HTTP/1.1"
        body, framing = b'{"model": "m", "prompt": "x", "messages": []}', "length"
        headers = [(k, v) for k, v in headers if k.lower() not in (b"content-length", b"host")]
        if not any(k.lower() == b"authorization" for k, _ in headers):
            headers.insert(0, (b"Authorization", auth))
    lines = [method + b" " + target + b" " + version, b"Host: 127.0.0.1"]
    lines += [k + b": " + v for k, v in headers]
    if framing != "none":
        extra = {"length": 0, "short": -1, "long": 7}[framing]
        lines.append(b"Content-Length: %d" % max(0, len(body) + extra))
    lines.append(b"Connection: close")
    data = b"\r\n".join(lines) + b"\r\n\r\n" + body
    status, ctype, out = fresh.run(_exchange(px.port, data, head_only=method == b"HEAD"))
    if status is not None:
        assert 100 <= status < 500, (status, out[:300])
        if status >= 400 and method != b"HEAD":
            _error_code(ctype, out)
    fresh.check(px, client_side=True)


# ---- (b) JSON bodies of any shape on the admitted routes -----------------------------------------

_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=30),
    lambda kids: (
        st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4)
    ),
    max_leaves=16,
)
_KEYS = st.sampled_from(
    [
        "model",
        "messages",
        "prompt",
        "text",
        "input_ids",
        "stream",
        "stream_options",
        "max_tokens",
        "max_completion_tokens",
        "sampling_params",
        "n",
        "rid",
        "priority",
        "return_logprob",
        "input",
    ]
)
_OBJECT = st.dictionaries(st.one_of(_KEYS, st.text(max_size=8)), _JSON, max_size=6)
_STREAM = st.sampled_from([True, False, "yes", "true", 1, 0, None, [], {"x": 1}, "false"])
for _strategy in (_JSON, _KEYS, _OBJECT, _STREAM):
    _strategy.validate()


async def _post(url: str, data: bytes, headers: dict[str, str]) -> tuple[int, str, bytes]:
    async with aiohttp.ClientSession() as s, s.post(url, data=data, headers=headers) as r:
        return r.status, r.headers.get("Content-Type", ""), await r.read()


@settings(FUZZ, max_examples=200)
@given(
    path=st.sampled_from(ADMITTED_PATHS),
    doc=st.one_of(
        _OBJECT,
        st.tuples(_OBJECT, _STREAM).map(lambda t: {**t[0], "stream": t[1]}),
        _JSON,
    ),
    priority=st.sampled_from([None, "batch", "interactive", "BATCH", ""]),
)
def test_fuzz_json_bodies(fresh, path, doc, priority):
    """Any JSON on an admitted route: an object is forwarded byte for byte and answered, anything
    else is 400 ``invalid_json`` and not forwarded; never a 5xx nor a backend's health."""
    px = fresh.clean
    data = orjson.dumps(doc)
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
    if priority is not None:
        headers["X-Priority"] = priority
    before = len(fresh.received)
    status, ctype, out = fresh.run(_post(px.url + path, data, headers))
    if isinstance(doc, dict):
        assert (status, orjson.loads(out)) == (200, {"ok": True}), out[:300]
        assert fresh.received[before:] == [data]
    else:
        assert (status, _error_code(ctype, out)) == (400, "invalid_json")
        assert len(fresh.received) == before
    fresh.check(px, client_side=True)


# ---- (c) a misbehaving upstream -----------------------------------------------------------------

_EVENT = st.one_of(
    st.sampled_from(
        [
            b'data: {"choices":5}\n\n',
            b'data: {"choices":[{"delta":"x"}]}\n\n',
            b'data: {"choices":[7]}\n\n',
            b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n',
            b'data: {"choices":[{"index":"0","delta":{"content":5}}]}\n\n',
            b'data: {"choices":[],"usage":{"completion_tokens":"x"}}\n\n',
            b'data: {"choices":[],"usage":5}\n\n',
            b'data: {"text":"a","index":[1],"meta_info":{"completion_tokens":1}}\n\n',
            b'data: {"text":"a","meta_info":5}\n\n',
            b'data: {"text":5,"meta_info":{"completion_tokens":-3}}\n\n',
            b'data: {"meta_info":{"completion_tokens":1e308}}\n\n',
            b"data: [DONE]\n\n",
            b"data: {not json\n\n",
            b"data: \xff\xfe\n\n",
            b": comment\n\n",
            b"event: error\ndata: {}\n\n",
            b"data: 5\n\n",
            b"data: null\n\n",
            b"data:\n\n",
            b"\r\n\r\n",
            b'data: {"a":1}\r\n\r\n',
            b'data: {"a"',
            b":1}\n\n",
        ]
    ),
    st.binary(max_size=200),
    st.builds(lambda n: b"data: " + b"x" * n + b"\n\n", st.integers(0, 200_000)),  # huge lines
    st.builds(lambda n: b"data: " + b"y" * n, st.integers(0, 40_000)),  # no terminator
)
_SCRIPT = st.builds(
    Script,
    status=st.sampled_from([200] * 6 + [400, 404, 429, 500, 502, 503]),
    content_type=st.sampled_from(
        ["text/event-stream"] * 4
        + ["application/json", "text/plain", "text/event-stream; charset=utf-8", "x/\xff"]
    ),
    chunks=st.lists(_EVENT, max_size=8),
    end=st.sampled_from(["eof"] * 4 + ["close", "drop"]),
)
for _strategy in (_EVENT, _SCRIPT):
    _strategy.validate()

#: the proxy's own answers to a failing backend (which is never ejected here, so never a 503)
_UPSTREAM_CODES = {502: "upstream_error", 504: "upstream_timeout"}


async def _post_tolerant(url: str, data: bytes) -> tuple[int, str, bytes, bool]:
    """As _post, but a body cut by the proxy (it closes the connection) is an outcome too."""
    async with aiohttp.ClientSession() as s, s.post(url, data=data) as r:
        chunks = []
        try:
            async for chunk in r.content.iter_any():
                chunks.append(chunk)
            cut = False
        except aiohttp.ClientPayloadError:
            cut = True
        return r.status, r.headers.get("Content-Type", ""), b"".join(chunks), cut


@settings(FUZZ, max_examples=150)
@given(
    script=_SCRIPT,
    path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/generate"]),
    stream=st.booleans(),
)
def test_fuzz_misbehaving_upstream(fresh, script, path, stream):
    """Whatever the backend sends (any framing, shape, size, status, content type, a cut), the
    client gets the backend's own status or a 502/503/504 the proxy attributes to the backend,
    the bytes the backend sent (a cut stream ends with the proxy's SSE error event, any other cut
    body with the connection closed), and no traceback."""
    px = fresh.wild
    fresh.script = script
    doc = {"model": "m", "prompt": "x", "messages": [], "text": "x", "stream": stream}
    status, ctype, out, cut = fresh.run(_post_tolerant(px.url + path, orjson.dumps(doc)))
    sent = b"".join(script.chunks)
    code = _code_of(ctype, out)
    if (
        out != sent
        and code is not None
        and (
            code == _UPSTREAM_CODES.get(status)
            # a 5xx body too large to keep for relaying: the backend's status, the proxy's body
            or (status == script.status >= 500 and code == "upstream_error")
        )
    ):
        _error_code(ctype, out)  # the proxy's own answer, attributed to the backend
    else:
        assert status == script.status and script.end != "drop", (status, out[:300])
        if script.end == "eof":
            assert (cut, out) == (False, sent)
        elif script.content_type.startswith("text/event-stream"):
            # a stream the backend cut: every byte it sent, then the proxy's SSE error event
            assert out.startswith(sent), (out[:300], sent[:300])
            assert b'"code":"upstream_error"' in out[len(sent) :], out[-300:]
        else:  # any other body the backend cut: what arrived of it, then the connection closes
            assert sent.startswith(out)
    fresh.check(px, client_side=False)
