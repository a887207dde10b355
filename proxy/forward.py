"""Forwarding one request upstream: retries before the first byte, streaming pass-through after.

The request path, as a few named steps::

    lease = await acquire(exclude, recalled)  # admission: a backend with a free slot (late binding)
    result = await attempt(lease.backend)  # upstream exchange, relayed chunk by chunk
    lease.release()
    failed before any byte reached the client?  -> exclude that backend, back off, acquire again
    recalled (its limit fell below its in-flight count before it answered)?  -> acquire again,
        first in the proxy's queue

Streamed bytes are written to the client exactly as they arrive (never re-encoded); SSE events
are only peeked at (proxy/sse.py) to time TTFT and inter-token gaps and to read usage, which land
in ``backend.stats``. Timeouts: connect (aiohttp), first byte (request sent -> headers), idle gap
between chunks and total, the last two enforced by one lazily rescheduled timer per request.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from proxy.backends import Backend, BackendPool
from proxy.errors import JSON, error_object, error_response, ndjson_error, sse_error
from proxy.health import Health
from proxy.logs import OPS, OUTCOME
from proxy.metrics import Metrics
from proxy.settings import Settings
from proxy.sse import NDJSON_APIS, Api, LineFramer, SSEFramer, TokenCounter, body_usage, framer_for
from proxy.upstream import Connection, Origin, UpstreamError, UpstreamPool, request_bytes

log = logging.getLogger("pipefill.forward")

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "expect",
    }
)
#: response types relayed as a stream whose events are peeked at (SSE; the Ollama routes' NDJSON)
_STREAM_TYPES = ("text/event-stream", "application/x-ndjson")
#: request Content-Encodings aiohttp's server decodes before the handler reads the body
DECODED = frozenset({"gzip", "deflate", "br", "zstd"})


class Lease:
    """What admission hands out: a backend with a slot held until ``release()``;
    ``reported``: what the backend's answer said of its prefix cache."""

    backend: Backend

    def release(self) -> None: ...

    def reported(self, prompt_tokens: int | None, cached_tokens: int) -> None: ...


@dataclass(slots=True)
class Usage:
    """The prompt side of one answer's usage, as the backend reported it (None: not said)."""

    prompt_tokens: int | None = None
    cached_tokens: int | None = None


#: ``acquire(exclude, recalled)``: a lease on a backend not in ``exclude``; ``recalled``: the
#: request was taken back from a backend's queue and goes to the front of the proxy's
Acquire = Callable[[frozenset[str], bool], Awaitable[Any]]
#: Failure kind of a request recalled from a backend that queued it (see _Pending)
RECALLED = "recalled"
#: Failure kind of an exception on the proxy's own side (never held against a backend)
LOCAL = "proxy_error"


class _ConnectTimeout(Exception):
    """No connection to the backend within the connect timeout."""


class _ConnectError(Exception):
    """The backend could not be connected to (refused, unreachable, TLS, DNS)."""


@dataclass(slots=True)
class Failure:
    """An attempt that failed before any byte reached the client."""

    kind: str  # label of pipefill_upstream_errors
    status: int
    message: str
    code: str
    retryable: bool
    upstream: tuple[int, CIMultiDict, bytes] | None = None  # the backend's own error response

    def response(self, headers: dict[str, str]) -> web.Response:
        if self.upstream is not None:
            status, up_headers, body = self.upstream
            up_headers.update(headers)
            return web.Response(status=status, body=body, headers=up_headers)
        return error_response(self.status, self.message, self.code, headers=headers)


#: kind of a stream ended because its client stopped reading (the client's doing)
CLIENT_STALLED = "client_stalled"
#: kind of a relay cut because the proxy shuts down (nobody's failure)
SHUTDOWN = "shutdown"


#: a client's socket buffer past this many unsent bytes: stop reading from its backend
CLIENT_HIGH_WATER = 256 * 1024


class _Watchdog:
    """Idle-gap and total deadlines of one upstream response, and the write-stall deadline of
    its client, for the price of one timer.

    The timer is rescheduled only when it fires. ``last`` is a plain attribute write per read:
    the time the backend last sent, or, while the client's socket is too full to take more
    (reading from the backend paused), minus the time that began. On an upstream expiry the
    connection fails with an UpstreamError, which wakes whoever waits on it; a client that has
    taken nothing for ``stall`` seconds has its connection aborted and the exchange fails with
    CLIENT_STALLED (which frees the backend slot).
    """

    __slots__ = ("client", "conn", "deadline", "fired", "handle", "idle", "last", "loop", "stall")

    def __init__(
        self,
        conn: Connection,
        idle: float,
        deadline: float,
        client: asyncio.BaseTransport | None = None,
        stall: float = float("inf"),
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.conn = conn
        self.idle = idle
        self.deadline = deadline
        self.client = client
        self.stall = stall
        self.last = time.monotonic()
        self.fired: str | None = None
        # (a client that stops taking is noticed within two stall periods)
        self.handle = self.loop.call_later(min(idle, stall, deadline - self.last), self._check)

    def _check(self) -> None:
        now = time.monotonic()
        last = self.last
        if now >= self.deadline:
            self.fired = "total_timeout"
        elif last <= 0:  # the client is not taking since -last: not waiting on the backend
            blocked = now + last
            if self.client is not None and blocked >= self.stall:
                self.fired = CLIENT_STALLED
                self.client.abort()
            else:
                delay = min(self.idle, self.stall - blocked, self.deadline - now)
                self.handle = self.loop.call_later(delay, self._check)
                return
        elif now - last >= self.idle:
            self.fired = "idle_timeout"
        else:
            delay = min(min(last + self.idle, self.deadline) - now, self.stall)
            self.handle = self.loop.call_later(delay, self._check)
            return
        self.conn.fail(UpstreamError(self.fired))

    def cancel(self) -> None:
        self.handle.cancel()

    def cut(self) -> None:
        """End the relay now (shutdown): its pending read fails with SHUTDOWN."""
        self.handle.cancel()
        self.fired = SHUTDOWN
        self.conn.fail(UpstreamError(SHUTDOWN))


class _ClientSink:
    """Writes a relayed body on to the client's socket as it arrives (``proxy.upstream.Sink``),
    framed as HTTP/1.1 chunks when the client's response is chunked; blocked while the socket
    holds more than CLIENT_HIGH_WATER unsent bytes, or once the client is gone."""

    __slots__ = ("chunked", "transport", "wd")

    def __init__(self, transport: asyncio.Transport, wd: _Watchdog, chunked: bool) -> None:
        self.transport = transport
        self.wd = wd
        self.chunked = chunked

    def feed(self, data: bytes) -> bool:
        self.wd.last = time.monotonic()
        return self.write(data)

    def write(self, data: bytes) -> bool:
        """Write ``data`` on; whether the client is now blocked."""
        t = self.transport
        if t.is_closing():
            return self.blocked()
        if self.chunked:
            t.write(b"%x\r\n%b\r\n" % (len(data), data))
        else:
            t.write(data)
        return t.get_write_buffer_size() > CLIENT_HIGH_WATER and self.blocked()

    def blocked(self) -> bool:
        t = self.transport
        if t.is_closing() or t.get_write_buffer_size() > CLIENT_HIGH_WATER:
            if self.wd.last > 0:
                self.wd.last = -time.monotonic()
            return True
        if self.wd.last < 0:
            self.wd.last = time.monotonic()
        return False


class _BodySink(_ClientSink):
    """A whole (non-event) body relayed on, its chunks kept while they fit in ``cap`` bytes
    (to read its usage at the end)."""

    __slots__ = ("cap", "kept", "parts")

    def __init__(
        self, transport: asyncio.Transport, wd: _Watchdog, chunked: bool, keep: bool, cap: int
    ) -> None:
        super().__init__(transport, wd, chunked)
        self.parts: list[bytes] | None = [] if keep else None
        self.kept = 0
        self.cap = cap

    def feed(self, data: bytes) -> bool:
        parts = self.parts
        if parts is not None:
            self.kept += len(data)
            if self.kept <= self.cap:
                parts.append(data)
            else:
                self.parts = None
        return super().feed(data)


class _EventSink(_ClientSink):
    """An event stream relayed on, each read peeked at for its tokens: TTFT at the first
    token-carrying read, one inter-token gap per later one (events that arrived in one read
    arrived together: they count as one event carrying all their tokens, one ITL sample of
    gap / tokens)."""

    __slots__ = ("bm", "counter", "first", "framer", "last_tok", "pending", "rid", "stats")

    def __init__(
        self,
        transport: asyncio.Transport,
        wd: _Watchdog,
        chunked: bool,
        framer: SSEFramer | LineFramer | None,
        counter: TokenCounter | None,
        b: Backend,
        bm: Any,
        pending: _Pending,
        request_id: str,
    ) -> None:
        super().__init__(transport, wd, chunked)
        self.framer = framer
        self.counter = counter
        self.stats = b.stats
        self.bm = bm
        self.pending = pending
        self.rid = request_id
        self.first: float | None = None
        self.last_tok = 0.0

    def feed(self, data: bytes) -> bool:
        now = time.monotonic()
        self.wd.last = now
        blocked = self.write(data)
        framer, counter = self.framer, self.counter
        if framer is None or counter is None:
            return blocked
        n = 0
        try:
            for payload in framer.feed(data):
                n += counter.observe(payload)
        except Exception:  # a bug of ours: keep relaying, stop peeking
            log.exception("request %s: SSE accounting failed; relaying on", self.rid)
            counter.malformed += 1
            self.framer = None
            return blocked
        if n:
            stats = self.stats
            if self.first is None:
                self.first = now
                t_send = self.pending.t_send
                self.pending.answered(now)
                stats.observe_ttft(now - t_send)
                self.bm.ttft.observe(now - t_send)
            else:
                gap = (now - self.last_tok) / n
                stats.observe_itl(gap, n, now)
                self.bm.itl.observe(gap)
            self.last_tok = now
            stats.observe_tokens(n, now)
        return blocked


def _chunked(request: web.BaseRequest, out: web.StreamResponse) -> bool:
    """Whether ``out``, not yet prepared, goes as HTTP/1.1 chunks (made so when it can)."""
    if out.content_length is None and request.version >= (1, 1):
        out.enable_chunked_encoding()
    return out.chunked


class Forwarder:
    def __init__(
        self,
        settings: Settings,
        pool: BackendPool,
        health: Health,
        metrics: Metrics,
        session: aiohttp.ClientSession,
        upstream: UpstreamPool,
    ) -> None:
        self.settings = settings
        self.pool = pool
        self.health = health
        self.metrics = metrics
        self.session = session  # admin fan-out only; requests go through ``upstream``
        self.upstream = upstream
        self._origins: dict[str, tuple[Origin, str]] = {}  # backend URL -> (origin, path prefix)
        self._t = settings.timeouts
        self._r = settings.retries
        self._retry_statuses = frozenset(settings.retries.retry_statuses)
        self._backend_header = settings.server.backend_header
        self._rid_header = settings.server.request_id_header
        self.keys_changed()
        self._trust_forwarded = settings.server.trust_forwarded_for
        self._relays: set[_Watchdog] = set()  # responses being relayed (cut on shutdown)

    def keys_changed(self) -> None:
        """The server's keys were set (at start, or by a reload)."""
        # With keys set the Authorization header is the proxy's: never sent upstream.
        srv = self.settings.server
        self._strip_auth = bool(srv.api_keys or srv.admin_key)

    def cut_streams(self) -> int:
        """Shutdown: end every relay in progress (an event stream with an SSE error event);
        how many there were."""
        relays, self._relays = self._relays, set()
        for wd in relays:
            wd.cut()
        return len(relays)

    # ---- the retry loop ----------------------------------------------------------------

    async def forward(
        self,
        request: web.BaseRequest,
        body: bytes | None,
        *,
        target: str,
        route: str,
        api: Api | None,
        streamed: bool = False,
        acquire: Acquire,
        request_id: str,
        t_arrive: float,
        on_reject: Callable[[BaseException], web.Response | None],
    ) -> web.StreamResponse:
        """``acquire(exclude, recalled)`` returns a lease or raises (``on_reject`` turns that
        into a response, or returns None to re-raise). ``target``: the origin-form path and
        query sent upstream. ``streamed``: the client asked for a stream (such a request can be
        recalled before its first token, see _Pending)."""
        rid_headers = {self._rid_header: request_id}
        excluded: set[str] = set()
        last: Failure | None = None
        last_backend: Backend | None = None
        attempt = 0
        recalled = False
        while True:
            attempt += 1
            try:
                lease = await acquire(frozenset(excluded), recalled)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if last is not None:  # every other backend is gone too: report the real error
                    return self._finish_failure(last, route, rid_headers, last_backend)
                resp = on_reject(e)
                if resp is None:
                    raise
                resp.headers.update(rid_headers)
                self.metrics.requests.labels("none", route, str(resp.status)).inc()
                return resp
            backend = lease.backend
            outcome = request.get(OUTCOME)
            if outcome is not None:
                outcome.backend = backend.name
            usage = Usage()
            try:
                result = await self._attempt(
                    request,
                    body,
                    backend,
                    target=target,
                    api=api,
                    streamed=streamed,
                    route=route,
                    request_id=request_id,
                    t_arrive=t_arrive,
                    usage=usage,
                )
            finally:
                lease.release()
                if backend.removing:
                    self.pool.reap(backend)
            if not isinstance(result, Failure):
                if usage.cached_tokens is not None:
                    backend.stats.observe_cached(usage.prompt_tokens, usage.cached_tokens)
                    lease.reported(usage.prompt_tokens, usage.cached_tokens)
                return result
            recalled = result.kind == RECALLED
            if recalled:  # not a failure of the backend: wait in the proxy's queue instead
                self.metrics.retries.labels(RECALLED).inc()
                attempt -= 1
                continue
            last, last_backend = result, backend
            excluded.add(backend.name)
            if not result.retryable or attempt >= self._r.max_attempts:
                return self._finish_failure(result, route, rid_headers, backend)
            self.metrics.retries.labels(result.kind).inc()
            OPS.warning(
                "request %s: %s at backend %s (attempt %d of %d); retrying on another",
                request_id,
                result.kind,
                backend.name,
                attempt,
                self._r.max_attempts,
                extra={
                    "event": "retry",
                    "request_id": request_id,
                    "backend": backend.name,
                    "kind": result.kind,
                    "attempt": attempt,
                },
            )
            delay = min(self._r.backoff_max_s, self._r.backoff_base_s * 2 ** (attempt - 1))
            if delay > 0:
                await asyncio.sleep(delay * random.uniform(0.5, 1.5))

    def _finish_failure(
        self, f: Failure, route: str, headers: dict[str, str], backend: Backend | None = None
    ) -> web.Response:
        if backend is not None:
            headers = {**headers, self._backend_header: backend.name}
        resp = f.response(headers)
        name = backend.name if backend is not None else "none"
        self.metrics.requests.labels(name, route, str(resp.status)).inc()
        return resp

    # ---- admin calls meant for the whole fleet -----------------------------------------

    async def fan_out(
        self,
        request: web.BaseRequest,
        body: bytes | None,
        *,
        target: str,
        backends: list[Backend],
        request_id: str,
    ) -> web.Response:
        """Send one admin call to every backend in ``backends`` at once; answer with what each
        said: ``{"ok": bool, "backends": {name: {"status", "body"} | {"status": null,
        "error"}}}``, 200 when every backend answered 2xx, else 502 with an OpenAI-shaped
        ``error`` beside the per-backend detail. Neither health nor stats see these calls."""

        async def one(b: Backend) -> dict[str, Any]:
            headers = self._upstream_headers(request, b, request_id)
            url = URL(b.url + target, encoded=True)
            try:
                async with asyncio.timeout(self._t.total_s):
                    async with self.session.request(
                        request.method, url, data=body, headers=headers, allow_redirects=False
                    ) as resp:
                        data = await resp.content.read(FANOUT_BODY_CAP + 1)
                        ctype = resp.headers.get("Content-Type", "")
                        return {"status": resp.status, **_fanout_body(data, ctype)}
            except TimeoutError:
                return {"status": None, "error": "timed out"}
            except (aiohttp.ClientError, OSError):
                return {"status": None, "error": "could not reach the backend"}
            except Exception as e:  # the proxy's own fault: logged, never the backend's
                log.error(
                    "request %s: fan-out to %s failed locally", request_id, b.name, exc_info=e
                )
                return {"status": None, "error": "internal proxy error"}

        results = await asyncio.gather(*(one(b) for b in backends))
        answers = {b.name: r for b, r in zip(backends, results, strict=True)}
        failed = [n for n, r in answers.items() if not (r["status"] and 200 <= r["status"] < 300)]
        out: dict[str, Any] = {"ok": not failed and bool(answers), "backends": answers}
        status = 200
        if failed or not answers:
            status = 502
            message = (
                f"{len(failed)} of {len(answers)} backends did not succeed"
                if answers
                else "no backend to send to"
            )
            out["error"] = error_object(message, status=502, code="fanout_failed")
        self.metrics.requests.labels("none", "other", str(status)).inc()
        return web.Response(
            status=status,
            body=orjson.dumps(out),
            content_type=JSON,
            headers={self._rid_header: request_id},
        )

    # ---- one attempt -------------------------------------------------------------------

    def _upstream_headers(self, request: web.BaseRequest, b: Backend, rid: str) -> CIMultiDict:
        src = request.headers
        drop = HOP_BY_HOP
        connection = src.get("Connection")
        if connection:
            drop = drop | {t.strip().lower() for t in connection.split(",")}
        out: CIMultiDict = CIMultiDict()
        for k, v in src.items():
            if k.lower() not in drop:
                out.add(k, v)
        if b.api_key:
            out["Authorization"] = f"Bearer {b.api_key}"
        elif self._strip_auth:
            out.popall("Authorization", None)
        out[self._rid_header] = rid
        if out.get("Content-Encoding", "").lower() in DECODED:
            del out["Content-Encoding"]  # aiohttp decoded the body: it goes up as it is now
        peer = request.remote
        if self._trust_forwarded:
            prior = src.get("X-Forwarded-For")
            if peer:
                out["X-Forwarded-For"] = f"{prior}, {peer}" if prior else peer
        else:  # a client's own forwarding headers say nothing true
            out.popall("X-Forwarded-For", None)
            out.popall("Forwarded", None)
            if peer:
                out["X-Forwarded-For"] = peer
        return out

    async def _attempt(
        self,
        request: web.BaseRequest,
        body: bytes | None,
        b: Backend,
        *,
        target: str,
        api: Api | None,
        streamed: bool,
        route: str,
        request_id: str,
        t_arrive: float,
        usage: Usage,
    ) -> web.StreamResponse | Failure:
        headers = self._upstream_headers(request, b, request_id)
        pending = _Pending(b.stats, time.monotonic(), streamed, usage)
        try:
            return await self._exchange(
                request, body, b, target, headers, pending, api, route, request_id, t_arrive
            )
        finally:
            pending.answered()

    async def _exchange(
        self,
        request: web.BaseRequest,
        body: bytes | None,
        b: Backend,
        target: str,
        headers: CIMultiDict,
        pending: _Pending,
        api: Api | None,
        route: str,
        request_id: str,
        t_arrive: float,
    ) -> web.StreamResponse | Failure:
        origin, prefix = self._origin(b)
        method = request.method
        data = request_bytes(method, prefix + target, origin, headers, body)
        t_send = pending.t_send
        deadline = t_send + self._t.total_s
        bm = self.metrics.backend(b.name)
        conn: Connection | None = None
        fresh_retry = True
        try:
            try:
                while True:
                    pending.recallable = True
                    try:
                        async with asyncio.timeout(min(self._t.first_byte_s, self._t.total_s)):
                            conn = await self._connect(origin)
                            conn.send(data, head_only=method == "HEAD")
                            await conn.head()
                        pending.recallable = False
                        break
                    except UpstreamError as e:
                        # A pooled keep-alive connection the server had just closed: retry at
                        # once on a fresh connection (once), without blaming the backend.
                        if fresh_retry and e.stale:
                            fresh_retry = False
                            self.metrics.retries.labels("stale_connection").inc()
                            continue
                        raise
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if pending.recalled and task is not None and task.uncancel() == 0:
                    return Failure(
                        RECALLED,
                        503,
                        "recalled from its backend",
                        "upstream_recalled",
                        retryable=True,
                    )
                bm.disconnects.inc()
                raise
            except _ConnectTimeout:
                return self._fail(b, "connect_timeout", 504, "timed out connecting to the backend")
            except TimeoutError:
                return self._fail(b, "first_byte_timeout", 504, "upstream sent no response in time")
            except _ConnectError:
                return self._fail(b, "connect", 502, "could not connect to the backend")
            except (UpstreamError, OSError):
                return self._fail(b, "disconnect", 502, "backend closed the connection")
            except Exception as e:
                return self._local_failure(e, request_id)
            assert conn is not None
            status = conn.status
            if status in self._retry_statuses:
                return await self._upstream_5xx(b, conn, deadline)
            if status < 500:
                b.stats.observe_first_byte()
            ctype = conn.headers.get("Content-Type", "")
            if ctype.startswith(_STREAM_TYPES):
                return await self._stream(
                    request, conn, b, api, route, request_id, t_arrive, pending, deadline
                )
            return await self._whole(
                request, conn, b, api, route, request_id, t_arrive, pending, deadline
            )
        finally:
            if conn is not None:
                conn.release()  # back to the pool when the exchange completed, else closed

    def _origin(self, b: Backend) -> tuple[Origin, str]:
        """Where ``b``'s connections go, and the path its URL puts before every target."""
        known = self._origins.get(b.url)
        if known is None:
            parts = urlsplit(b.url)
            known = self._origins[b.url] = (Origin.of(b.url), parts.path.rstrip("/"))
        return known

    async def _connect(self, origin: Origin) -> Connection:
        """A connection to ``origin`` (pooled, else new within the connect timeout)."""
        conn = self.upstream.idle(origin)
        if conn is not None:
            return conn
        try:
            async with asyncio.timeout(self._t.connect_s):
                return await self.upstream.connect(origin)
        except TimeoutError:
            raise _ConnectTimeout from None
        except OSError as e:
            raise _ConnectError from e

    def _fail(self, b: Backend, kind: str, status: int, message: str) -> Failure:
        """A failure of the backend's: counted against its health and in its stats. The
        message names no backend (the response's backend header does) and no exception."""
        self.metrics.upstream_errors.labels(b.name, kind).inc()
        self.health.record_failure(b, kind)
        b.stats.observe_completion(False, kind)
        code = "upstream_timeout" if kind.endswith("timeout") else "upstream_error"
        return Failure(kind, status, message, code, retryable=True)

    @staticmethod
    def _local_failure(e: BaseException, request_id: str) -> Failure:
        """An exception on the proxy's own side before anything reached the backend: never
        the backend's fault (no health, no stats, no retry); logged once, 500 to the client."""
        log.error("request %s: local error before sending upstream", request_id, exc_info=e)
        return Failure(LOCAL, 500, "internal proxy error", "internal_error", retryable=False)

    async def _upstream_5xx(self, b: Backend, conn: Connection, deadline: float) -> Failure:
        """A retry status: the backend's own body is kept (up to ERROR_BODY_CAP bytes; a larger
        one, or one cut short, is dropped for the proxy's own error) in case no other backend
        does better."""
        status = conn.status
        kind = f"http_{status}"
        wd = _Watchdog(conn, self._t.idle_s, deadline)
        data = b""
        whole = True
        try:
            data = await conn.read(ERROR_BODY_CAP)
        except UpstreamError:
            whole = False  # its headers would promise a body the client never gets
        finally:
            wd.cancel()
        f = self._fail(b, kind, status, f"backend answered {status}")
        if whole and len(data) <= ERROR_BODY_CAP:
            f.upstream = (status, _response_headers(conn.headers), data)
        return f

    async def _whole(
        self,
        request: web.BaseRequest,
        conn: Connection,
        b: Backend,
        api: Api | None,
        route: str,
        request_id: str,
        t_arrive: float,
        pending: _Pending,
        deadline: float,
    ) -> web.StreamResponse | Failure:
        """A response that is not an event stream, relayed as it arrives (never held whole).
        The client's headers wait for the first bytes, so a backend that fails before them is
        retried elsewhere; one that fails after them leaves the client a cut body (the
        connection is closed: its length or chunked framing tells it so). A body that came
        whole before the client's headers went (the usual JSON answer) is answered as one
        response."""
        bm = self.metrics.backend(b.name)
        stall = self._t.write_stall_s
        wd = _Watchdog(conn, self._t.idle_s, deadline, request.transport, stall)
        try:
            await conn.first_data()
        except asyncio.CancelledError:
            wd.cancel()
            bm.disconnects.inc()
            raise
        except UpstreamError as e:
            wd.cancel()
            kind = wd.fired or e.kind
            status = 504 if kind.endswith("timeout") else 502
            return self._fail(b, kind, status, "backend failed while sending its response")
        headers = _response_headers(conn.headers)
        headers[self._backend_header] = b.name
        headers[self._rid_header] = request_id
        read_usage = api is not None and conn.status == 200
        if conn.complete:
            wd.cancel()
            data = conn.take()
            tokens = self._completed(
                b, bm, conn.status, t_arrive, data if read_usage else None, pending.usage
            )
            _note(request, None, tokens)
            bm.duration.observe(time.monotonic() - t_arrive)
            bm.request(route, conn.status).inc()
            return web.Response(status=conn.status, body=data, headers=headers)
        out = web.StreamResponse(status=conn.status, headers=headers)
        length = conn.headers.get("Content-Length")
        if length is not None and length.isdigit():
            out.content_length = int(length)
        self._relays.add(wd)
        failure: str | None = None
        monotonic = time.monotonic
        try:
            chunked = _chunked(request, out)
            await out.prepare(request)
            assert request.transport is not None
            sink = _BodySink(
                request.transport, wd, chunked, read_usage, self.settings.upstream.max_event_bytes
            )
            await conn.relay(sink)
        except asyncio.CancelledError:
            bm.disconnects.inc()
            bm.duration.observe(monotonic() - t_arrive)
            bm.request(route, conn.status).inc()
            raise
        except UpstreamError as e:
            failure = wd.fired or e.kind
        except ConnectionError:
            failure = CLIENT_STALLED
        finally:
            wd.cancel()
            self._relays.discard(wd)
        now = monotonic()
        if failure == CLIENT_STALLED:  # the client went away or stopped reading: not the backend's
            bm.disconnects.inc()
            bm.duration.observe(now - t_arrive)
            bm.request(route, conn.status).inc()
            return out
        if failure is not None:
            if failure != SHUTDOWN:
                _log_cut(request_id, b, failure, None)
                self.metrics.upstream_errors.labels(b.name, failure).inc()
                self.health.record_failure(b, failure)
                b.stats.observe_completion(False, failure, now - t_arrive)
            if request.transport is not None:
                request.transport.abort()  # the body is cut: the client must not take it whole
        else:
            parts = sink.parts
            whole = b"".join(parts) if parts is not None else None
            tokens = self._completed(b, bm, conn.status, t_arrive, whole, pending.usage, now)
            _note(request, None, tokens)
            await _last_write(request, stall, out.write_eof())
        bm.duration.observe(monotonic() - t_arrive)
        bm.request(route, conn.status).inc()
        return out

    def _completed(
        self,
        b: Backend,
        bm: Any,
        status: int,
        t_arrive: float,
        body: bytes | None,
        usage: Usage,
        now: float | None = None,
    ) -> int | None:
        """A whole non-streamed answer arrived: its usage (from ``body``, when given: the prompt
        side into ``usage``), health and stats; its output tokens."""
        now = time.monotonic() if now is None else now
        tokens = None
        if body is not None:
            said = body_usage(body)
            tokens = said.completion_tokens
            usage.prompt_tokens, usage.cached_tokens = said.prompt_tokens, said.cached_tokens
        if tokens:
            bm.tokens.inc(tokens)
            b.stats.observe_tokens(tokens, now)
        ok = status < 500
        if ok:
            self.health.record_success(b)
        fine = ok and status != 429  # ADAPT: a 429 counts as slow for routing
        b.stats.observe_completion(
            fine, None if fine else f"http_{status}", now - t_arrive, output_tokens=tokens
        )
        return tokens

    async def _stream(
        self,
        request: web.BaseRequest,
        conn: Connection,
        b: Backend,
        api: Api | None,
        route: str,
        request_id: str,
        t_arrive: float,
        pending: _Pending,
        deadline: float,
    ) -> web.StreamResponse | Failure:
        bm = self.metrics.backend(b.name)
        t_send = pending.t_send
        stall = self._t.write_stall_s
        wd = _Watchdog(conn, self._t.idle_s, deadline, request.transport, stall)
        # Hold the client's headers until the first bytes: a backend that fails before them
        # can still be retried elsewhere.
        try:
            await conn.first_data()
        except asyncio.CancelledError:
            wd.cancel()
            bm.disconnects.inc()
            raise
        except UpstreamError as e:
            wd.cancel()
            kind = wd.fired or e.kind
            return self._fail(b, kind, 504 if wd.fired else 502, "backend failed before streaming")
        headers = _response_headers(conn.headers)
        headers[self._backend_header] = b.name
        headers[self._rid_header] = request_id
        out = web.StreamResponse(status=conn.status, headers=headers)
        framer = (
            framer_for(api, self.settings.upstream.max_event_bytes) if api is not None else None
        )
        self._relays.add(wd)
        counter = TokenCounter(api) if api is not None else None
        failure: str | None = None
        sink: _EventSink | None = None
        try:
            chunked = _chunked(request, out)
            await out.prepare(request)
            assert request.transport is not None
            sink = _EventSink(
                request.transport, wd, chunked, framer, counter, b, bm, pending, request_id
            )
            await conn.relay(sink)
        except asyncio.CancelledError:
            bm.disconnects.inc()
            self._account(
                b, bm, route, out.status, t_arrive, counter, "client_disconnect", pending.usage
            )
            raise
        except UpstreamError as e:
            failure = wd.fired or e.kind
        except ConnectionError:  # the client went away (a write failed)
            failure = CLIENT_STALLED
        finally:
            wd.cancel()
            self._relays.discard(wd)
        if failure == CLIENT_STALLED:
            bm.disconnects.inc()
            self._account(
                b, bm, route, out.status, t_arrive, counter, "client_disconnect", pending.usage
            )
            return out
        if failure == SHUTDOWN:
            message, code, status = "the proxy is shutting down", "shutting_down", 503
        elif failure is not None:
            _log_cut(request_id, b, failure, counter)
            self.metrics.upstream_errors.labels(b.name, failure).inc()
            self.health.record_failure(b, failure)
            message = {
                "idle_timeout": "backend stalled mid-stream (idle timeout)",
                "total_timeout": "request exceeded the total timeout",
            }.get(failure, "backend connection lost mid-stream")
            code = "upstream_timeout" if failure.endswith("timeout") else "upstream_error"
            status = 504 if failure.endswith("timeout") else 502
        framer = sink.framer if sink is not None else None
        if failure is not None:
            closing = ndjson_error if api in NDJSON_APIS else sse_error
            tail = (
                b""
                if framer is None or not framer.pending
                else b"\n"
                if closing is ndjson_error
                else b"\n\n"
            )
            await _last_write(
                request, stall, out.write(tail + closing(message, status=status, code=code))
            )
        else:
            self.health.record_success(b)
        await _last_write(request, stall, out.write_eof())
        tokens = self._account(b, bm, route, out.status, t_arrive, counter, failure, pending.usage)
        first = sink.first if sink is not None else None
        _note(request, None if first is None else first - t_send, tokens)
        return out

    def _account(
        self,
        b: Backend,
        bm: Any,
        route: str,
        status: int,
        t_arrive: float,
        counter: TokenCounter | None,
        failure: str | None,
        usage: Usage,
    ) -> int | None:
        """A stream ended: its tokens, health and stats, metrics (the prompt side of its usage
        into ``usage``); its output tokens."""
        now = time.monotonic()
        tokens = None
        if counter is not None:
            usage.prompt_tokens, usage.cached_tokens = counter.prompt_tokens, counter.cached_tokens
            tokens = counter.completion_tokens or counter.chunk_tokens
            if tokens:
                bm.tokens.inc(tokens)
            if counter.malformed:
                bm.malformed.inc(counter.malformed)
        if failure not in ("client_disconnect", SHUTDOWN):  # not the backend's doing
            ok = failure is None and (counter is None or counter.error is None)
            kind = failure or (None if ok else "stream_error")
            b.stats.observe_completion(ok, kind, now - t_arrive, output_tokens=tokens)
        bm.duration.observe(now - t_arrive)
        bm.request(route, status).inc()
        return tokens


def _note(request: web.BaseRequest, ttft: float | None, tokens: int | None) -> None:
    """For the access log, when it is on (proxy/logs.py)."""
    outcome = request.get(OUTCOME)
    if outcome is not None:
        outcome.ttft, outcome.tokens = ttft, tokens


def _log_cut(request_id: str, b: Backend, failure: str, counter: TokenCounter | None) -> None:
    """A backend failed after bytes reached the client: the one line an SRE looks for."""
    tokens = (counter.completion_tokens or counter.chunk_tokens) if counter is not None else None
    OPS.warning(
        "request %s: backend %s failed mid-response (%s) after %s tokens; the client's "
        "response is cut",
        request_id,
        b.name,
        failure,
        tokens if tokens is not None else "?",
        extra={
            "event": "stream_failure",
            "request_id": request_id,
            "backend": b.name,
            "kind": failure,
            "tokens": tokens,
        },
    )


class _Pending:
    """One request sent upstream until its first token (or its end): the backend's stats count
    it as awaiting an answer, whichever way the attempt ends.

    A streamed request still waiting for the backend's response headers (SGLang sends them
    with the first token) can be *recalled* when the backend's limit falls below its in-flight
    count: the attempt is cancelled, which closes the upstream connection (SGLang aborts the
    request), and the request goes back to the proxy's queue, to whichever backend frees first.
    Nothing has reached the client by then, so this is a retry like any before the first byte.
    Only streamed requests are recallable: a non-streamed one has no first token to tell
    queued from running.
    """

    __slots__ = ("_key", "_stats", "_task", "recallable", "recalled", "t_send", "usage")

    def __init__(self, stats: Any, t_send: float, streamed: bool, usage: Usage) -> None:
        self.t_send = t_send
        self.usage = usage
        self._stats = stats
        self._task = asyncio.current_task() if streamed else None
        self.recallable = False
        self.recalled = False
        self._key = stats.observe_sent(
            t_send, self._recall if streamed else None, streamed=streamed
        )

    def _recall(self) -> bool:
        if not self.recallable or self._task is None or self._task.done():
            return False
        self.recallable = False
        self.recalled = True
        self._task.cancel()
        return True

    def answered(self, now: float | None = None) -> None:
        self.recallable = False
        stats, self._stats = self._stats, None
        if stats is not None:
            stats.observe_answered(now, self._key)


async def _last_write(request: web.BaseRequest, stall: float, write: Awaitable[None]) -> None:
    """A write after the relay loop, bounded like its writes: a client that takes nothing for
    ``stall`` seconds is cut off."""
    try:
        async with asyncio.timeout(stall):
            await write
    except TimeoutError:
        if request.transport is not None:
            request.transport.abort()
    except ConnectionError:
        pass


def _response_headers(src: CIMultiDictProxy[str]) -> CIMultiDict:
    out: CIMultiDict = CIMultiDict()
    drop = HOP_BY_HOP
    connection = src.get("Connection")
    if connection:
        drop = drop | {t.strip().lower() for t in connection.split(",")}
    for k, v in src.items():
        if k.lower() not in drop:
            out.add(k, v)
    return out


#: largest error body of a retry status (5xx) kept to relay; a larger one is replaced
ERROR_BODY_CAP = 64 * 1024
#: bytes of each backend's answer a fan-out reads (the rest is cut, and it says so)
FANOUT_BODY_CAP = 64 * 1024


def _fanout_body(data: bytes, ctype: str) -> dict[str, Any]:
    truncated = len(data) > FANOUT_BODY_CAP
    data = data[:FANOUT_BODY_CAP]
    out: dict[str, Any] = {}
    if ctype.startswith("application/json") and not truncated:
        try:
            out["body"] = orjson.loads(data)
            return out
        except orjson.JSONDecodeError:
            pass
    out["body"] = data.decode("utf-8", errors="replace")
    if truncated:
        out["truncated"] = True
    return out


__all__ = ["JSON", "Failure", "Forwarder", "Lease"]
