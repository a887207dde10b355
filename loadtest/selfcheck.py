"""Is the client itself the bottleneck? Event-loop lag, client CPU and dispatch delay.

Measured during each level and printed with its results: if the event loop is late, the
process is near a full core, or requests leave later than their slot freed, the latencies
the run reports include the client's own queueing and say so.
"""

from __future__ import annotations

import asyncio
import resource
import time
from dataclasses import dataclass, field
from typing import Any

from loadtest.records import CANCELLED, RequestRecord

# thresholds above which the client is called the bottleneck
DISPATCH_P99_LIMIT_S = 1e-3
LOOP_LAG_P99_LIMIT_S = 5e-3
CPU_LIMIT = 0.90  # fraction of one core
MISMATCH_TOLERANCE = 0.01


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default method); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


class LoopLagMonitor:
    """Samples how late a periodic ``asyncio.sleep`` wakes up (the loop's scheduling lag)."""

    def __init__(self, interval: float = 0.01) -> None:
        self.interval = interval
        self.samples: list[float] = []
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            t = time.monotonic()
            await asyncio.sleep(self.interval)
            self.samples.append(max(time.monotonic() - t - self.interval, 0.0))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None


class CpuMeter:
    """Process CPU time (user+sys, all threads) over a wall interval, as a fraction of a core."""

    def __init__(self) -> None:
        self._cpu0 = self._cpu()
        self._wall0 = time.monotonic()

    @staticmethod
    def _cpu() -> float:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return ru.ru_utime + ru.ru_stime

    def fraction(self) -> float:
        wall = time.monotonic() - self._wall0
        return (self._cpu() - self._cpu0) / wall if wall > 0 else 0.0


@dataclass
class LevelProbe:
    """Collects one level's self-check samples; ``report()`` gives the printable dict."""

    requested_concurrency: int
    dispatch_delays: list[float] = field(default_factory=list)
    lag: LoopLagMonitor = field(default_factory=LoopLagMonitor)
    cpu: CpuMeter | None = None
    cpu_fraction: float | None = None  # set on stop (or merged from several processes)

    def start(self) -> None:
        self.cpu = CpuMeter()
        self.lag.start()

    async def stop(self) -> None:
        await self.lag.stop()
        if self.cpu is not None:
            self.cpu_fraction = self.cpu.fraction()

    def report(
        self,
        records: list[RequestRecord],
        *,
        window: tuple[float, float],
        ignore_eos: bool,
        achieved_concurrency: float | None = None,
        processes: int = 1,
    ) -> dict[str, Any]:
        return build_selfcheck(
            records,
            requested_concurrency=self.requested_concurrency,
            dispatch_delays=self.dispatch_delays,
            loop_lag=self.lag.samples,
            cpu_fraction=self.cpu_fraction,
            window=window,
            ignore_eos=ignore_eos,
            achieved_concurrency=achieved_concurrency,
            processes=processes,
        )


def time_avg_in_flight(records: list[RequestRecord], window: tuple[float, float]) -> float:
    """Time-averaged number of requests in flight (t_send..t_end) within ``window``."""
    w0, w1 = window
    if w1 <= w0:
        return 0.0
    busy = 0.0
    for r in records:
        end = r.t_end if r.t_end is not None else w1
        busy += max(0.0, min(end, w1) - max(r.t_send, w0))
    return busy / (w1 - w0)


def build_selfcheck(
    records: list[RequestRecord],
    *,
    requested_concurrency: int,
    dispatch_delays: list[float],
    loop_lag: list[float],
    cpu_fraction: float | None,
    window: tuple[float, float],
    ignore_eos: bool,
    achieved_concurrency: float | None = None,
    processes: int = 1,
) -> dict[str, Any]:
    """The self-check numbers and the warnings they imply (``warnings`` is a list of lines)."""
    done = [r for r in records if r.t_end is not None]
    ok = [r for r in done if r.ok]
    mismatched = [
        r for r in ok if r.completion_tokens is not None and r.completion_tokens != r.chunk_tokens
    ]
    no_usage = [r for r in ok if r.completion_tokens is None]
    early = [
        r
        for r in ok
        if r.completion_tokens is not None and r.completion_tokens < r.requested_output_len
    ]
    errors: dict[str, int] = {}
    cancelled = 0  # stopped by the run itself (--drain-timeout, Ctrl-C): not the target's error
    for r in done:
        if r.error == CANCELLED:
            cancelled += 1
        elif r.error:
            errors[r.error] = errors.get(r.error, 0) + 1
    answered = len(done) - cancelled
    if achieved_concurrency is None:
        achieved_concurrency = time_avg_in_flight(records, window)
    chunk_total = sum(r.chunk_tokens for r in ok)
    usage_total = sum(r.completion_tokens or 0 for r in ok)
    out: dict[str, Any] = {
        "requested_concurrency": requested_concurrency,
        "achieved_concurrency": achieved_concurrency,
        "dispatch_delay_p50_s": percentile(dispatch_delays, 50),
        "dispatch_delay_p99_s": percentile(dispatch_delays, 99),
        "dispatch_delay_max_s": max(dispatch_delays) if dispatch_delays else None,
        "loop_lag_p99_s": percentile(loop_lag, 99),
        "loop_lag_max_s": max(loop_lag) if loop_lag else None,
        "client_cpu": cpu_fraction,
        "processes": processes,
        "usage_chunk_mismatch_requests": len(mismatched),
        "usage_tokens": usage_total,
        "chunk_tokens": chunk_total,
        "missing_usage_requests": len(no_usage),
        "early_stops": len(early),
        "requests": len(done),
        "errors": errors,
        "error_rate": (sum(errors.values()) / answered) if answered else 0.0,
        "cancelled": cancelled,
    }
    warnings: list[str] = []
    d99 = out["dispatch_delay_p99_s"]
    lag99 = out["loop_lag_p99_s"]
    cpu_limit = CPU_LIMIT * processes
    bound = []
    if d99 is not None and d99 > DISPATCH_P99_LIMIT_S:
        bound.append(f"dispatch delay p99 {d99 * 1e3:.1f} ms > {DISPATCH_P99_LIMIT_S * 1e3:g} ms")
    if lag99 is not None and lag99 > LOOP_LAG_P99_LIMIT_S:
        bound.append(f"event-loop lag p99 {lag99 * 1e3:.1f} ms")
    if cpu_fraction is not None and cpu_fraction > cpu_limit:
        bound.append(f"client CPU {cpu_fraction:.0%} of {processes} core(s)")
    if bound:
        warnings.append(
            "CLIENT IS THE BOTTLENECK: " + "; ".join(bound) + " — latencies include client "
            "queueing (try --processes N, or fewer streams per process)"
        )
    if requested_concurrency and achieved_concurrency < 0.95 * requested_concurrency:
        warnings.append(
            f"achieved concurrency {achieved_concurrency:.2f} < requested {requested_concurrency}"
        )
    if mismatched:
        warnings.append(
            f"{len(mismatched)} request(s): server usage differs from tokens counted in chunks "
            f"({usage_total} vs {chunk_total})"
        )
    if no_usage:
        warnings.append(
            f"{len(no_usage)} request(s) without server usage: token counts come from chunks"
        )
    if early and ignore_eos:
        warnings.append(f"{len(early)} request(s) stopped before max_tokens despite ignore_eos")
    if answered and out["error_rate"] > 0:
        kinds = ", ".join(f"{k}={v}" for k, v in sorted(errors.items()))
        warnings.append(f"error rate {out['error_rate']:.1%} ({kinds})")
    if cancelled:
        warnings.append(
            f"{cancelled} request(s) cancelled by the run itself (--drain-timeout or an "
            "interrupt): not errors of the target, left out of the error rate"
        )
    out["warnings"] = warnings
    out["client_bound"] = bool(bound)
    return out
