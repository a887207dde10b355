"""The proxy as users run it (``proxy`` CLI subprocess) in front of ``loadtest sim`` backends:
every route with the openai client, disconnect-abort seen in the simulator's load, fault
injection, SIGTERM drain, SIGHUP reload, and ``loadtest run`` through the proxy."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import openai
import pytest
from conftest import free_port

from loadtest.sim.profiles import load_profile

BIN = Path(sys.executable).parent
SIM_MODEL = "moonshotai/Kimi-K2.6"
pytestmark = pytest.mark.slow


def _wait_http(url: str, within: float = 15.0, status: int = 200) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == status:
                    return
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(0.05)
    raise AssertionError(f"{url} not ready")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@pytest.fixture(scope="module")
def sims():
    """Two simulated backends (tp8, pp8) in one process, 10x faster than real time."""
    ports = [free_port(), free_port()]
    proc = subprocess.Popen(
        [str(BIN / "loadtest"), "sim", "--profile", "tp8", "--port", str(ports[0]),
         "--profile", "pp8", "--port", str(ports[1]), "--time-scale", "0.1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        for p in ports:
            _wait_http(f"http://127.0.0.1:{p}/health")
        yield [f"http://127.0.0.1:{p}" for p in ports]
    finally:
        _stop(proc)


def _write_config(path: Path, backends: list[tuple[str, str]], extra: str = "") -> None:
    text = extra + "\n"
    for name, url in backends:
        text += f'[[backends]]\nname = "{name}"\nurl = "{url}"\n'
    path.write_text(text)


class ProxyProc:
    def __init__(self, config: Path, *args: str, env: dict | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [str(BIN / "proxy"), "--config", str(config), "--port", str(self.port), *args],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env={**os.environ, **(env or {})},
        )  # fmt: skip

    def __enter__(self) -> ProxyProc:
        try:
            _wait_http(self.url + "/health")
        except AssertionError:
            _stop(self.proc)
            raise AssertionError(self.proc.stderr.read()) from None
        return self

    def __exit__(self, *exc) -> None:
        _stop(self.proc)


def _client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=20)


FAST = """
[health]
interval_s = 0.2
eject_s = 0.5
[retries]
backoff_base_s = 0
[server]
shutdown_grace_s = 10
drain_s = 0
"""


async def test_every_route_through_the_cli_proxy(sims, tmp_path):
    cfg = tmp_path / "proxy.toml"
    _write_config(cfg, [("tp8", sims[0]), ("pp8", sims[1])], FAST)
    with ProxyProc(cfg) as px:
        c = _client(px.url)
        models = await c.models.list()
        assert [m.id for m in models.data] == [SIM_MODEL]
        stream = await c.chat.completions.create(
            model=SIM_MODEL,
            messages=[{"role": "user", "content": "one two three"}],
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        pieces, usage = [], None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
            usage = chunk.usage or usage
        assert pieces and usage.completion_tokens == 8  # deltas may coalesce tokens
        r = await c.chat.completions.create(
            model=SIM_MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            extra_body={"ignore_eos": True},
        )
        assert r.usage.completion_tokens == 4
        comp = await c.completions.create(
            model=SIM_MODEL, prompt="a b c", max_tokens=3, extra_body={"ignore_eos": True}
        )
        assert comp.usage.completion_tokens == 3
        async with aiohttp.ClientSession() as s:
            async with s.post(
                px.url + "/generate",
                json={
                    "text": "a b",
                    "sampling_params": {"max_new_tokens": 5, "ignore_eos": True},
                    "stream": True,
                },
            ) as resp:
                body = await resp.read()
                assert resp.status == 200 and body.endswith(b"data: [DONE]\n\n")
                assert resp.headers["X-Pipefill-Backend"] in ("tp8", "pp8")
            async with s.get(px.url + "/get_model_info") as resp:
                assert resp.status == 200
            async with s.post(
                px.url + "/v1/chat/completions",
                json={
                    "model": SIM_MODEL,
                    "messages": [{"role": "user", "content": "x " * 300000}],
                    "max_tokens": 4,
                },
            ) as resp:
                assert resp.status == 400  # SGLang's context-length error, passed through
                assert "object" in await resp.json()
            async with s.get(px.url + "/metrics") as resp:
                text = await resp.text()
                for name in (
                    "pipefill_requests_total",
                    "pipefill_ttft_seconds_bucket",
                    "pipefill_itl_seconds_bucket",
                    "pipefill_output_tokens_total",
                    "pipefill_backend_in_flight",
                    "pipefill_backend_healthy",
                    "pipefill_event_loop_lag_seconds_count",
                    "pipefill_request_duration_seconds_bucket",
                ):
                    assert name in text, name


async def _load(sim: str) -> int:
    async with aiohttp.ClientSession() as s, s.get(sim + "/get_load") as r:
        return sum(row["num_reqs"] for row in await r.json())


async def test_client_disconnect_aborts_in_the_simulator(sims, tmp_path):
    cfg = tmp_path / "proxy.toml"
    _write_config(cfg, [("tp8", sims[0])], FAST)
    with ProxyProc(cfg) as px:
        async with aiohttp.ClientSession() as s:
            resp = await s.post(
                px.url + "/v1/chat/completions",
                json={
                    "model": SIM_MODEL,
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 20000,
                    "ignore_eos": True,
                    "stream": True,
                },
            )
            await resp.content.readline()
            assert await _load(sims[0]) == 1
            resp.close()
        for _ in range(100):
            if await _load(sims[0]) == 0:
                break
            await asyncio.sleep(0.02)
        assert await _load(sims[0]) == 0  # the generation was aborted, not left running


async def _faults(sim: str, method: str, body: dict | None = None) -> None:
    async with aiohttp.ClientSession() as s, s.request(method, sim + "/sim/faults", json=body) as r:
        assert r.status == 200, await r.text()


async def test_simulator_faults_retry_and_mid_stream_errors(sims, tmp_path):
    cfg = tmp_path / "proxy.toml"
    extra = FAST.replace("eject_s = 0.5", "eject_s = 0.5\npassive_failures = 100")
    _write_config(cfg, [("tp8", sims[0]), ("pp8", sims[1])], extra + "[timeouts]\nidle_s = 0.5\n")
    with ProxyProc(cfg) as px:
        c = _client(px.url)
        try:
            await _faults(sims[0], "POST", {"error_rate": 1.0})
            for _ in range(4):  # every request that lands on tp8 is retried on pp8
                r = await c.chat.completions.with_raw_response.create(
                    model=SIM_MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2
                )
                assert r.headers["X-Pipefill-Backend"] == "pp8"
            await _faults(sims[0], "DELETE")
            await _faults(sims[1], "DELETE")
            await _faults(sims[0], "POST", {"drop_rate": 1.0, "stall_after_tokens": 2})
            await _faults(sims[1], "POST", {"stall_rate": 1.0, "stall_after_tokens": 2})
            for _ in range(2):
                stream = await c.chat.completions.create(
                    model=SIM_MODEL,
                    messages=[{"role": "user", "content": "x"}],
                    max_tokens=50,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                with pytest.raises(openai.APIError):  # the final SSE error event
                    async for _ in stream:
                        pass
        finally:
            await _faults(sims[0], "DELETE")
            await _faults(sims[1], "DELETE")


async def test_sigterm_drains_streams_in_flight(sims, tmp_path):
    cfg = tmp_path / "proxy.toml"
    _write_config(cfg, [("tp8", sims[0])], FAST)
    px = ProxyProc(cfg)
    with px:
        async with aiohttp.ClientSession() as s:
            resp = await s.post(
                px.url + "/v1/chat/completions",
                json={
                    "model": SIM_MODEL,
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 300,
                    "ignore_eos": True,
                    "stream": True,
                },
            )
            await resp.content.readline()
            t0 = time.monotonic()
            px.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            with pytest.raises(aiohttp.ClientConnectionError):  # no longer accepting
                async with aiohttp.ClientSession() as s2, s2.get(px.url + "/health"):
                    pass
            body = await resp.read()  # ... but the stream in flight finishes
            assert body.endswith(b"data: [DONE]\n\n")
        assert px.proc.wait(10) == 0
        assert time.monotonic() - t0 < 10


async def test_sighup_reloads_backends_without_dropping_streams(sims, tmp_path):
    cfg = tmp_path / "proxy.toml"
    _write_config(cfg, [("tp8", sims[0])], FAST)
    with ProxyProc(cfg) as px:
        async with aiohttp.ClientSession() as s:
            resp = await s.post(
                px.url + "/v1/chat/completions",
                json={
                    "model": SIM_MODEL,
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 200,
                    "ignore_eos": True,
                    "stream": True,
                },
            )
            await resp.content.readline()
            _write_config(cfg, [("pp8", sims[1])], FAST)  # tp8 out, pp8 in
            px.proc.send_signal(signal.SIGHUP)
            names: list[str] = []
            for _ in range(100):
                async with s.get(px.url + "/admin/backends") as r:
                    names = [(b["name"], b["state"]) for b in (await r.json())["backends"]]
                if ("pp8", "healthy") in names:
                    break
                await asyncio.sleep(0.05)
            assert ("pp8", "healthy") in names and ("tp8", "draining") in names
            body = await resp.read()
            assert body.endswith(b"data: [DONE]\n\n")  # the tp8 stream was not cut
            async with s.post(
                px.url + "/v1/chat/completions",
                json={
                    "model": SIM_MODEL,
                    "messages": [{"role": "user", "content": "x"}],
                    "max_tokens": 2,
                },
            ) as r:
                assert r.headers["X-Pipefill-Backend"] == "pp8"
            cfg.write_text("[health]\ninterval_s = -1\n")
            px.proc.send_signal(signal.SIGHUP)  # a broken file is reported and ignored
            await asyncio.sleep(0.3)
            async with s.get(px.url + "/health") as r:
                assert r.status == 200


def test_loadtest_run_through_the_proxy(sims, tmp_path):
    cfg = tmp_path / "proxy.toml"
    _write_config(cfg, [("tp8", sims[0]), ("pp8", sims[1])], FAST)
    out = tmp_path / "run.json"
    with ProxyProc(cfg) as px:
        r = subprocess.run(
            [str(BIN / "loadtest"), "run", "--url", px.url, "--concurrency", "4",
             "--requests", "12", "--output-len", "16", "--input-len", "16", "--time-scale",
             "0.1", "--out", str(out), "--quiet"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    level = data["levels"][0]
    assert level["completed"] >= 1 and level["failed"] == 0 and not level["errors_all"], level
    assert level["token_mismatch"] == 0 and level["usage_missing"] == 0


def test_bad_config_fails_at_start_naming_the_field(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[health]\ninterval_s = -1\n")
    r = subprocess.run(
        [str(BIN / "proxy"), "--config", str(cfg)], capture_output=True, text=True, timeout=20
    )
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "health.interval_s" in lines[0] and "Traceback" not in r.stderr
    cfg.write_text("[servr]\nport = 1\n")
    r = subprocess.run(
        [str(BIN / "proxy"), "--config", str(cfg)], capture_output=True, text=True, timeout=20
    )
    assert r.returncode == 2 and "servr" in r.stderr
    cfg.write_text("[server\n")
    r = subprocess.run(
        [str(BIN / "proxy"), "--config", str(cfg)], capture_output=True, text=True, timeout=20
    )
    assert r.returncode == 2 and "invalid TOML" in r.stderr
    r = subprocess.run(
        [str(BIN / "proxy"), "--backend", "http://x:1"],
        capture_output=True,
        text=True,
        timeout=20,
        env={**os.environ, "PIPEFILL_SERVER__PORT": "x"},
    )
    assert r.returncode == 2 and "server.port" in r.stderr


async def test_sigterm_grace_period_bounds_the_wait(sims, tmp_path):
    cfg = tmp_path / "proxy.toml"
    _write_config(
        cfg, [("tp8", sims[0])], FAST.replace("shutdown_grace_s = 10", "shutdown_grace_s = 0.5")
    )
    px = ProxyProc(cfg)
    with px:
        async with aiohttp.ClientSession() as s:
            resp = await s.post(
                px.url + "/v1/chat/completions",
                json={
                    "model": SIM_MODEL,
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 100000,
                    "ignore_eos": True,
                    "stream": True,
                },
            )
            await resp.content.readline()
            t0 = time.monotonic()
            px.proc.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(px.proc.wait, 10) == 0
            assert time.monotonic() - t0 < 5  # did not wait for the 100000-token stream
            body = await resp.read()  # cut after the grace period: it says why, then [DONE]
            events = [e for e in body.split(b"\n\n") if e]
            assert events[-1] == b"data: [DONE]"
            error = json.loads(events[-2].removeprefix(b"data: "))["error"]
            assert error["code"] == "shutting_down"
        for _ in range(100):  # and the cut stream was aborted in the backend too
            if await _load(sims[0]) == 0:
                break
            await asyncio.sleep(0.02)
        assert await _load(sims[0]) == 0


async def test_a_cold_start_begins_at_what_the_server_says_it_runs(sims, tmp_path):
    """The proxy asks each backend's /server_info before it serves: the first request already
    finds each limit at its server's max_running_requests, not at the initial 8 (exactly: with
    another backend to take them, no requests are kept ready in either server's queue)."""
    cfg = tmp_path / "proxy.toml"
    _write_config(cfg, [("tp8", sims[0]), ("pp8", sims[1])], FAST)
    with ProxyProc(cfg) as px:
        c = _client(px.url)
        await c.chat.completions.create(
            model=SIM_MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1
        )
        async with aiohttp.ClientSession() as s, s.get(px.url + "/admin/backends") as r:
            assert r.status == 200
            state = {b["name"]: b["limit_state"] for b in (await r.json())["backends"]}
        for name in ("tp8", "pp8"):
            assert state[name]["limit"] == load_profile(name).max_running_requests
            assert state[name]["decision"] == "server"


@pytest.fixture
def sglang_defaults_sim():
    """An ep8 backend started as SGLang is by default: no /metrics (it needs --enable-metrics),
    max_running_requests left to the scheduler (null in /server_info; per DP rank in
    /v1/loads)."""
    port = free_port()
    proc = subprocess.Popen(
        [str(BIN / "loadtest"), "sim", "--profile", "ep8", "--port", str(port),
         "--time-scale", "0.1", "--no-metrics", "--max-running-unset"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        _wait_http(f"http://127.0.0.1:{port}/health")
        yield f"http://127.0.0.1:{port}"
    finally:
        _stop(proc)


async def test_sglang_started_with_its_defaults_is_still_filled_from_the_start(
    sglang_defaults_sim, tmp_path
):
    """The proxy still learns what such a server runs before the first request, and reads its
    queue from the load report."""
    cfg = tmp_path / "proxy.toml"
    _write_config(cfg, [("ep8", sglang_defaults_sim)], FAST)
    with ProxyProc(cfg) as px:
        c = _client(px.url)
        await c.chat.completions.create(
            model=SIM_MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1
        )
        async with aiohttp.ClientSession() as s, s.get(px.url + "/admin/backends") as r:
            (backend,) = (await r.json())["backends"]
    state = backend["limit_state"]
    # the server's word, plus the few kept ready where no other backend could take them
    assert state["decision"] == "server"
    assert state["limit"] >= load_profile("ep8").max_running_requests
    scrape = backend["stats"]["scrape"]
    assert scrape["max_running_requests"] == load_profile("ep8").max_running_requests
    # its queue is read from the load report instead of the metrics
    assert scrape["queue_reqs"] is not None and not scrape["stale"]
