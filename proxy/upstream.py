"""HTTP/1.1 to the backends on connections the proxy drives itself.

The relay is the proxy's hot path: at hundreds of streams every decode step lands one event on
every stream at once, and what each event costs on the proxy's one event loop is latency every
user sees. A general client (aiohttp's) reads a body through a buffered stream and wakes the
reading task for every chunk. Here a connection is an asyncio Protocol whose response is parsed
by httptools (llhttp, the parser Node.js uses): the caller awaits the response head once, then
either the whole body (awaited once) or hands the connection a :class:`Sink` that is fed every
body chunk inside ``data_received``, with no task woken per chunk. A sink that cannot take more
(its client is slow) pauses reading from the backend until it can, so back-pressure reaches the
backend's socket.

:class:`UpstreamPool` keeps idle keep-alive connections per backend origin (most recently used
first; one idle longer than ``keepalive_s`` is closed rather than reused, as SGLang closes idle
connections at 5 s) and bounds how many are open, per backend and in all, if told to.
"""

from __future__ import annotations

import asyncio
import enum
import ssl
import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

import httptools
from multidict import CIMultiDict

#: while a sink is blocked, how often it is asked again (seconds)
RESUME_POLL_S = 0.005


class UpstreamError(Exception):
    """The exchange failed; ``kind`` labels pipefill_upstream_errors. ``stale``: it failed on a
    reused keep-alive connection before any byte of an answer, so the backend had most likely
    closed that connection already (the request is worth one retry on a fresh one)."""

    def __init__(self, kind: str, *, stale: bool = False) -> None:
        super().__init__(kind)
        self.kind = kind
        self.stale = stale


class Sink(Protocol):
    """Where a relayed body goes, chunk by chunk."""

    def feed(self, data: bytes) -> bool:
        """Take ``data``; True when the receiver takes nothing more for now (as ``blocked``)."""
        ...

    def blocked(self) -> bool:
        """The receiver takes nothing more for now: pause reading from the backend."""
        ...


class State(enum.Enum):
    IDLE = "idle"  # in the pool, or just opened
    HEAD = "head"  # request sent, waiting for the response head
    BODY = "body"  # head received, body arriving
    DONE = "done"  # the whole response arrived
    CLOSED = "closed"


@dataclass(frozen=True, slots=True)
class Origin:
    """Where connections go: one pool of them per backend origin."""

    host: str
    port: int
    tls: bool

    @classmethod
    def of(cls, url: str) -> Origin:
        parts = urlsplit(url)
        tls = parts.scheme == "https"
        return cls(parts.hostname or "", parts.port or (443 if tls else 80), tls)

    @property
    def authority(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


class Connection(asyncio.Protocol):
    """One keep-alive connection to a backend, one exchange at a time (see the module doc)."""

    def __init__(self, pool: UpstreamPool, origin: Origin) -> None:
        self._pool = pool
        self.origin = origin
        self.state = State.IDLE
        self.transport: asyncio.Transport | None = None
        self.reused = False
        self.idle_since = 0.0
        self._parser = httptools.HttpResponseParser(self)
        self._loop = asyncio.get_running_loop()
        self._head: asyncio.Future[None] | None = None
        self._data: asyncio.Future[None] | None = None  # any body bytes, or the end
        self._done: asyncio.Future[None] | None = None
        self._chunks: list[bytes] = []  # body bytes no sink has taken yet
        self._sink: Sink | None = None
        self._paused = False
        self._head_only = False  # the request was HEAD: its answer has no body
        self._eof_body = False  # the body ends when the connection does
        self.status = 0
        self.headers: CIMultiDict[str] = CIMultiDict()
        self.keep_alive = False

    # ---- what the forwarder calls ------------------------------------------------------

    def send(self, request: bytes, *, head_only: bool = False) -> None:
        """Write one request (its head and body, already framed)."""
        assert self.state is State.IDLE and self.transport is not None
        self.state = State.HEAD
        self._head_only = head_only
        self.status = 0
        self.headers = CIMultiDict()
        self._chunks = []
        self._sink = None
        self._head = self._loop.create_future()
        self._data = self._loop.create_future()
        self._done = self._loop.create_future()
        self.transport.write(request)

    async def head(self) -> None:
        """Until the response head arrived (``status``, ``headers``); raises UpstreamError."""
        assert self._head is not None
        await self._head

    async def first_data(self) -> None:
        """Until some of the body arrived, or all of it (``complete``)."""
        assert self._data is not None
        await self._data

    @property
    def complete(self) -> bool:
        return self.state is State.DONE

    def take(self) -> bytes:
        """The body bytes received and not yet taken."""
        chunks, self._chunks = self._chunks, []
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def read(self, cap: int) -> bytes:
        """The whole body, or its first ``cap``+1 bytes once it grows past ``cap``."""
        assert self._done is not None
        while self.state is not State.DONE and sum(map(len, self._chunks)) <= cap:
            self._data = self._loop.create_future()
            await self._data
        return self.take()[: cap + 1]

    async def relay(self, sink: Sink) -> None:
        """Feed the rest of the body to ``sink`` as it arrives; return when it all did."""
        assert self._done is not None
        self._sink = sink
        if self._chunks and sink.feed(self.take()):
            self._pause()
        await self._done

    def fail(self, error: UpstreamError) -> None:
        """End the exchange now (a deadline passed, shutdown): whoever waits gets ``error``."""
        self._settle(error)
        self._abort()

    def release(self) -> None:
        """The exchange is over: back to the pool if the connection can serve another."""
        if self.state is State.DONE and self.keep_alive and not self._head_only:
            self.state = State.IDLE
            self._pool.put(self)
        else:
            self._abort()

    # ---- asyncio.Protocol --------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.state not in (State.HEAD, State.BODY):
            self._abort()  # bytes nobody asked for: the connection cannot be trusted
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            self._settle(UpstreamError("disconnect"))
            self._abort()
            return
        if self._chunks:
            # what one read brought goes on as one piece (its events arrived together)
            sink = self._sink
            if sink is None:
                _resolve(self._data)
            elif sink.feed(self.take()):
                self._pause()

    def connection_lost(self, exc: BaseException | None) -> None:
        state = self.state
        self.state = State.CLOSED
        self.transport = None
        self._pool.lost(self)
        if state is State.BODY and self._eof_body:
            self._finish()
        elif state in (State.HEAD, State.BODY):
            stale = state is State.HEAD and self.reused and self.status == 0
            self._settle(UpstreamError("disconnect", stale=stale))

    # ---- httptools callbacks -----------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.add(name.decode("latin-1"), value.decode("utf-8", "replace"))

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        if self.status < 200:
            self.headers = CIMultiDict()  # an interim answer: the real one follows
            return
        self.keep_alive = self._parser.should_keep_alive()
        self.state = State.BODY
        h = self.headers
        self._eof_body = "content-length" not in h and "transfer-encoding" not in h
        _resolve(self._head)
        if self._head_only or self.status in (204, 304):
            self._finish()

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)

    def on_message_complete(self) -> None:
        if self.state is State.BODY:
            self._finish()

    # ---- internals ---------------------------------------------------------------------

    def _finish(self) -> None:
        self.state = State.DONE
        _resolve(self._head)
        _resolve(self._data)
        _resolve(self._done)

    def _settle(self, error: UpstreamError) -> None:
        if self.state in (State.DONE, State.IDLE):
            return
        for fut in (self._head, self._data, self._done):
            if fut is not None and not fut.done():
                fut.set_exception(error)
                fut.exception()  # retrieved: nobody may be waiting on all three

    def _abort(self) -> None:
        if self.state is not State.CLOSED:
            self.state = State.CLOSED
            self._pool.lost(self)
        if self.transport is not None:
            self.transport.abort()

    def _pause(self) -> None:
        # (only mid-body: a response that ended in this read has nothing left to hold back,
        # and its connection must go back to the pool reading)
        if self.state is State.BODY and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
            self._loop.call_later(RESUME_POLL_S, self._poll_resume)

    def _poll_resume(self) -> None:
        sink = self._sink
        if self.transport is None or sink is None:
            return
        if sink.blocked():
            self._loop.call_later(RESUME_POLL_S, self._poll_resume)
            return
        self._paused = False
        self.transport.resume_reading()


def _resolve(fut: asyncio.Future[None] | None) -> None:
    if fut is not None and not fut.done():
        fut.set_result(None)


class UpstreamPool:
    """Keep-alive connections per backend origin; at most ``per_origin`` open to one backend
    and ``total`` in all (0: no bound), a caller past a bound waiting for one to free."""

    def __init__(self, *, keepalive_s: float, per_origin: int = 0, total: int = 0) -> None:
        self.keepalive_s = keepalive_s
        self.per_origin = per_origin
        self.total = total
        self._idle: dict[Origin, list[Connection]] = {}
        self._open: dict[Origin, int] = {}
        self._all = 0
        self._conns: set[Connection] = set()
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._tls: ssl.SSLContext | None = None

    def idle(self, origin: Origin) -> Connection | None:
        """A kept-alive connection to ``origin`` ready for a request, if there is one: taking
        it needs no waiting, so no timeout either."""
        idle = self._idle.get(origin)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if conn.transport is None or conn.transport.is_closing():
                continue
            if now - conn.idle_since > self.keepalive_s:
                conn.fail(UpstreamError("expired"))
                continue
            conn.reused = True
            return conn
        return None

    async def connect(self, origin: Origin) -> Connection:
        """A connection to ``origin``: an idle one, else a new one (bound it with a timeout)."""
        conn = self.idle(origin)
        if conn is not None:
            return conn
        while self._full(origin):
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            try:
                await fut
            finally:
                if fut in self._waiters:
                    self._waiters.remove(fut)
            idle = self._idle.get(origin)
            if idle:
                return await self.connect(origin)
        self._opened(origin, +1)
        loop = asyncio.get_running_loop()
        try:
            _t, conn = await loop.create_connection(
                lambda: Connection(self, origin),
                origin.host,
                origin.port,
                ssl=self._ssl() if origin.tls else None,
                server_hostname=origin.host if origin.tls else None,
            )
        except BaseException:
            self._opened(origin, -1)
            raise
        self._conns.add(conn)
        return conn

    def put(self, conn: Connection) -> None:
        conn.idle_since = time.monotonic()
        self._idle.setdefault(conn.origin, []).append(conn)
        self._wake()

    def lost(self, conn: Connection) -> None:
        if conn in self._conns:
            self._conns.discard(conn)
            self._opened(conn.origin, -1)
            idle = self._idle.get(conn.origin)
            if idle and conn in idle:
                idle.remove(conn)
            self._wake()

    def close(self) -> None:
        for conn in list(self._conns):
            conn.fail(UpstreamError("shutdown"))
        self._idle.clear()

    @property
    def open_connections(self) -> int:
        return self._all

    def _full(self, origin: Origin) -> bool:
        return bool(
            (self.per_origin and self._open.get(origin, 0) >= self.per_origin)
            or (self.total and self._all >= self.total)
        )

    def _opened(self, origin: Origin, n: int) -> None:
        self._open[origin] = self._open.get(origin, 0) + n
        self._all += n

    def _wake(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return

    def _ssl(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls


def request_bytes(
    method: str, target: str, origin: Origin, headers: CIMultiDict[str], body: bytes | None
) -> bytes:
    """One request's head and body, framed for HTTP/1.1 (``headers``: end to end ones only)."""
    lines = [f"{method} {target} HTTP/1.1\r\nHost: {origin.authority}\r\n"]
    for k, v in headers.items():
        lines.append(f"{k}: {v}\r\n")
    if body is not None or method in ("POST", "PUT", "PATCH"):
        lines.append(f"Content-Length: {len(body or b'')}\r\n")
    lines.append("\r\n")
    head = "".join(lines).encode("utf-8")
    return head + body if body else head
