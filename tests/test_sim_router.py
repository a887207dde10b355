"""sglang-router (PyPI wheel) in front of two simulators in one `loadtest sim` process.

The router probes each worker (HTTP/2 prior knowledge first, then /health, /server_info,
/model_info, /get_load) before accepting it; the simulator must answer all of it without a
traceback in its log, and then serve requests routed round-robin.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from conftest import free_port
from sim_util import sse_json

pytest.importorskip("sglang_router")

ROOT = Path(__file__).resolve().parents[1]
MODEL_BODY = {"messages": [{"role": "user", "content": "hello router"}], "max_tokens": 5,
              "ignore_eos": True}  # fmt: skip


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


async def _poll(url: str, limit_s: float, ok=lambda status: status == 200) -> None:
    async with asyncio.timeout(limit_s), aiohttp.ClientSession() as s:
        while True:
            try:
                async with s.get(url) as r:
                    if ok(r.status):
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)


async def _metric(session: aiohttp.ClientSession, url: str, name: str) -> float:
    async with session.get(f"{url}/metrics") as r:
        text = await r.text()
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{")
    )


async def test_router_round_robin_over_two_simulators(tmp_path):
    p1, p2, rport, mport = (free_port() for _ in range(4))
    sim_log = tmp_path / "sim.log"
    trace = tmp_path / "trace.jsonl"
    router_log = tmp_path / "router.log"
    workers = [f"http://127.0.0.1:{p1}", f"http://127.0.0.1:{p2}"]
    with sim_log.open("wb") as slog, router_log.open("wb") as rlog:
        sim = subprocess.Popen(  # noqa: ASYNC220 - Popen does not block
            [sys.executable, "-m", "loadtest.cli", "sim", "--profile", "tp8", "--profile", "pp8",
             "--port", str(p1), "--port", str(p2), "--time-scale", "0.02",
             "--trace", str(trace)],
            cwd=ROOT, stdout=slog, stderr=subprocess.STDOUT,
        )  # fmt: skip
        router = None
        try:
            for w in workers:
                await _poll(f"{w}/health", 15)
            router = subprocess.Popen(  # noqa: ASYNC220
                [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                 "--port", str(rport), "--prometheus-host", "127.0.0.1",
                 "--prometheus-port", str(mport), "--worker-urls", *workers,
                 "--policy", "round_robin"],
                cwd=tmp_path, stdout=rlog, stderr=subprocess.STDOUT,
                env={**os.environ, "HF_HUB_OFFLINE": "1", "NO_COLOR": "1"},
            )  # fmt: skip
            base = f"http://127.0.0.1:{rport}"
            async with aiohttp.ClientSession(base) as s:
                await _poll(f"{base}/v1/models", 30)
                for _ in range(4):
                    async with s.post("/v1/chat/completions", json=MODEL_BODY) as r:
                        assert r.status == 200, await r.text()
                        out = await r.json()
                    assert out["usage"]["completion_tokens"] == 5
                body = {**MODEL_BODY, "stream": True, "stream_options": {"include_usage": True}}
                async with s.post("/v1/chat/completions", json=body) as r:
                    assert r.status == 200
                    events = sse_json(await r.read())
                assert events[-1]["usage"]["completion_tokens"] == 5
                gen = {"text": "a b", "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
                async with s.post("/generate", json=gen) as r:
                    assert r.status == 200
                    assert (await r.json())["meta_info"]["completion_tokens"] == 3
                counts = [await _metric(s, w, "sglang:num_requests_total") for w in workers]
            assert all(c >= 2 for c in counts), counts  # round robin reached both
        finally:
            if router is not None:
                _stop(router)
            _stop(sim)
    log = sim_log.read_text()
    assert "Traceback" not in log, log
    assert " ERROR " not in log, log
    assert log.count("on http://127.0.0.1:") == 2
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    assert sorted(r["route"] for r in records) == ["chat"] * 5 + ["generate"]
    assert {r["port"] for r in records} == {p1, p2}
    for r in records:
        assert r["arrival"] <= r["first_token"] <= r["last_token"] <= r["end"]
        assert r["finish"] == "length"
