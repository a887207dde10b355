"""`loadtest run --processes N`: one level's workers spread over N client processes.

Each child runs `runner.run_level` on its own uvloop with its share of the workers (or of
the arrival rate), its own keep-alive pool and its own slice of the request sequence
(process p sends requests p, p+N, ...). All children start the level at one agreed
`time.monotonic()` instant — the monotonic clock is system-wide on Linux, so their records
merge into one level as if one client had sent them. Progress and Ctrl-C travel over pipes.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from loadtest.client import Target
from loadtest.runner import LevelPlan, LevelResult, Live
from loadtest.workload import Workload, WorkloadConfig

PROGRESS_INTERVAL = 0.5


def shares(total: int, parts: int) -> list[int]:
    """``total`` workers over ``parts`` processes, as evenly as possible."""
    return [total // parts + (1 if p < total % parts else 0) for p in range(parts)]


def _child(conn: Any, job: dict[str, Any]) -> None:
    """Child process: run one shard of a level and send back its LevelResult."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop
    try:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:  # pragma: no cover
        runner = asyncio.Runner()
    with runner:
        result, payloads = runner.run(_child_level(conn, job))
    conn.send(("result", result, payloads))
    conn.close()


async def _child_level(conn: Any, job: dict[str, Any]) -> tuple[LevelResult, list | None]:
    from loadtest.client import make_session
    from loadtest.runner import run_level

    target: Target = job["target"]
    plan: LevelPlan = job["plan"]
    sink: list | None = [] if job["save_payloads"] else None
    workload = Workload(job["config"], start=job["index"], step=job["processes"], sink=sink)
    stop = asyncio.Event()
    live = Live()
    loop = asyncio.get_running_loop()
    session = make_session(target, max(plan.concurrency, 1) if not plan.open_loop else 4096)
    conn.send(("ready",))
    t0 = await loop.run_in_executor(None, conn.recv)

    def watch() -> None:  # a thread: the parent's "stop" arrives here
        with contextlib.suppress(EOFError, OSError):
            while True:
                msg = conn.recv()
                if msg == "stop":
                    loop.call_soon_threadsafe(stop.set)
                    return

    # a daemon thread, not the executor: it blocks in recv() until the parent says "stop"
    threading.Thread(target=watch, daemon=True).start()

    async def progress() -> None:
        while True:
            await asyncio.sleep(PROGRESS_INTERVAL)
            conn.send(("progress", live.done, live.errors, live.in_flight, live.tokens()))

    reporter = asyncio.create_task(progress())
    try:
        result = await run_level(
            session,
            target,
            workload,
            plan,
            stop=stop,
            live=live,
            t0=t0,
            worker_offset=job["worker_offset"],
            arrival_seed=job["arrival_seed"],
            rate_phase=job["rate_phase"],
        )
        return result, sink
    finally:
        reporter.cancel()
        await session.close()


async def run_level_processes(
    options: Any,
    config: WorkloadConfig,
    target: Target,
    workload: Workload,
    plan: LevelPlan,
    *,
    stop: asyncio.Event,
    live: Live,
) -> LevelResult:
    """Run ``plan`` over ``options.processes`` children and merge their results."""
    n = options.processes
    ctx = mp.get_context("spawn")
    loop = asyncio.get_running_loop()
    cfg = replace(config)
    jobs = []
    offset = 0
    for p, share in enumerate(shares(plan.concurrency if not plan.open_loop else n, n)):
        sub = replace(plan, concurrency=share if not plan.open_loop else 0)
        if plan.open_loop:
            assert plan.rate is not None
            sub = replace(sub, rate=plan.rate / n, max_in_flight=max(plan.max_in_flight // n, 1))
        if plan.requests is not None:
            sub = replace(sub, requests=shares(plan.requests, n)[p])
        jobs.append(
            {
                "target": target,
                "plan": sub,
                "config": cfg,
                "index": workload._next + p,
                "processes": n,
                "worker_offset": offset if not plan.open_loop else p * 10_000_000,
                "arrival_seed": f"{config.seed}:p{p}",
                "rate_phase": p / n,
                "save_payloads": workload.sink is not None,
            }
        )
        offset += share
    pipes, procs = [], []
    for job in jobs:
        if not job["plan"].open_loop and job["plan"].concurrency == 0:
            continue
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_child, args=(child, job), daemon=True)
        proc.start()
        child.close()
        pipes.append(parent)
        procs.append(proc)
    parts: list[tuple[int, int, int, int]] = [(0, 0, 0, 0)] * len(pipes)
    pool = ThreadPoolExecutor(max_workers=len(pipes) + 1)  # one blocking recv() per child
    results: list[LevelResult | None] = [None] * len(pipes)
    try:
        for conn in pipes:  # every child ready (imports done, pool made) before t0
            try:
                msg = await loop.run_in_executor(pool, conn.recv)
            except EOFError:
                msg = ("died",)
            if msg[0] != "ready":
                raise RuntimeError(f"client process failed to start: {msg!r}")
        t0 = time.monotonic() + 0.05
        live.t_start = t0
        for conn in pipes:
            conn.send(t0)

        async def collect(i: int, conn: Any) -> None:
            while True:
                try:
                    msg = await loop.run_in_executor(pool, conn.recv)
                except EOFError:
                    return  # the child died; its records are lost (reported as fewer)
                if msg[0] == "progress":
                    parts[i] = msg[1:]
                    live.done = sum(p[0] for p in parts)
                    live.errors = sum(p[1] for p in parts)
                    live.ext_in_flight = sum(p[2] for p in parts)
                    live.ext_tokens = sum(p[3] for p in parts)
                elif msg[0] == "result":
                    results[i] = msg[1]
                    if workload.sink is not None and msg[2]:
                        workload.sink.extend(msg[2])
                    return

        collectors = asyncio.gather(*(collect(i, c) for i, c in enumerate(pipes)))
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait({collectors, stopper}, return_when="FIRST_COMPLETED")
        if not collectors.done():
            for conn in pipes:
                with contextlib.suppress(OSError):
                    conn.send("stop")
            await collectors
        stopper.cancel()
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.terminate()
        pool.shutdown(wait=False, cancel_futures=True)
    done = [r for r in results if r is not None]
    # the next level continues the request sequence after every index a child may have used
    base = workload._next
    workload._next = base + n * (max((len(r.records) for r in done), default=0) + 1)
    return merge_results(plan, done, n)


def merge_results(plan: LevelPlan, parts: list[LevelResult], processes: int) -> LevelResult:
    """One LevelResult from the children's: records and samples joined, windows intersected."""
    windows = [p.window for p in parts if p.window is not None]
    window = None
    if windows and len(windows) == len(parts):
        w0, w1 = max(w[0] for w in windows), min(w[1] for w in windows)
        window = (w0, w1) if w1 > w0 else None
    return LevelResult(
        plan=plan,
        records=[r for p in parts for r in p.records],
        window=window,
        dispatch_delays=[d for p in parts for d in p.dispatch_delays],
        loop_lag=[x for p in parts for x in p.loop_lag],
        cpu_fraction=sum(p.cpu_fraction for p in parts),
        interrupted=any(p.interrupted for p in parts),
        t_start=min((p.t_start for p in parts), default=0.0),
        t_stop=max((p.t_stop for p in parts), default=0.0),
    )
