"""Synthetic windows for limit tests: numbers only, no server, no clock.

:func:`win` builds one :class:`proxy.stats.Window` with what a test cares about;
:class:`BatchModel` is a continuous-batching engine reduced to what the proxy would measure
over one window, given the limit in force; :func:`drive` feeds a limit a model's windows.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from proxy.stats import Window


def ready(capacity: int) -> int:
    """The limit held for a backend that runs ``capacity`` (found, or said by the server): that
    plus the default tolerance (max(queue_tolerance 2, queue_share 5%)), kept ready in its
    queue."""
    return math.floor(capacity + max(2.0, 0.05 * capacity))


def win(
    limit: int,
    t: float = 0.0,
    *,
    in_flight: float | None = None,
    pressure: float = 1.0,
    awaiting_min: float = 0.0,
    queue: float | None = None,
    running: float | None = None,
    usage: float | None = None,
    backlog: int = 0,
    opaque: float = 0.0,
    errors: int = 0,
    completions: int = 10,
    admitted: int | None = None,
    stale: bool = False,
    restarted: bool = False,
    itl_p50: float | None = 0.03,
    duration: float = 1.0,
) -> Window:
    c = float(limit) if in_flight is None else in_flight
    return Window(
        start=t,
        end=t + duration,
        limit=limit,
        in_flight=c,
        at_limit=1.0 if c >= limit else 0.0,
        tokens=100,
        tokens_per_s=100.0 / duration,
        itl=itl_p50,
        ttft=0.2,
        # a backend in a steady state admits (first tokens) as it finishes
        ttft_count=completions if admitted is None else admitted,
        completions=completions,
        errors=errors,
        queue_reqs=queue,
        token_usage=usage,
        running_reqs=running,
        stale=stale,
        restarted=restarted,
        itl_p50=itl_p50,
        pressure=pressure,
        awaiting=awaiting_min,
        backlog=backlog,
        awaiting_min=awaiting_min,
        opaque=opaque,
    )


@dataclass
class BatchModel:
    """A continuous-batching engine that runs at most ``max_running`` requests; the rest of what
    the proxy sends waits in its queue (seen by the proxy as awaiting a first token, and in the
    scraped gauge unless ``scraped`` is False). A ``prefill_share`` of the running requests is
    always in prefill (a dense arrival stream of long prompts): they wait a moment each, so the
    proxy's count of waiting requests never drops below them, while SGLang's queue gauge does
    not count them. Each request it runs lives ``lifetime_s``: a window's completions are what it
    runs over that."""

    max_running: int = 48
    demand: int | None = None  # clients: in flight cannot exceed this
    prefill_share: float = 0.0
    scraped: bool = True
    noise: float = 0.0
    seed: int = 0
    lifetime_s: float = 4.0
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def window(self, limit: int, t: float) -> Window:
        c = limit if self.demand is None else min(limit, self.demand)
        queued = max(0, c - self.max_running)
        jitter = round(abs(self.rng.gauss(0.0, self.noise)) * c) if self.noise else 0
        waiting = queued + min(round(self.prefill_share * (c - queued)) + jitter, c)
        pressured = self.demand is None or self.demand > limit
        return win(
            limit,
            t,
            in_flight=float(c),
            pressure=1.0 if pressured else 0.0,
            awaiting_min=float(waiting),
            queue=float(queued) if self.scraped else None,
            running=float(c - queued) if self.scraped else None,
            backlog=0 if self.demand is None else max(0, self.demand - limit),
            completions=round((c - queued) / self.lifetime_s),
        )


def drive(limit, model, seconds: int, t0: float = 0.0) -> list[int]:
    """Feed ``seconds`` one-second windows; return the limit in force during each."""
    out = []
    for i in range(seconds):
        cur = limit.limit
        out.append(cur)
        limit.update(model.window(cur, t0 + i))
    return out
