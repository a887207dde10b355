"""Writes one generation as an SSE stream, for any route's event shapes.

A *shaper* (chat, completions, /generate) turns token steps into events:
``opening()`` after the first step arrives, ``content(step, usage)`` per step (``None`` to
skip), ``closing(include_usage)`` at the end. When the headers go out follows SGLang per route:
the OpenAI routes kick-start their generator and send HTTP 200 only with the first chunk (an
error before it is still a 400/503 JSON answer), while native ``/generate`` returns its
streaming response at once (``headers_first``): the headers go out while the request may still
queue, and an error before any token is ``200`` with ``data: {"error": {"message": ...}}`` then
``[DONE]``. The writer marks every token-carrying write for the trace and histograms, and
carries out the request's stall/drop fault.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Protocol

from aiohttp import web

from loadtest.sim.faults import Decision
from loadtest.sim.generation import Generation, Step
from loadtest.sim.http_util import DONE_EVENT, SSE_HEADERS, sse


class Shaper(Protocol):
    #: send the headers before the first step (native /generate), else with it (OpenAI routes)
    headers_first: bool

    def opening(self) -> list[bytes]: ...
    def content(self, step: Step, usage: dict | None, index: int = 0) -> bytes | None: ...
    def closing(self, include_usage: bool) -> list[bytes]: ...
    def reject(self, finish: dict) -> web.Response: ...


def running_usage(gen: Generation) -> dict:
    return {
        "prompt_tokens": gen.prompt_tokens,
        "total_tokens": gen.prompt_tokens + gen.completion_tokens,
        "completion_tokens": gen.completion_tokens,
        "prompt_tokens_details": gen.prompt_tokens_details(),
        "reasoning_tokens": 0,
    }


class StreamWriter:
    """Streams one generation, or several interleaved (a batch ``/generate``)."""

    def __init__(
        self, request: web.Request, gens: Generation | list[Generation], decision: Decision
    ) -> None:
        self.request, self.decision = request, decision
        self.gens = gens if isinstance(gens, list) else [gens]
        self.sent_tokens = 0

    async def run(
        self, shaper: Any, include_usage: bool = False, continuous_usage: bool = False
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        async with _merged(self.gens) as steps:
            try:
                if shaper.headers_first:
                    await resp.prepare(self.request)
                item = await _next(steps)
                if item is not None and _rejected(item[1]):
                    # refused before any token (e.g. the prompt cannot fit the KV pool)
                    if not shaper.headers_first:  # SGLang's kick-started generator: an error
                        return shaper.reject(item[1].finish)  # answer instead of HTTP 200
                    await resp.write(sse({"error": {"message": _message(item[1].finish)}}))
                    await resp.write(DONE_EVENT)
                    await resp.write_eof()
                    return resp
                if not shaper.headers_first:
                    await resp.prepare(self.request)
                await self._send(resp, shaper, steps, item, include_usage, continuous_usage)
            except ConnectionError:
                # the client left between two writes (before aiohttp cancelled this handler):
                # nothing more to send; the generation's close() aborts it in the engine
                pass
        return resp

    async def _send(self, resp, shaper, steps, item, include_usage, continuous_usage) -> None:
        for data in shaper.opening():
            await resp.write(data)
        while item is not None:
            index, step = item
            if self._fault_due(step):
                await self._fault()
                return
            gen = self.gens[index]
            usage = running_usage(gen) if continuous_usage else None
            data = shaper.content(step, usage, index)
            if data is not None:
                gen.mark_write(len(step.token_ids))
                await resp.write(data)
                self.sent_tokens += len(step.token_ids)
            item = await _next(steps)
        for data in shaper.closing(include_usage):
            await resp.write(data)
        await resp.write_eof()

    def _fault_due(self, step: Step) -> bool:
        """A stall/drop fires after ``after_tokens`` tokens, and always before the last chunk."""
        if self.decision.fate not in ("stall", "drop"):
            return False
        return self.sent_tokens >= self.decision.after_tokens or step.finish is not None

    async def _fault(self) -> None:
        if self.decision.fate == "stall":  # hold the connection open, send nothing more
            await asyncio.Event().wait()  # until the client leaves (handler cancelled)
        transport = self.request.transport
        if transport is not None:
            transport.abort()  # drop: cut the connection mid-stream


def _message(finish: dict | None) -> str:
    return (finish or {}).get("message") or "Abort"


def _rejected(step: Step) -> bool:
    f = step.finish
    return bool(f and f.get("type") == "abort" and f.get("status_code") and not step.token_ids)


async def _next(steps: AsyncIterator[tuple[int, Step]]) -> tuple[int, Step] | None:
    try:
        return await steps.__anext__()
    except StopAsyncIteration:
        return None


@asynccontextmanager
async def _merged(gens: list[Generation]) -> AsyncIterator[AsyncIterator[tuple[int, Step]]]:
    """(index, step) pairs of every generation, in the order they are produced."""
    if len(gens) == 1:
        yield _indexed(0, gens[0])
        return
    queue: asyncio.Queue[tuple[int, Step] | None] = asyncio.Queue()

    async def pump(i: int, gen: Generation) -> None:
        try:
            async for step in gen.steps():
                queue.put_nowait((i, step))
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]

    async def drain() -> AsyncIterator[tuple[int, Step]]:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is None:
                left -= 1
            else:
                yield item

    try:
        yield drain()
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _indexed(i: int, gen: Generation) -> AsyncIterator[tuple[int, Step]]:
    async for step in gen.steps():
        yield i, step
