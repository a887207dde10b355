"""proxy/upstream.py on real sockets: keep-alive reuse, framing, back-pressure, bounds."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from multidict import CIMultiDict

from proxy.upstream import Origin, UpstreamError, UpstreamPool, request_bytes


@contextlib.asynccontextmanager
async def raw_server(answer):
    """A server on 127.0.0.1 that reads one request head (and body) at a time and lets
    ``answer(writer, head)`` reply; counts the connections it accepted."""
    accepted = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        await reader.readexactly(int(line.split(b":")[1]))
                if await answer(writer, head) is False:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield Origin("127.0.0.1", port, False), accepted
    finally:
        server.close()
        for w in accepted:
            w.close()


def req(origin: Origin, method: str = "POST", body: bytes | None = b"{}") -> bytes:
    return request_bytes(method, "/v1/x", origin, CIMultiDict(), body)


async def exchange(pool: UpstreamPool, origin: Origin, method: str = "POST") -> tuple[int, bytes]:
    conn = await pool.connect(origin)
    conn.send(req(origin, method), head_only=method == "HEAD")
    await conn.head()
    body = await conn.read(1 << 20)
    status = conn.status
    conn.release()
    return status, body


async def ok(writer, head):
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello")
    await writer.drain()


async def test_keep_alive_connections_are_reused():
    async with raw_server(ok) as (origin, accepted):
        pool = UpstreamPool(keepalive_s=4)
        for _ in range(3):
            assert await exchange(pool, origin) == (200, b"hello")
        assert len(accepted) == 1
        assert pool.open_connections == 1
        pool.close()


async def test_a_body_ended_by_the_connection_is_whole_and_not_reused():
    async def eof(writer, head):
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end")
        await writer.drain()
        return False  # closes the connection: that ends the body

    async with raw_server(eof) as (origin, accepted):
        pool = UpstreamPool(keepalive_s=4)
        assert await exchange(pool, origin) == (200, b"until the end")
        assert await exchange(pool, origin) == (200, b"until the end")
        assert len(accepted) == 2
        assert pool.open_connections == 0
        pool.close()


async def test_a_head_answer_has_no_body_whatever_its_length_says():
    async def head_answer(writer, head):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n")
        await writer.drain()

    async with raw_server(head_answer) as (origin, _):
        pool = UpstreamPool(keepalive_s=4)
        assert await asyncio.wait_for(exchange(pool, origin, "HEAD"), 5) == (200, b"")
        pool.close()


async def test_chunked_body_is_decoded_and_a_garbled_answer_fails():
    async def chunked(writer, head):
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n")
        await asyncio.sleep(0.01)
        writer.write(b"2\r\nde\r\n0\r\n\r\n")
        await writer.drain()

    async with raw_server(chunked) as (origin, _):
        pool = UpstreamPool(keepalive_s=4)
        assert await exchange(pool, origin) == (200, b"abcde")
        pool.close()

    async def garbled(writer, head):
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        await writer.drain()

    async with raw_server(garbled) as (origin, _):
        pool = UpstreamPool(keepalive_s=4)
        conn = await pool.connect(origin)
        conn.send(req(origin))
        with pytest.raises(UpstreamError) as e:
            await asyncio.wait_for(conn.head(), 5)
        assert e.value.kind == "disconnect" and not e.value.stale
        pool.close()


async def test_a_connection_the_server_closed_while_idle_is_not_reused():
    async def once(writer, head):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        return False  # keep-alive promised, then closed (as an idle timeout would)

    async with raw_server(once) as (origin, accepted):
        pool = UpstreamPool(keepalive_s=4)
        assert await exchange(pool, origin) == (200, b"ok")
        await asyncio.sleep(0.05)  # the close arrives: the pool drops the connection
        assert await exchange(pool, origin) == (200, b"ok")
        assert len(accepted) == 2
        pool.close()


class SlowSink:
    def __init__(self) -> None:
        self.got = bytearray()
        self.hold = True

    def feed(self, data: bytes) -> bool:
        self.got += data
        return self.blocked()

    def blocked(self) -> bool:
        return self.hold


async def test_a_blocked_sink_pauses_reading_from_the_backend_until_it_takes_again():
    sent = asyncio.Event()

    async def stream(writer, head):
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(20):
            writer.write(b"1\r\nx\r\n")
            await writer.drain()
            await asyncio.sleep(0.01)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        sent.set()

    async with raw_server(stream) as (origin, _):
        pool = UpstreamPool(keepalive_s=4)
        conn = await pool.connect(origin)
        conn.send(req(origin))
        await conn.head()
        sink = SlowSink()
        relay = asyncio.ensure_future(conn.relay(sink))
        await asyncio.wait_for(sent.wait(), 5)  # the server wrote all (the socket buffers it)
        await asyncio.sleep(0.05)
        assert conn.transport is not None and not conn.transport.is_reading()
        assert not relay.done() and len(sink.got) < 20
        sink.hold = False
        await asyncio.wait_for(relay, 5)
        assert bytes(sink.got) == b"x" * 20
        conn.release()
        assert pool.open_connections == 1  # whole: kept for the next request
        pool.close()


async def test_per_backend_bound_makes_the_next_caller_wait_for_a_release():
    async with raw_server(ok) as (origin, accepted):
        pool = UpstreamPool(keepalive_s=4, per_origin=1)
        first = await pool.connect(origin)
        second = asyncio.ensure_future(pool.connect(origin))
        await asyncio.sleep(0.05)
        assert not second.done()
        first.send(req(origin))
        await first.head()
        await first.read(100)
        first.release()
        conn = await asyncio.wait_for(second, 5)
        assert conn is first  # the released connection, not a new one
        assert len(accepted) == 1
        pool.close()


async def test_a_response_ending_in_the_read_that_blocked_its_sink_leaves_the_connection_reading():
    async def at_once(writer, head):
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n")
        await writer.drain()

    async with raw_server(at_once) as (origin, accepted):
        pool = UpstreamPool(keepalive_s=4)
        conn = await pool.connect(origin)
        conn.send(req(origin))
        await conn.head()
        await asyncio.wait_for(conn.relay(SlowSink()), 5)  # blocked, but the body is whole
        conn.release()
        assert await asyncio.wait_for(exchange(pool, origin), 5) == (200, b"abc")
        assert len(accepted) == 1  # the same connection served the next request
        pool.close()
