"""The simulator's aiohttp server: one `SimBackend` (engine + state) per port.

Served like SGLang behind uvicorn: idle keep-alive connections are closed after
``keepalive_s`` (5 s by default), and a client that disconnects cancels its handler at
once (``handler_cancellation``), which aborts its request in the engine. An HTTP/2
prior-knowledge preface (sglang-router tries one first) is answered 400 by aiohttp's
parser; the log records one line instead of a traceback, so the client falls back to
HTTP/1.1 cleanly.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from loadtest.sim.clock import WallClock
from loadtest.sim.engine import Engine
from loadtest.sim.faults import Faults
from loadtest.sim.http_util import BACKEND
from loadtest.sim.profiles import Profile
from loadtest.sim.prom import SimMetrics

log = logging.getLogger("loadtest.sim")

SGLANG_VERSION = "0.5.5"  # the version string /server_info reports
MAX_BODY = 64 * 1024 * 1024


@dataclass
class SimBackend:
    """One simulated SGLang server: its profile, engine, faults, metrics and status."""

    profile: Profile
    port: int = 30000
    host: str = "127.0.0.1"
    time_scale: float = 1.0
    seed: int = 0
    radix_cache: bool = True  # SGLang's prefix cache (off: --disable-radix-cache)
    enable_cache_report: bool = False  # usage.prompt_tokens_details.cached_tokens (OpenAI)
    enable_metrics: bool = True  # /metrics (off: 404, as SGLang without --enable-metrics)
    #: /server_info's max_running_requests is the profile's, as if the operator passed
    #: --max-running-requests; off: null there, the scheduler's value only in /v1/loads
    max_running_arg: bool = True
    #: serve what any OpenAI-compatible server does and no more: inference, health, models (no
    #: /metrics, /server_info or load report), as a server that is not SGLang
    inference_only: bool = False
    faults: Faults = field(default_factory=Faults)
    trace: IO[bytes] | None = None
    engine: Any = None
    status: str = "starting"  # starting | ready | shutting_down
    created: int = field(default_factory=lambda: int(time.time()))
    version: str = SGLANG_VERSION

    def __post_init__(self) -> None:
        if self.engine is None:
            self.engine = Engine(
                self.profile, WallClock(self.time_scale), seed=self.seed,
                radix_cache=self.radix_cache,
            )  # fmt: skip
        self.metrics = SimMetrics(
            self.engine,
            model_name=self.model_name,
            parallelism=self.profile.parallelism,
            dp_size=self.profile.dp_size,
            tp_size=self.profile.tp_size,
            pp_size=self.profile.pp_size,
            priority=self.profile.priority_scheduling,
        )
        self.health_checks = 0

    @property
    def model_name(self) -> str:
        return self.profile.model_name

    @property
    def ready(self) -> bool:
        return self.status == "ready" and not self.faults.starting

    def new_rid(self) -> str:
        return uuid.uuid4().hex

    def trace_write(self, record: dict) -> None:
        if self.trace is not None:
            self.trace.write(orjson.dumps(record) + b"\n")
            self.trace.flush()

    async def start(self) -> None:
        await self.engine.start()
        self.faults.started_at = time.monotonic()
        self.status = "ready"

    async def stop(self) -> None:
        """Not ready any more; live requests finish with a 503 abort."""
        self.status = "shutting_down"
        await self.engine.stop()


def build_app(backend: SimBackend) -> web.Application:
    from loadtest.sim import faults_api, native_api, openai_api

    app = web.Application(client_max_size=MAX_BODY)
    app[BACKEND] = backend
    openai_api.add_routes(app)
    native_api.add_routes(app)
    faults_api.add_routes(app)
    return app


class _PrefaceFilter(logging.Filter):
    """Turns aiohttp's traceback for a request it cannot parse (an HTTP/2 preface) into a line."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            record.msg = "rejected a request that is not HTTP/1.x (%s); answered 400"
            detail = str(getattr(exc, "message", None) or type(exc).__name__)
            record.args = (detail.splitlines()[0].rstrip(":"),)
            record.exc_info = None
            record.exc_text = None
            record.levelno, record.levelname = logging.INFO, "INFO"
            return logging.getLogger("aiohttp.server").isEnabledFor(logging.INFO)
        return True


def install_log_filter() -> None:
    server_log = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, _PrefaceFilter) for f in server_log.filters):
        server_log.addFilter(_PrefaceFilter())


@asynccontextmanager
async def serve(
    backends: list[SimBackend], *, keepalive_s: float = 5.0, access_log: bool = False
) -> AsyncIterator[list[SimBackend]]:
    """Start every backend on its port; stop them (and their engines) on exit."""
    install_log_filter()
    runners: list[web.AppRunner] = []
    try:
        for b in backends:
            runner = web.AppRunner(
                build_app(b),
                keepalive_timeout=keepalive_s,
                handler_cancellation=True,
                access_log=logging.getLogger("aiohttp.access") if access_log else None,
                shutdown_timeout=0.5,
            )
            await runner.setup()
            runners.append(runner)
            await web.TCPSite(runner, b.host, b.port, reuse_address=True).start()
            await b.start()
        yield backends
    finally:
        for b in backends:
            b.status = "shutting_down"
        for b in backends:
            await b.stop()
        for r in runners:
            await r.cleanup()


def open_trace(path: str | None) -> IO[bytes] | None:
    return None if path is None else Path(path).open("ab")
