"""Synthetic backends for limit tests and the convergence trace in docs/limits-and-routing.md.

Numbers only: given the limit in force (demand always fills it unless told otherwise), each
model returns the :class:`proxy.stats.Window` a proxy would have measured over one window.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from proxy.stats import Window


@dataclass
class KneeModel:
    """throughput(c) = min(c, knee) * rate tokens/s; past the knee ITL and TTFT grow with c.

    ``queue_past`` (optional): in-flight count beyond which the backend reports queued requests
    (SGLang's num_queue_reqs) and ``kv_past`` beyond which its KV usage reads full.
    """

    knee: int
    rate: float = 25.0  # tokens/s per request below the knee
    ttft0: float = 0.2
    noise: float = 0.02
    seed: int = 0
    queue_past: int | None = None
    kv_past: int | None = None
    demand: int | None = None  # clients: in flight cannot exceed this
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def throughput(self, c: float) -> float:
        return self.rate * min(c, self.knee)

    def window(self, limit: int, t: float, duration: float = 1.0) -> Window:
        c = float(limit if self.demand is None else min(limit, self.demand))
        tps = self.throughput(c) * (1.0 + self.rng.gauss(0.0, self.noise))
        itl = c / max(tps, 1e-9)
        ttft = self.ttft0 * max(1.0, c / self.knee)
        queue = None
        if self.queue_past is not None:
            queue = max(0.0, c - self.queue_past)
        kv = None
        if self.kv_past is not None:
            kv = 1.0 if c > self.kv_past else 0.5
        return Window(
            start=t,
            end=t + duration,
            limit=limit,
            in_flight=c,
            at_limit=1.0 if c >= limit else 0.0,
            # requests wait in the proxy when there are more clients than the limit
            pressure=1.0 if self.demand is None or self.demand > limit else 0.0,
            backlog=0 if self.demand is None else max(0, self.demand - limit),
            tokens=int(tps * duration),
            tokens_per_s=tps,
            itl=itl,
            ttft=ttft,
            ttft_count=max(1, int(c / 4)),
            completions=max(1, int(c / 4)),
            errors=0,
            queue_reqs=queue,
            token_usage=kv,
            itl_p50=itl,
        )


@dataclass
class BatchModel:
    """A continuous-batching engine: step time a + k*b for a batch of b <= max_running; every
    running request gets one token per step; beyond max_running requests queue inside it."""

    step_ms: float = 37.0
    per_req_ms: float = 0.56
    max_running: int = 48
    prefill_s: float = 0.15
    noise: float = 0.02
    seed: int = 0
    proxy_sees_queue: bool = True  # the queued requests show as awaiting their first token
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def window(self, limit: int, t: float, duration: float = 1.0) -> Window:
        b = min(limit, self.max_running)
        step = (self.step_ms + self.per_req_ms * b) / 1000.0
        tps = b / step * (1.0 + self.rng.gauss(0.0, self.noise))
        queued = max(0, limit - self.max_running)
        ttft = self.prefill_s + queued / max(b, 1) * 100 * step  # waits for a slot
        return Window(
            start=t,
            end=t + duration,
            limit=limit,
            in_flight=float(limit),
            at_limit=1.0,
            pressure=1.0,
            tokens=int(tps * duration),
            tokens_per_s=tps,
            itl=step,
            ttft=ttft,
            ttft_count=max(1, limit // 4),
            completions=max(1, limit // 4),
            errors=0,
            queue_reqs=float(queued),
            token_usage=min(1.0, 0.3 + 0.01 * b),
            itl_p50=step,
            awaiting=float(queued) if self.proxy_sees_queue else 0.0,
        )


def drive(limit, model, seconds: int, t0: float = 0.0) -> list[int]:
    """Feed ``seconds`` one-second windows; return the limit in force during each."""
    out = []
    for i in range(seconds):
        cur = limit.limit
        out.append(cur)
        limit.update(model.window(cur, t0 + i))
    return out
