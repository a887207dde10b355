"""Helpers for the simulator's server tests: an in-process simulator on a free port."""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import orjson
from conftest import free_port

from loadtest.sim.faults import FaultConfig, Faults
from loadtest.sim.profiles import load_profile
from loadtest.sim.server import SimBackend, serve

FAST = 0.01  # wall seconds per modelled second: TP8's ~37 ms/token becomes ~0.4 ms


@asynccontextmanager
async def running_sim(
    profile: str = "tp8",
    *,
    time_scale: float = FAST,
    keepalive_s: float = 5.0,
    trace: bool = False,
    overrides: dict | None = None,
    radix_cache: bool = True,
    enable_cache_report: bool = False,
    enable_metrics: bool = True,
    max_running_arg: bool = True,
    inference_only: bool = False,
    **faults: object,
) -> AsyncIterator[tuple[str, SimBackend]]:
    prof = load_profile(profile)
    if overrides:
        prof = prof.with_overrides(**overrides)
    backend = SimBackend(
        prof,
        port=free_port(),
        time_scale=time_scale,
        radix_cache=radix_cache,
        enable_cache_report=enable_cache_report,
        enable_metrics=enable_metrics,
        max_running_arg=max_running_arg,
        inference_only=inference_only,
        faults=Faults(FaultConfig(**faults)),
        trace=io.BytesIO() if trace else None,
    )
    async with serve([backend], keepalive_s=keepalive_s):
        yield f"http://127.0.0.1:{backend.port}", backend


def trace_lines(backend: SimBackend) -> list[dict]:
    assert isinstance(backend.trace, io.BytesIO)
    return [orjson.loads(line) for line in backend.trace.getvalue().splitlines()]


def sse_payloads(raw: bytes) -> list[bytes]:
    """The data payloads of a complete SSE body, checking SGLang's exact framing."""
    assert raw.endswith(b"data: [DONE]\n\n"), raw[-200:]
    events = raw.split(b"\n\n")
    assert events[-1] == b""
    out = []
    for e in events[:-1]:
        assert e.startswith(b"data: "), e
        out.append(e[6:])
    return out


def sse_json(raw: bytes) -> list[dict]:
    payloads = sse_payloads(raw)
    assert payloads[-1] == b"[DONE]"
    return [orjson.loads(p) for p in payloads[:-1]]


async def wait_until(predicate, limit_s: float = 5.0) -> None:
    """Poll until predicate() is true (bounded; not a timing assertion)."""
    async with asyncio.timeout(limit_s):
        while not predicate():  # noqa: ASYNC110 - the state lives in the engine
            await asyncio.sleep(0.005)
