"""Runs one level: closed loop (C workers, each sending the moment its last request ended, or
after a think time drawn around ``turn_delay`` if one is set) or open loop (arrivals at rate R
on an absolute schedule, latency from the scheduled time).

A level has a warmup, a steady-state window W and a drain. In duration mode W is
``[t0 + warmup, t0 + warmup + duration)``; no new request starts after W, and requests still
running are waited for up to ``drain_timeout`` (then cancelled). With ``requests=N`` the level
sends N requests after the warmup and W ends when the first worker finds nothing left to
send (the last moment all C workers were busy). Statistics use W only (loadtest.stats).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import aiohttp

from loadtest.client import Target, execute, warm_connections
from loadtest.records import CANCELLED, RequestRecord
from loadtest.selfcheck import CpuMeter, LoopLagMonitor
from loadtest.workload import API_PATHS, Workload, WorkloadConfig

SPIN_S = 0.0015  # open loop: the last stretch before an arrival is waited by yielding


@dataclass
class LevelPlan:
    """What one level runs. ``rate`` set means open loop, else closed loop at ``concurrency``."""

    concurrency: int = 1
    rate: float | None = None
    arrival: Literal["poisson", "constant"] = "poisson"
    warmup: float = 10.0
    duration: float | None = 30.0  # None: request-count mode
    requests: int | None = None
    drain_timeout: float = 60.0
    max_in_flight: int = 10_000  # open loop: cap on requests in flight (the rest wait)
    #: closed loop: mean seconds a worker thinks between an answer and its next request
    #: (exponential draws, seeded per worker); 0: it sends at once
    turn_delay: float = 0.0

    @property
    def open_loop(self) -> bool:
        return self.rate is not None

    @property
    def level(self) -> int:
        """The RequestRecord.level value: concurrency, or 0 for open loop."""
        return 0 if self.open_loop else self.concurrency

    def describe(self) -> str:
        what = (
            f"rate {self.rate:g}/s ({self.arrival})"
            if self.open_loop
            else f"concurrency {self.concurrency}"
        )
        span = f"{self.requests} requests" if self.requests else f"{self.duration:g}s"
        return f"{what}, warmup {self.warmup:g}s, {span}"


@dataclass
class Live:
    """Counters a progress display reads while a level runs (no locking: one event loop)."""

    t_start: float = 0.0
    done: int = 0
    errors: int = 0
    tokens_done: int = 0
    active: dict[int, RequestRecord] = field(default_factory=dict)  # id(record) -> record
    # set when the requests run in other processes (--processes): their summed counters
    ext_in_flight: int | None = None
    ext_tokens: int | None = None

    def started(self, rec: RequestRecord) -> None:
        self.active[id(rec)] = rec

    def finished(self, rec: RequestRecord) -> None:
        self.active.pop(id(rec), None)
        self.done += 1
        self.errors += rec.error is not None
        self.tokens_done += rec.output_tokens

    @property
    def in_flight(self) -> int:
        return len(self.active) if self.ext_in_flight is None else self.ext_in_flight

    def tokens(self) -> int:
        if self.ext_tokens is not None:
            return self.ext_tokens
        return self.tokens_done + sum(sum(r.token_counts) for r in self.active.values())


@dataclass
class LevelResult:
    plan: LevelPlan
    records: list[RequestRecord]
    window: tuple[float, float] | None  # None when interrupted before the window opened
    dispatch_delays: list[float]
    loop_lag: list[float]
    cpu_fraction: float
    interrupted: bool
    t_start: float
    t_stop: float


async def run_level(
    session: aiohttp.ClientSession,
    target: Target,
    workload: Workload,
    plan: LevelPlan,
    *,
    stop: asyncio.Event,
    live: Live | None = None,
    t0: float | None = None,
    worker_offset: int = 0,
    arrival_seed: str = "0",
    rate_phase: float = 0.0,
    on_record: Callable[[RequestRecord], None] | None = None,
) -> LevelResult:
    """Run one level and return its records; Ctrl-C (``stop``) ends it early, keeping them.

    ``t0`` (a future ``time.monotonic()``) lets several processes start one level together.
    """
    live = live or Live()
    records: list[RequestRecord] = []
    delays: list[float] = []
    lag = LoopLagMonitor()
    # closed loop: one connection per worker; open loop: a few (idle ones time out after 4 s,
    # and closing a thousand at once would stall the loop mid-level)
    await warm_connections(
        session, target, plan.concurrency if not plan.open_loop else min(plan.max_in_flight, 16)
    )
    gc.collect()
    gc.freeze()
    gc.disable()
    now = time.monotonic()
    t0 = max(t0 if t0 is not None else now, now)
    if t0 > now:
        await asyncio.sleep(t0 - now)
    live.t_start = t0
    warm_end = t0 + plan.warmup
    stop_at = warm_end + plan.duration if plan.duration is not None else None
    first_idle: list[float] = []  # request mode: when the first worker ran out of work
    last_arrival: list[float] = []
    measured = 0
    cpu = CpuMeter()
    lag.start()

    async def one(rec: RequestRecord, closed: bool) -> None:
        spec = workload.next(rec.worker)
        records.append(rec)
        live.started(rec)
        try:
            await execute(session, target, spec, rec, closed_loop=closed)
        finally:
            live.finished(rec)
            if workload.needs_answers:
                workload.answered(rec.worker, rec.answer if rec.ok and rec.answer else None)
                rec.answer = None
            if on_record is not None:
                on_record(rec)

    def may_start(t: float) -> bool:
        nonlocal measured
        if stop.is_set() or (stop_at is not None and t >= stop_at):
            return False
        if plan.requests is not None and t >= warm_end:
            if measured >= plan.requests:
                return False
            measured += 1
        return True

    async def worker(w: int) -> None:
        # dispatch delay = this send - the previous request's end (a worker's first send is
        # part of the start-up burst, not a slot freeing, so it has none)
        t_free: float | None = None
        think = random.Random(f"{arrival_seed}:think:{worker_offset + w}")
        while may_start(time.monotonic()):
            rec = RequestRecord(level=plan.level, worker=w, t_scheduled=0.0, t_send=0.0)
            await one(rec, closed=True)
            if t_free is not None:
                delays.append(rec.t_send - t_free)
            t_free = rec.t_end if rec.t_end is not None else time.monotonic()
            if plan.turn_delay > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), think.expovariate(1.0 / plan.turn_delay))
                t_free = time.monotonic()  # the think time is the client's, not a dispatch delay
        if not first_idle:
            first_idle.append(time.monotonic())

    async def arrivals() -> None:
        assert plan.rate is not None
        rng = random.Random(f"{arrival_seed}:{plan.rate}")
        gap = 1.0 / plan.rate
        limit = asyncio.Semaphore(plan.max_in_flight)
        spawned: set[asyncio.Task] = set()
        i = 0
        if plan.arrival == "constant":
            t_next = t0 + rate_phase * gap
        else:
            t_next = t0 + rng.expovariate(plan.rate)

        async def timed(rec: RequestRecord) -> None:
            async with limit:
                await one(rec, closed=False)
            delays.append(rec.t_send - rec.t_scheduled)

        try:
            while may_start(t_next):
                wait = t_next - time.monotonic()
                if wait > SPIN_S:
                    # the loop's timers are ~1 ms coarse: sleep to just short of the
                    # arrival, then yield until it is due
                    await asyncio.sleep(wait - SPIN_S)
                while time.monotonic() < t_next and not stop.is_set():  # noqa: ASYNC110
                    await asyncio.sleep(0)
                if stop.is_set():
                    break
                rec = RequestRecord(
                    level=0, worker=worker_offset + i, t_scheduled=t_next, t_send=t_next
                )
                task = asyncio.create_task(timed(rec))
                spawned.add(task)
                task.add_done_callback(spawned.discard)
                last_arrival[:] = [t_next]
                i += 1
                if plan.arrival == "constant":
                    t_next = t0 + (i + rate_phase) * gap  # absolute: sleep error never adds up
                else:
                    t_next += rng.expovariate(plan.rate)
            if first_idle == []:
                first_idle.append(time.monotonic())
            await asyncio.gather(*spawned)
        except asyncio.CancelledError:
            for task in list(spawned):
                task.cancel()
            await asyncio.gather(*spawned, return_exceptions=True)
            raise

    if plan.open_loop:
        tasks = [asyncio.create_task(arrivals())]
    else:
        tasks = [asyncio.create_task(worker(worker_offset + w)) for w in range(plan.concurrency)]
    everything = asyncio.ensure_future(asyncio.gather(*tasks))
    stopper = asyncio.create_task(stop.wait())
    timeout = None
    if stop_at is not None:
        timeout = max(stop_at + plan.drain_timeout - time.monotonic(), 0.0)
    try:
        await asyncio.wait({everything, stopper}, timeout=timeout, return_when="FIRST_COMPLETED")
    finally:
        # The window ends no later than the cut: uvloop's timers have millisecond resolution and
        # may fire just before ``stop_at``, and a request cut here is no failure of the target.
        t_cut = time.monotonic()
        interrupted = stop.is_set() and not everything.done()
        stopper.cancel()
        if not everything.done():
            for task in tasks:
                task.cancel()
            await asyncio.gather(everything, return_exceptions=True)
        t_stop = time.monotonic()
        await lag.stop()
        cpu_fraction = cpu.fraction()
        gc.enable()
        gc.unfreeze()

    window: tuple[float, float] | None
    if plan.requests is not None:
        end = first_idle[0] if first_idle else t_stop
        if plan.open_loop and last_arrival:
            end = last_arrival[0]
        window = (warm_end, end)
    else:
        assert stop_at is not None
        window = (warm_end, min(stop_at, t_cut))
    if window[1] <= window[0]:
        window = None
    return LevelResult(
        plan=plan,
        records=records,
        window=window,
        dispatch_delays=delays,
        loop_lag=lag.samples,
        cpu_fraction=cpu_fraction,
        interrupted=interrupted,
        t_start=t0,
        t_stop=t_stop,
    )


# ---------------------------------------------------------------------------------------
# A sweep: discovery, preflight, every level (x repeats), summaries, progress.


@dataclass
class SweepOptions:
    url: str
    headers: dict[str, str] = field(default_factory=dict)
    request_timeout: float = 600.0
    model_given: bool = False
    concurrency: list[int] = field(default_factory=lambda: [1, 4, 32])
    rates: list[float] = field(default_factory=list)
    arrival: Literal["poisson", "constant"] = "poisson"
    max_in_flight: int = 10_000
    turn_delay: float = 0.0  # modelled seconds (see LevelPlan)
    duration: float | None = 30.0  # modelled seconds (see time_scale)
    warmup: float = 10.0
    requests: int | None = None
    drain_timeout: float = 60.0
    repeat: int = 1
    # wall seconds per modelled second of a `loadtest sim --time-scale`; None: ask the target
    # (/get_server_info "sim_time_scale"), 1 for a real server
    time_scale: float | None = None
    processes: int = 1
    slo: dict[str, float] | None = None
    progress: bool = False
    save_payloads: str | None = None

    def plans(self) -> list[LevelPlan]:
        s = self.time_scale or 1.0
        common = dict(
            warmup=self.warmup * s,
            duration=None if self.duration is None else self.duration * s,
            requests=self.requests,
            drain_timeout=self.drain_timeout * s,
            max_in_flight=self.max_in_flight,
            turn_delay=self.turn_delay * s,
        )
        if self.rates:
            # a modelled rate R means R / s arrivals per wall second
            return [
                LevelPlan(rate=r / s, arrival=self.arrival, concurrency=0, **common)
                for r in self.rates
            ]
        return [LevelPlan(concurrency=c, **common) for c in self.concurrency]


@dataclass
class SweepOutcome:
    result: object  # loadtest.results.RunResult
    messages: list[str] = field(default_factory=list)
    error: str | None = None
    interrupted: bool = False


def _server_summary(info: dict | None) -> dict | None:
    """The few /get_server_info fields worth a header line (the full dict is kept too)."""
    if not info:
        return None
    keys = (
        "proxy",
        "fronts",
        "version",
        "model_path",
        "served_model_name",
        "tp_size",
        "pp_size",
        "ep_size",
        "max_running_requests",
        "sim_profile",
        "profile",
    )
    return {k: info[k] for k in keys if info.get(k) is not None} or None


def scale_record(rec: RequestRecord, origin: float, scale: float) -> RequestRecord:
    """Map a record's wall times onto modelled time: origin + (t - origin) / scale."""
    if scale == 1.0:
        return rec

    def f(t: float) -> float:
        return origin + (t - origin) / scale

    def g(t: float | None) -> float | None:
        return None if t is None else f(t)

    return RequestRecord(
        **{
            **rec.to_dict(),
            "t_scheduled": f(rec.t_scheduled),
            "t_send": f(rec.t_send),
            "t_first": g(rec.t_first),
            "t_last": g(rec.t_last),
            "t_end": g(rec.t_end),
            "token_times": [f(t) for t in rec.token_times],
        }
    )


class Sweep:
    """Everything `loadtest run` does between parsing flags and printing the table."""

    def __init__(self, options: SweepOptions, config: WorkloadConfig) -> None:
        self.options = options
        self.config = config
        self._stop = asyncio.Event()
        self.payloads: list[tuple[int, str, bytes]] | None = [] if options.save_payloads else None

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> SweepOutcome:
        from loadtest import results, stats
        from loadtest.client import TargetError, discover_model, make_session, probe, server_info

        opts = self.options
        metadata = results.base_metadata()
        outcome = SweepOutcome(result=results.RunResult(metadata=metadata, levels=[], records=[]))
        target = Target(
            url=opts.url,
            api=self.config.api,
            stream=self.config.stream,
            headers=dict(opts.headers),
            request_timeout=opts.request_timeout,
        )
        pool = max([*opts.concurrency, 1])
        if opts.rates:
            pool = min(opts.max_in_flight, 4096)
        session = make_session(target, pool)
        try:
            try:
                await probe(session, target)
                if not opts.model_given:
                    self.config.model = await discover_model(session, target)
                info = await server_info(session, target)
                await self._preflight(session, target)
            except TargetError as exc:
                outcome.error = str(exc)
                return outcome
            if opts.time_scale is None:  # a `loadtest sim` says its own time scale
                scale = (info or {}).get("sim_time_scale")
                opts.time_scale = (
                    float(scale) if isinstance(scale, int | float) and scale > 0 else 1.0
                )
            plans = opts.plans()
            metadata.update(
                target=target.url,
                model=self.config.model,
                api=target.api,
                stream=target.stream,
                server=_server_summary(info),
                server_info=info,
                workload=self.config.describe(),
                time_scale=opts.time_scale,
                sweep={
                    "concurrency": opts.concurrency if not opts.rates else [],
                    "rates": opts.rates,
                    "arrival": opts.arrival if opts.rates else None,
                    "warmup_s": opts.warmup,
                    "duration_s": opts.duration,
                    "requests": opts.requests,
                    "drain_timeout_s": opts.drain_timeout,
                    "turn_delay_s": opts.turn_delay,
                    "repeat": opts.repeat,
                    "processes": opts.processes,
                },
            )
            if opts.time_scale != 1.0:
                metadata["time_note"] = (
                    f"times are modelled seconds: wall seconds / {opts.time_scale:g}"
                )
            workload = Workload(self.config, sink=self.payloads)
            origin = time.monotonic()
            all_records: list[RequestRecord] = []
            for plan in plans:
                reps: list[stats.LevelSummary] = []
                for rep in range(opts.repeat):
                    res = await self._run_one(session, target, workload, plan, rep)
                    records = [scale_record(r, origin, opts.time_scale) for r in res.records]
                    all_records.extend(records)
                    if res.window is None:
                        outcome.messages.append(
                            f"level {self._label(plan)}: stopped before its window opened; "
                            f"{len(records)} request(s) kept in the records only"
                        )
                        break
                    window = (
                        origin + (res.window[0] - origin) / opts.time_scale,
                        origin + (res.window[1] - origin) / opts.time_scale,
                    )
                    check = self._selfcheck(res, records, window)
                    summary = stats.summarize_level(
                        records,
                        concurrency=plan.level,
                        window=window,
                        slo=opts.slo,
                        selfcheck=check,
                        rate=None if plan.rate is None else plan.rate * opts.time_scale,
                    )
                    reps.append(summary)
                    if not self.options.progress:
                        print(self._one_line(plan, summary, rep), file=sys.stderr)
                    # cut at the drain timeout is not a failure of the target
                    done = [r for r in records if r.t_end is not None and r.error != CANCELLED]
                    if done and all(r.error for r in done) and not res.interrupted:
                        first = next(r for r in done if r.error)
                        outcome.error = (
                            f"all {len(done)} requests failed at level {self._label(plan)}: "
                            f"{first.error_message or first.error}"
                        )
                        break
                    if res.interrupted:
                        break
                if reps:
                    level = stats.combine_repeats(reps) if len(reps) > 1 else reps[0]
                    outcome.result.levels.append(level)
                if outcome.error or self._stop.is_set():
                    outcome.interrupted = self._stop.is_set()
                    break
            outcome.result.records = all_records
        finally:
            await session.close()
            self._write_payloads(outcome)
        return outcome

    def _label(self, plan: LevelPlan) -> str:
        if plan.rate is not None:
            return f"rate {plan.rate * self.options.time_scale:g}/s"
        return f"C={plan.concurrency}"

    def _one_line(self, plan: LevelPlan, s: object, rep: int) -> str:
        rep_text = f" (repeat {rep + 1}/{self.options.repeat})" if self.options.repeat > 1 else ""
        return (
            f"level {self._label(plan)}{rep_text}: {s.completed} ok, {s.failed} failed, "  # type: ignore[attr-defined]
            f"{s.output_tok_s:.1f} tok/s, achieved concurrency "  # type: ignore[attr-defined]
            f"{s.achieved_concurrency:.2f}"  # type: ignore[attr-defined]
        )

    def _selfcheck(
        self, res: LevelResult, records: list[RequestRecord], window: tuple[float, float]
    ) -> dict:
        from loadtest.selfcheck import build_selfcheck

        s = self.options.time_scale
        check = build_selfcheck(
            records,
            requested_concurrency=res.plan.concurrency,
            dispatch_delays=res.dispatch_delays,  # wall seconds: the client's own delay
            loop_lag=res.loop_lag,
            cpu_fraction=res.cpu_fraction,
            window=window,
            ignore_eos=self.config.effective_ignore_eos,
            processes=self.options.processes,
        )
        check["interrupted"] = res.interrupted
        check["time_scale"] = s
        check["wall_window_s"] = None if res.window is None else res.window[1] - res.window[0]
        return check

    async def _preflight(self, session: aiohttp.ClientSession, target: Target) -> None:
        """One tiny request, so a wrong API path, model or key fails in one clear line."""
        from loadtest.client import TargetError
        from loadtest.workload import RequestSpec, build_payload

        body = build_payload(
            self.config.api,
            model=self.config.model,
            messages=[{"role": "user", "content": "hello"}],
            text="hello",
            max_tokens=1,
            stream=self.config.stream,
            ignore_eos=False,
        )
        import orjson

        spec = RequestSpec(-1, API_PATHS[self.config.api], orjson.dumps(body), 1, 1)
        rec = RequestRecord(level=0, worker=-1, t_scheduled=0.0, t_send=0.0)
        await execute(session, target, spec, rec)
        if rec.error:
            raise TargetError(
                f"POST {target.url}{spec.path} failed: {rec.error_message or rec.error}"
            )

    async def _run_one(
        self,
        session: aiohttp.ClientSession,
        target: Target,
        workload: Workload,
        plan: LevelPlan,
        rep: int,
    ) -> LevelResult:
        live = Live()
        display = None
        if self.options.progress:
            display = asyncio.create_task(self._progress(plan, rep, live))
        try:
            if self.options.processes > 1:
                from loadtest.multiproc import run_level_processes

                return await run_level_processes(
                    self.options, self.config, target, workload, plan, stop=self._stop, live=live
                )
            return await run_level(
                session,
                target,
                workload,
                plan,
                stop=self._stop,
                live=live,
                arrival_seed=f"{self.config.seed}:{rep}",
            )
        finally:
            if display is not None:
                display.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await display

    async def _progress(self, plan: LevelPlan, rep: int, live: Live) -> None:
        from rich.console import Console
        from rich.live import Live as RichLive

        s = self.options.time_scale
        total = plan.warmup + (plan.duration or 0.0)
        rep_text = f" repeat {rep + 1}/{self.options.repeat}" if self.options.repeat > 1 else ""
        last_t, last_tokens, rate = time.monotonic(), 0, 0.0

        def line() -> str:
            nonlocal last_t, last_tokens, rate
            now = time.monotonic()
            tokens = live.tokens()
            if now - last_t >= 1.0:
                rate = (tokens - last_tokens) / (now - last_t) * s
                last_t, last_tokens = now, tokens
            elapsed = max(now - (live.t_start or now), 0.0)
            phase = (
                "warmup"
                if elapsed < plan.warmup
                else ("measuring" if not plan.duration or elapsed < total else "draining")
            )
            span = f"/{total / s:.0f}s" if plan.duration else "s"
            return (
                f"[bold]{self._label(plan)}[/bold]{rep_text}  {phase:9}  "
                f"elapsed {elapsed / s:6.1f}{span}  done {live.done:6d}  "
                f"in flight {live.in_flight:5d}  {rate:9.1f} tok/s"
                + (f"  errors {live.errors}" if live.errors else "")
            )

        console = Console(stderr=True)
        with RichLive(line(), console=console, refresh_per_second=4, transient=False) as view:
            try:
                while True:
                    await asyncio.sleep(0.25)
                    view.update(line())
            except asyncio.CancelledError:
                view.update(line())
                raise

    def _write_payloads(self, outcome: SweepOutcome) -> None:
        if self.payloads is None or not self.options.save_payloads:
            return
        import orjson

        try:
            with open(self.options.save_payloads, "wb") as fh:
                for index, path, body in self.payloads:
                    fh.write(
                        orjson.dumps({"index": index, "path": path, "body": orjson.Fragment(body)})
                        + b"\n"
                    )
        except OSError as exc:
            outcome.messages.append(f"cannot write {self.options.save_payloads}: {exc.strerror}")
