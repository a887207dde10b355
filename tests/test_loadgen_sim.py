"""The load generator against the simulator, checked against the simulator's own trace.

The simulator runs in a separate process (as a real server would) with ``--trace``, which
records when each request really arrived and when its first and last tokens were written.
The client's measurements must agree with that truth: TTFT and TPOT medians within 2%,
token counts exact, and the concurrency the server saw equal to the one requested.
These compare measurements with the trace, not with fixed timing thresholds.
"""

from __future__ import annotations

import asyncio
import bisect
import os
import socket
import statistics
import subprocess
import sys
import time

import orjson
import pytest

from loadtest.client import Target, make_session
from loadtest.runner import LevelPlan, run_level
from loadtest.stats import summarize_level
from loadtest.workload import LengthDist, Workload, WorkloadConfig

pytestmark = pytest.mark.slow

TIME_SCALE = 1.0  # real time: TP8 ~38 ms TPOT
# TTFT ~250 ms: long enough that the ~1 ms the server spends parsing a request before its
# trace stamps "arrival" (which the client rightly counts) stays well under 1% of it
PROMPT = 4096
LOADTEST = [sys.executable, "-m", "loadtest.cli"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def sim(tmp_path):
    """`loadtest sim --profile tp8 --trace` in its own process; killed afterwards."""
    port, trace = _free_port(), tmp_path / "trace.jsonl"
    proc = subprocess.Popen(
        [*LOADTEST, "sim", "--profile", "tp8", "--port", str(port),
         "--time-scale", str(TIME_SCALE), "--trace", str(trace)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"simulator did not start: {proc.stderr.read()!r}") from None
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}", trace
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _trace(path) -> list[dict]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def _match(records, trace):
    """Pair each record with the trace line of the request it sent (first arrival after it)."""
    lines = sorted((t for t in trace if t["route"] != "health"), key=lambda t: t["arrival"])
    arrivals = [t["arrival"] for t in lines]
    pairs, used = [], set()
    for r in sorted(records, key=lambda r: r.t_send):
        i = bisect.bisect_left(arrivals, r.t_send)
        while i in used:
            i += 1
        used.add(i)
        pairs.append((r, lines[i]))
    return pairs


def _rel(measured: float, truth: float) -> float:
    return abs(measured - truth) / truth


async def _level(url, api, concurrency, requests, out="24", stream=True):
    target = Target(url=url, api=api, stream=stream)
    config = WorkloadConfig(
        api=api, model="moonshotai/Kimi-K2.6", stream=stream,
        input_len=LengthDist("fixed", PROMPT), output_len=LengthDist.parse(out),
    )  # fmt: skip
    async with make_session(target, concurrency) as session:
        return await run_level(
            session, target, Workload(config),
            LevelPlan(concurrency=concurrency, warmup=0.0, duration=None, requests=requests),
            stop=asyncio.Event(),
        )  # fmt: skip


@pytest.mark.parametrize(("api", "concurrency"), [("chat", 4), ("generate", 1)])
async def test_ttft_tpot_tokens_and_concurrency_match_the_trace(sim, api, concurrency):
    """Output lengths vary so that the C streams do not all finish, and all send their next
    request, on the same step: the simulator stamps ``arrival`` after parsing and validating
    the body, so requests arriving together would queue for ~1 ms each *before* the stamp -
    time the client rightly counts in TTFT but the trace does not."""
    url, trace_path = sim
    res = await _level(url, api, concurrency, requests=max(3 * concurrency, 7), out="uniform:16-40")
    await asyncio.sleep(0.2)  # the trace line is written as the server closes the request
    records = [r for r in res.records]
    assert all(r.ok for r in records), [r.error_message for r in records if not r.ok]
    pairs = _match(records, _trace(trace_path))

    # exact token counts: the server's usage, the chunks, the trace and the request agree
    for r, t in pairs:
        assert r.completion_tokens == r.chunk_tokens == t["completion_tokens"]
        assert r.completion_tokens == r.requested_output_len
        assert r.prompt_tokens == t["prompt_tokens"]

    ttft = statistics.median(r.ttft for r, _ in pairs)
    ttft_true = statistics.median(t["first_token"] - t["arrival"] for _, t in pairs)
    tpot = statistics.median(r.tpot for r, _ in pairs)
    tpot_true = statistics.median(
        (t["last_token"] - t["first_token"]) / (t["completion_tokens"] - 1) for _, t in pairs
    )
    assert _rel(ttft, ttft_true) < 0.02, (ttft, ttft_true)
    assert _rel(tpot, tpot_true) < 0.02, (tpot, tpot_true)

    # the server saw exactly C requests in flight at its peak, never more
    events = sorted(
        [(t["arrival"], 1) for _, t in pairs] + [(t["end"], -1) for _, t in pairs],
        key=lambda e: (e[0], e[1]),
    )
    level = peak = 0
    for _, d in events:
        level += d
        peak = max(peak, level)
    assert peak == concurrency
    summary = summarize_level(records, concurrency=concurrency, window=res.window)
    assert summary.concurrency_max == concurrency
    assert summary.achieved_concurrency == pytest.approx(concurrency, rel=0.01)


async def test_non_streaming_counts_are_exact(sim):
    url, trace_path = sim
    res = await _level(url, "completions", 2, requests=2, out="8", stream=False)
    await asyncio.sleep(0.2)
    pairs = _match(res.records, _trace(trace_path))
    for r, t in pairs:
        assert r.ok and r.completion_tokens == t["completion_tokens"] == 8
        assert r.token_counts == [8]


def test_cli_sweep_reports_modelled_time(sim, tmp_path):
    """`--time-scale` comes from /get_server_info; tok/s and latencies are in modelled time."""
    url, _ = sim
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [*LOADTEST, "run", "--url", url, "-c", "2", "--requests", "4",
         "--input-len", "64", "--output-len", "16", "--out", str(out), "--save-records"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    data = orjson.loads(out.read_bytes())
    assert data["metadata"]["time_scale"] == TIME_SCALE
    level = data["levels"][0]
    # TP8's modelled TPOT is ~38 ms whatever the time scale; the wall one is half that
    assert level["tpot"]["p50"] > 0.030
    assert all(r["completion_tokens"] == 16 for r in data["records"])
