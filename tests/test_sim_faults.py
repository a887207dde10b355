"""Fault injection: flags and the /sim/faults admin route; each fault as a client meets it."""

from __future__ import annotations

import argparse
import asyncio

import aiohttp
import orjson
import pytest
from sim_util import running_sim, sse_json, wait_until

from loadtest.sim.faults import FaultConfig, Faults, add_fault_arguments, config_from_args

CHAT = "/v1/chat/completions"
STREAM_BODY = {
    "messages": [{"role": "user", "content": "hello"}],
    "max_tokens": 400,
    "ignore_eos": True,
    "stream": True,
}


def running(backend) -> int:
    return int(backend.engine.live_stats().num_running_reqs)


async def test_error_rate_answers_5xx_before_streaming():
    async with running_sim(error_rate=1.0, error_status=503) as (url, backend):
        async with aiohttp.ClientSession(url) as s:
            async with s.post(CHAT, json=STREAM_BODY) as r:
                assert r.status == 503
                out = await r.json()
            assert out["object"] == "error" and out["code"] == 503
            body = {"text": "a", "sampling_params": {"max_new_tokens": 2}}
            async with s.post("/generate", json=body) as r:
                assert r.status == 503
                assert "message" in (await r.json())["error"]
        assert running(backend) == 0  # nothing reached the engine
        assert backend.faults.injected["error"] == 2


async def test_stall_stops_sending_mid_stream_and_disconnect_aborts():
    async with running_sim(stall_rate=1.0, stall_after_tokens=3) as (url, backend):
        async with aiohttp.ClientSession(url) as s:
            r = await s.post(CHAT, json=STREAM_BODY)
            assert r.status == 200
            got = b""
            with pytest.raises(TimeoutError):
                while True:  # read until the stream goes silent
                    async with asyncio.timeout(
                        0.5
                    ):  # a stall, not a slow engine: tokens take ~0.4 ms
                        got += await r.content.readuntil(b"\n\n")
            events = [orjson.loads(e[6:]) for e in got.split(b"\n\n") if e]
            text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
            assert 3 <= len(text.split()) < 400  # stalled after >= 3 tokens, never finished
            assert b"[DONE]" not in got and b'"finish_reason":"length"' not in got
            r.close()
        await wait_until(lambda: running(backend) == 0)


async def test_drop_cuts_the_connection_mid_stream():
    async with running_sim(drop_rate=1.0, stall_after_tokens=2) as (url, backend):
        async with aiohttp.ClientSession(url) as s:
            async with s.post(CHAT, json=STREAM_BODY) as r:
                assert r.status == 200
                with pytest.raises(aiohttp.ClientPayloadError):
                    await r.read()
            body = {**STREAM_BODY, "stream": False}  # non-streaming requests are not dropped
            async with s.post(CHAT, json=body) as r:
                assert r.status == 200
        await wait_until(lambda: running(backend) == 0)
        assert backend.faults.injected["drop"] == 1


async def test_health_faults_and_startup_period():
    async with running_sim(startup_s=60.0) as (url, backend):
        async with aiohttp.ClientSession(url) as s:
            for path in ("/health", "/health_generate"):
                async with s.get(path) as r:
                    assert r.status == 503, path
            # generation still works while "starting" (only readiness is affected)
            async with s.post(CHAT, json=STREAM_BODY) as r:
                assert r.status == 200
                await r.read()
            async with s.post("/sim/faults", json={"startup_s": 0}) as r:
                assert r.status == 200
                assert (await r.json())["starting"] is False
            async with s.get("/health") as r:
                assert r.status == 200
            async with s.post("/sim/faults", json={"health_fail": True}) as r:
                assert r.status == 200
            async with s.get("/health_generate") as r:
                assert r.status == 503
            async with s.post("/sim/faults", json={"health_fail": False, "health_delay_s": 0.05}):
                pass
            checks = backend.health_checks
            async with s.get("/health") as r:
                assert r.status == 200
            assert backend.health_checks == checks + 1


async def test_admin_route_get_post_delete_and_validation():
    async with running_sim() as (url, backend):
        async with aiohttp.ClientSession(url) as s:
            async with s.get("/sim/faults") as r:
                state = await r.json()
            assert state["error_rate"] == 0 and state["injected"] == {
                "error": 0,
                "stall": 0,
                "drop": 0,
            }
            async with s.post("/sim/faults", json={"error_rate": 1.0}) as r:
                assert (await r.json())["error_rate"] == 1.0
            async with s.post(CHAT, json=STREAM_BODY) as r:
                assert r.status == 503
            for bad in ({"error_rate": 2}, {"nope": 1}, [1, 2]):
                async with s.post("/sim/faults", json=bad) as r:
                    assert r.status == 400
                    assert "message" in (await r.json())["error"]
            assert backend.faults.config.error_rate == 1.0  # unchanged by invalid posts
            async with s.delete("/sim/faults") as r:
                assert (await r.json())["error_rate"] == 0
            async with s.post(CHAT, json=STREAM_BODY) as r:
                assert r.status == 200
                assert sse_json(await r.read())[-1]["choices"][0]["finish_reason"] == "length"


def test_fault_flags_parse_and_validate():
    parser = argparse.ArgumentParser()
    add_fault_arguments(parser)
    args = parser.parse_args(
        ["--fault-error-rate", "0.25", "--fault-stall-rate", "0.5", "--fault-after-tokens", "7",
         "--fault-health-fail", "--startup-delay", "3"]
    )  # fmt: skip
    cfg = config_from_args(args)
    assert cfg == FaultConfig(
        error_rate=0.25, stall_rate=0.5, stall_after_tokens=7, health_fail=True, startup_s=3
    )
    with pytest.raises(ValueError, match="error_rate"):
        config_from_args(parser.parse_args(["--fault-error-rate", "1.5"]))


def test_fates_are_seeded():
    cfg = FaultConfig(error_rate=0.3, drop_rate=0.3)
    fates = [[Faults(cfg, seed=7).decide(True).fate for _ in range(1)] for _ in range(2)]
    a, b = Faults(cfg, seed=7), Faults(cfg, seed=7)
    seq_a = [a.decide(True).fate for _ in range(50)]
    seq_b = [b.decide(True).fate for _ in range(50)]
    assert seq_a == seq_b and fates[0] == fates[1]
    assert {"ok", "error", "drop"} <= set(seq_a)
    assert all(Faults(FaultConfig(stall_rate=1.0)).decide(False).fate == "ok" for _ in range(5))
