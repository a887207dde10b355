"""Injectable clocks: the engine runs on modelled seconds, whichever clock drives them.

`WallClock(time_scale)` maps a modelled duration d to d * time_scale wall seconds (0.1 runs ten
times faster). `VirtualClock` never waits: once every task is parked, it jumps to the earliest
pending sleep, so an engine test that models minutes runs in milliseconds, deterministically.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Modelled seconds since the clock started."""
        ...

    async def sleep(self, d: float) -> None:
        """Wait d modelled seconds."""
        ...


class WallClock:
    """Real time, scaled: a modelled second lasts `time_scale` wall seconds."""

    def __init__(self, time_scale: float = 1.0) -> None:
        if not time_scale > 0:
            raise ValueError(f"time_scale must be > 0, got {time_scale}")
        self.time_scale = float(time_scale)
        self._t0 = time.monotonic()

    def now(self) -> float:
        return (time.monotonic() - self._t0) / self.time_scale

    def to_wall(self, modelled: float) -> float:
        """The `time.monotonic()` value at which modelled time `modelled` happens."""
        return self._t0 + modelled * self.time_scale

    async def sleep(self, d: float) -> None:
        await asyncio.sleep(max(d, 0.0) * self.time_scale)


class VirtualClock:
    """Simulated time for tests.

    `sleep(d)` parks the caller; a driver task lets the event loop settle (`settle` rounds of
    `asyncio.sleep(0)`) and then advances time to the earliest pending wake-up. Ties wake in the
    order the sleeps were made. Time never moves while nobody sleeps, so an idle engine waiting
    for a submit costs nothing. `advance(d)` moves time by hand (wakes what falls due).
    """

    def __init__(self, start: float = 0.0, settle: int = 20) -> None:
        self._now = float(start)
        self._settle = settle
        self._heap: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()
        self._driver: asyncio.Task[None] | None = None

    def now(self) -> float:
        return self._now

    async def sleep(self, d: float) -> None:
        loop = asyncio.get_running_loop()
        if d <= 0:
            await asyncio.sleep(0)
            return
        fut: asyncio.Future[None] = loop.create_future()
        heapq.heappush(self._heap, (self._now + d, next(self._seq), fut))
        if self._driver is None or self._driver.done():
            self._driver = loop.create_task(self._drive())
        await fut

    def _prune(self) -> None:
        """Drop cancelled sleeps so that they never move time."""
        while self._heap and self._heap[0][2].done():
            heapq.heappop(self._heap)

    async def _drive(self) -> None:
        while True:
            for _ in range(self._settle):
                await asyncio.sleep(0)
            self._prune()
            if not self._heap:
                break
            self._wake_until(self._heap[0][0])

    def _wake_until(self, t: float) -> None:
        self._now = max(self._now, t)
        while self._heap and self._heap[0][0] <= self._now:
            _, _, fut = heapq.heappop(self._heap)
            if not fut.done():
                fut.set_result(None)
        self._prune()

    async def advance(self, d: float) -> None:
        """Move time forward by d, waking every sleep that falls due, in order."""
        target = self._now + d
        self._prune()
        while self._heap and self._heap[0][0] <= target:
            self._wake_until(self._heap[0][0])
            for _ in range(self._settle):
                await asyncio.sleep(0)
        self._now = target
