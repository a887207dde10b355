"""The simulated engine as the HTTP layer sees it: submit a request, iterate its tokens.

`Engine` runs the pure `Scheduler` (loadtest/sim/scheduler.py) on a `Clock`: one asyncio task
per engine sleeps until the scheduler's next event and parks on an event when idle, so many
engines in one process cost nothing while idle and one timer wake-up per step when busy.

    engine = Engine(load_profile("pp8"), WallClock(0.1), seed=0)
    await engine.start()
    stream = engine.submit(GenRequest("r1", prompt_tokens=1024, max_new_tokens=512))
    async for ev in stream:          # TokenEvent(token_ids, finish)
        ...
    await engine.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from dataclasses import dataclass

from loadtest.sim.clock import Clock, WallClock
from loadtest.sim.profiles import Profile
from loadtest.sim.scheduler import (
    DuplicateRequestError,
    EngineCounters,
    EngineStats,
    Finish,
    GenRequest,
    Req,
    Scheduler,
)

log = logging.getLogger(__name__)

__all__ = [
    "DuplicateRequestError",
    "Engine",
    "EngineCounters",
    "EngineStats",
    "Finish",
    "GenRequest",
    "RequestStream",
    "TokenEvent",
]


@dataclass(slots=True)
class TokenEvent:
    """Tokens generated since the previous event; `finish` is set on the last one."""

    token_ids: list[int]
    finish: Finish | None = None


class RequestStream:
    """Async iterator over one request's `TokenEvent`s.

    Tokens the reader has not collected yet are merged into one event (as SGLang's tokenizer
    manager merges outputs when the client is slower than the engine). The iteration ends
    after the event that carries `finish`.
    """

    def __init__(self, engine: Engine, req: Req) -> None:
        self._engine = engine
        self._req = req
        self._pending: deque[TokenEvent] = deque()
        self._ready = asyncio.Event()
        self._done = False
        self.completion_tokens = 0

    # what the server reports in meta_info / usage / trace
    @property
    def rid(self) -> str:
        return self._req.rid

    @property
    def prompt_tokens(self) -> int:
        return self._req.prompt_tokens

    @property
    def cached_tokens(self) -> int:
        return self._req.cached_tokens

    @property
    def num_retractions(self) -> int:
        return self._req.num_retractions

    @property
    def finish(self) -> Finish | None:
        return self._req.finish

    @property
    def t_arrival(self) -> float:
        """Modelled time the engine received the request."""
        return self._req.arrival

    @property
    def t_first(self) -> float | None:
        """Modelled time of the first generated token."""
        return self._req.t_first

    @property
    def t_last(self) -> float | None:
        return self._req.t_last

    def _push(self, ids: list[int], finish: Finish | None) -> None:
        self.completion_tokens += len(ids)
        if self._pending and self._pending[-1].finish is None:
            last = self._pending[-1]
            last.token_ids.extend(ids)
            last.finish = finish
        else:
            self._pending.append(TokenEvent(list(ids), finish))
        self._ready.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> TokenEvent:
        while not self._pending:
            if self._done:
                raise StopAsyncIteration
            self._ready.clear()
            await self._ready.wait()
        ev = self._pending.popleft()
        if ev.finish is not None:
            self._done = True
        return ev

    def abort(self) -> bool:
        return self._engine.abort(self.rid)


class Engine:
    """A simulated SGLang engine (one backend) on an injectable clock."""

    def __init__(
        self, profile: Profile, clock: Clock, seed: int = 0, radix_cache: bool = True
    ) -> None:
        self.profile = profile
        self.clock = clock
        self.seed = seed
        self.scheduler = Scheduler(profile, seed=seed, emit=self._emit, radix_cache=radix_cache)
        self._streams: dict[str, RequestStream] = {}
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Future[None] | None = None
        self._planned: float | None = None  # when the loop will next wake by itself

    # --- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name=f"sim-engine-{self.profile.name}"
            )

    async def stop(self) -> None:
        """Stop the loop and abort every live request (their streams end with 'abort')."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.abort_all(message="The server is shutting down", status_code=503)

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    # --- requests -------------------------------------------------------------------------
    def submit(self, request: GenRequest) -> RequestStream:
        """Queue a request and return its token stream (never blocks).

        Raises DuplicateRequestError (a ValueError) if `request.rid` is still live.
        """
        now = self._now()
        req = self.scheduler.submit(request, now)
        stream = RequestStream(self, req)
        if req.state == "done":  # rejected at once (a prompt that can never fit the pool)
            stream._push([], req.finish)
            return stream
        self._streams[req.rid] = stream
        self._poke()
        return stream

    def abort(self, rid: str) -> bool:
        """Abort a live request now: frees its slot and KV tokens; False if unknown/finished."""
        self.scheduler._now = max(self.scheduler._now, self._now())
        ok = self.scheduler.abort(rid)
        if ok:
            self._poke()
        return ok

    def abort_all(self, message: str = "Abort request", status_code: int | None = None) -> int:
        n = self.scheduler.abort_all(message, status_code)
        if n:
            self._poke()
        return n

    def flush_cache(self) -> bool:
        """Drop the prefix cache (``/flush_cache``); False while requests run or wait."""
        return self.scheduler.flush_cache()

    # --- stats ----------------------------------------------------------------------------
    def live_stats(self) -> EngineStats:
        """The true current gauges (whole engine)."""
        return self.scheduler.live_stats()

    def logged_stats(self) -> EngineStats:
        """What SGLang's /metrics gauges would show now: the last log point's values."""
        return self.scheduler.logged_stats()

    @property
    def counters(self) -> EngineCounters:
        return self.scheduler.counters

    def get_load(self) -> list[dict[str, int]]:
        """/get_load rows, one per DP rank (requests and KV tokens split evenly)."""
        s = self.scheduler
        dp = self.profile.dp_size
        run, wait, used = s.num_running, len(s.waiting), s.used_tokens
        return [
            {
                "dp_rank": r,
                "num_reqs": run // dp + (r < run % dp) + wait // dp + (r < wait % dp),
                "num_waiting_reqs": wait // dp + (r < wait % dp),
                "num_tokens": used // dp + (r < used % dp),
            }
            for r in range(dp)
        ]

    # --- internals ------------------------------------------------------------------------
    def _now(self) -> float:
        return max(self.clock.now(), self.scheduler._now)

    def _emit(self, req: Req, ids: list[int], finish: Finish | None) -> None:
        stream = self._streams.get(req.rid)
        if stream is None:
            return
        stream._push(ids, finish)
        if finish is not None:
            del self._streams[req.rid]

    def _poke(self) -> None:
        """Wake the loop if the scheduler now has something to do sooner than planned."""
        fut = self._wake
        if fut is None or fut.done():
            return
        t = self.scheduler.next_time()
        if t is not None and (self._planned is None or t < self._planned):
            fut.set_result(None)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        sched = self.scheduler
        wall = self.clock if isinstance(self.clock, WallClock) else None
        while True:
            self._wake = wake = loop.create_future()
            try:
                sched.advance(self._now())
            except Exception:  # a model bug must not hang every client: fail them, go on
                log.exception(
                    "simulated engine %s failed; aborting its requests", self.profile.name
                )
                sched.abort_all("internal error in the simulated engine", 500)
            t = sched.next_time()
            self._planned = t
            if t is None:
                await wake
                continue
            delay = t - self.clock.now()
            if delay <= 0:
                await asyncio.sleep(0)  # let readers run between passes
                continue
            if wall is not None:  # one timer, no task per pass
                timer = loop.call_later(delay * wall.time_scale, _resolve, wake)
                try:
                    await wake
                finally:
                    timer.cancel()
                continue
            sleeper = loop.create_task(self.clock.sleep(delay))
            try:
                await asyncio.wait((sleeper, wake), return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not sleeper.done():
                    sleeper.cancel()


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
