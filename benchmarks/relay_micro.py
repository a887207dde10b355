"""What relaying one SSE event costs: proxy CPU per event and per request, synthetic upstream.

    .venv/bin/python benchmarks/relay_micro.py            # ~2 minutes
    .venv/bin/python benchmarks/relay_micro.py --quick    # ~40 s smoke run
    ... --out benchmarks/results/relay_micro                   # also write .md and .json

No simulator: a synthetic upstream (raw asyncio, uvloop) answers every POST with an SGLang-shaped
chat completion stream, one event per HTTP chunk, every stream's next event written in the same
tick (as a decode step lands every running request's token at once). A raw-socket client keeps
``C`` streams in flight through the proxy under test, closed loop, on the same CPU as the upstream;
the proxy gets the other CPU to itself. The proxy's CPU (utime+stime of its process tree) over a
window is fitted, across answers of several lengths, as ``cpu = a * requests + b * events`` (least
squares): ``b`` is the relay's cost per event, ``a`` what each request costs besides its events.
Non-streamed requests (one JSON answer) are measured on their own: CPU per request.

Targets: pipefill (fixed limit, round_robin: forwarding, not admission control, is measured),
nginx (``proxy_buffering off``) as the reference of a relay written in C, and ``bare``: two
uvloop protocols copying bytes between a client's connection and its own upstream connection
(no HTTP parsing, no statistics), the floor of any relay written in Python on this event loop.
Everything binds 127.0.0.1 on free ports; every run is bounded and every child is killed on
exit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from proxy_overhead import (  # a script beside this one
    NGINX,
    PIPEFILL_CONFIG,
    ROOT,
    BenchError,
    Children,
    free_port,
    start_nginx,
    tool,
    tree_cpu,
    versions,
    wait_ready,
)

TARGETS = ("pipefill", "nginx", "bare")
CLIENT_CPU, PROXY_CPU = "0", "1"
#: the upstream writes every stream's next event this often (ms)
TICK_MS = 20.0
#: answers of these many token events; the fit needs at least two lengths
LENGTHS = {"full": (8, 64, 256), "quick": (8, 128)}
#: (concurrency, warmup s, window s) of the streamed and the non-streamed runs
STREAM = {"full": (128, 3.0, 10.0), "quick": (128, 2.0, 4.0)}
WHOLE = {"full": (64, 2.0, 8.0), "quick": (64, 1.0, 3.0)}

_CHUNK_ID = "0123456789abcdef0123456789abcdef"
_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
    b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n"
)


def _event(obj: dict[str, Any] | str) -> bytes:
    """One SSE event as one HTTP chunk."""
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    payload = f"data: {data}\n\n".encode()
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def _chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {
        "id": _CHUNK_ID,
        "object": "chat.completion.chunk",
        "created": 1733000000,
        "model": "bench/relay",
        "choices": [
            {
                "index": 0,
                "delta": delta,
                "logprobs": None,
                "finish_reason": finish,
                "matched_stop": None,
            }
        ],
        "usage": None,
    }


ROLE = _event(_chunk({"role": "assistant", "content": ""}))
TOKEN = _event(_chunk({"role": None, "content": " word", "reasoning_content": None}))


def _tail(n: int) -> bytes:
    usage = {"prompt_tokens": 16, "completion_tokens": n, "total_tokens": 16 + n}
    done = {**_chunk({}, "length"), "choices": [], "usage": usage}
    finish = _event(_chunk({"content": None}, "length"))
    return finish + _event(done) + _event("[DONE]") + b"0\r\n\r\n"


def _whole(n: int) -> bytes:
    body = json.dumps(
        {
            "id": _CHUNK_ID,
            "object": "chat.completion",
            "created": 1733000000,
            "model": "bench/relay",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": " word" * n},
                    "finish_reason": "length",
                }
            ],
            "usage": {"prompt_tokens": 16, "completion_tokens": n, "total_tokens": 16 + n},
        }
    ).encode()
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        len(body),
        body,
    )


def _answer_get(path: bytes) -> bytes:
    """The proxy's health checks and model listing; anything else is not here."""
    if path == b"/v1/models":
        body = b'{"object":"list","data":[{"id":"bench/relay","object":"model"}]}'
        status = b"200 OK"
    elif path == b"/health":
        body, status = b"", b"200 OK"
    else:
        body, status = b'{"error":"not found"}', b"404 Not Found"
    return b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        status,
        len(body),
        body,
    )


# ---- the synthetic upstream ---------------------------------------------------------------


class _UpstreamConn(asyncio.Protocol):
    """One keep-alive connection: a request's body says ``max_tokens`` and ``stream``."""

    def __init__(self, ticker: _Ticker) -> None:
        self.ticker = ticker
        self.buf = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: BaseException | None) -> None:
        self.ticker.streams.pop(self, None)
        self.transport = None

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].lower()
            i = head.find(b"content-length:")
            length = int(head[i + 15 :].split(b"\r\n", 1)[0]) if i >= 0 else 0
            if len(self.buf) < end + 4 + length:
                return
            body = self.buf[end + 4 : end + 4 + length]
            self.buf = self.buf[end + 4 + length :]
            assert self.transport is not None
            if not head.startswith(b"post"):
                self.transport.write(_answer_get(head.split(b" ", 2)[1]))
                continue
            try:
                req = json.loads(body)
                n = max(1, int(req.get("max_tokens") or 1))
            except (ValueError, TypeError):
                n = 1
            if req.get("stream"):
                self.transport.write(_HEAD)
                self.ticker.streams[self] = n
            else:
                self.transport.write(_whole(n))


class _Ticker:
    """Writes every open stream's next event each tick."""

    def __init__(self, tick_s: float) -> None:
        self.tick_s = tick_s
        self.streams: dict[_UpstreamConn, int] = {}  # stream -> events still to send
        self.sent: dict[_UpstreamConn, int] = {}

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            for conn, left in list(self.streams.items()):
                t = conn.transport
                if t is None:
                    continue
                sent = self.sent.get(conn, 0)
                if sent == 0:
                    t.write(ROLE)
                if left > 1:
                    t.write(TOKEN)
                    self.streams[conn] = left - 1
                    self.sent[conn] = sent + 1
                else:
                    t.write(TOKEN + _tail(sent + 1))
                    del self.streams[conn]
                    self.sent.pop(conn, None)


async def _serve_upstream(port: int, tick_s: float, lifetime: float) -> None:
    loop = asyncio.get_running_loop()
    ticker = _Ticker(tick_s)
    server = await loop.create_server(lambda: _UpstreamConn(ticker), "127.0.0.1", port)
    task = asyncio.ensure_future(ticker.run())
    try:
        await asyncio.sleep(lifetime)  # bounded: stops by itself
    finally:
        task.cancel()
        server.close()


# ---- the bare relay (the floor of a Python relay) ----------------------------------------


class _BareUp(asyncio.Protocol):
    def __init__(self, down: asyncio.Transport) -> None:
        self.down = down

    def data_received(self, data: bytes) -> None:
        if not self.down.is_closing():
            self.down.write(data)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.down.close()


class _BareDown(asyncio.Protocol):
    """One client connection, relayed byte for byte over its own upstream connection."""

    def __init__(self, up_port: int) -> None:
        self.up_port = up_port
        self.up: asyncio.Transport | None = None
        self.early: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]
        self.task = asyncio.ensure_future(self._open())

    async def _open(self) -> None:
        loop = asyncio.get_running_loop()
        up, _ = await loop.create_connection(
            lambda: _BareUp(self.transport), "127.0.0.1", self.up_port
        )
        self.up = up  # type: ignore[assignment]
        for data in self.early:
            up.write(data)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        if self.up is None:
            self.early.append(data)
        elif not self.up.is_closing():
            self.up.write(data)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self.up is not None:
            self.up.close()


async def _serve_bare(port: int, up_port: int, lifetime: float) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _BareDown(up_port), "127.0.0.1", port)
    try:
        await asyncio.sleep(lifetime)  # bounded: stops by itself
    finally:
        server.close()


# ---- the client ---------------------------------------------------------------------------


class _Counts:
    def __init__(self) -> None:
        self.requests = 0
        self.events = 0
        self.errors = 0
        self.counting = False


class _ClientConn(asyncio.Protocol):
    """Closed loop on one keep-alive connection: send, read the whole answer, send again."""

    def __init__(self, request: bytes, counts: _Counts, done: asyncio.Future) -> None:
        self.request = request
        self.counts = counts
        self.done = done
        self.transport: asyncio.Transport | None = None
        self.head: bytes | None = b""
        self.tail = b""
        self.length: int | None = None
        self.got = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.write(self.request)  # type: ignore[attr-defined]

    def connection_lost(self, exc: BaseException | None) -> None:
        if not self.done.done():
            self.done.set_result(None)

    def data_received(self, data: bytes) -> None:
        c = self.counts
        if self.head is not None:  # still reading the response head
            self.head += data
            end = self.head.find(b"\r\n\r\n")
            if end < 0:
                return
            head, data = self.head[:end].lower(), self.head[end + 4 :]
            self.head = None
            if not head.startswith(b"http/1.1 200"):
                c.errors += c.counting
            i = head.find(b"content-length:")
            self.length = int(head[i + 15 :].split(b"\r\n", 1)[0]) if i >= 0 else None
            self.got = 0
            self.tail = b""
        if c.counting:
            c.events += data.count(b"data: ")
        if self.length is not None:
            self.got += len(data)
            finished = self.got >= self.length
        else:
            self.tail = (self.tail + data)[-7:]
            finished = self.tail == b"\r\n0\r\n\r\n"
        if finished:
            c.requests += c.counting
            self.head = b""
            assert self.transport is not None
            self.transport.write(self.request)


async def _run_client(
    host: str, port: int, concurrency: int, events: int, stream: bool, warmup: float, window: float
) -> None:
    body = json.dumps(
        {
            "model": "bench/relay",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": events,
            "stream": stream,
        }
    ).encode()
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: %s:%d\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (host.encode(), port, len(body), body)
    )
    loop = asyncio.get_running_loop()
    counts = _Counts()
    conns = []
    for _ in range(concurrency):
        done = loop.create_future()
        t, _p = await loop.create_connection(
            lambda done=done: _ClientConn(request, counts, done), host, port
        )
        conns.append(t)
    await asyncio.sleep(warmup)
    counts.counting = True
    print("start", flush=True)
    t0 = time.monotonic()
    await asyncio.sleep(window)
    counts.counting = False
    elapsed = time.monotonic() - t0
    print("end", flush=True)
    for t in conns:
        t.close()
    out = {"requests": counts.requests, "events": counts.events, "errors": counts.errors}
    print(json.dumps({**out, "elapsed": elapsed}), flush=True)


# ---- the driver ---------------------------------------------------------------------------


def _measure(
    ch: Children, pid: int, port: int, c: int, events: int, stream: bool, warmup: float, win: float
) -> dict[str, Any]:
    """One client run against ``port``; the proxy's CPU seconds between its start and end."""
    argv = [sys.executable, __file__, "client", "--port", str(port), "--concurrency", str(c)]
    argv += ["--events", str(events), "--warmup", str(warmup), "--window", str(win)]
    if not stream:
        argv.append("--no-stream")
    if ch.taskset:
        argv = [ch.taskset, "-c", CLIENT_CPU, *argv]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert proc.stdout is not None
        cpu0 = cpu1 = None
        result: dict[str, Any] = {}
        for line in proc.stdout:
            if line.startswith("start"):
                cpu0 = tree_cpu({"p": pid})["p"]
            elif line.startswith("end"):
                cpu1 = tree_cpu({"p": pid})["p"]
            elif line.startswith("{"):
                result = json.loads(line)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    if cpu0 is None or cpu1 is None or not result:
        raise BenchError(f"client run (C={c}, {events} events) ended without a result")
    return {**result, "cpu_s": cpu1 - cpu0, "events_per_request": events, "stream": stream}


def fit(runs: list[dict[str, Any]]) -> tuple[float, float]:
    """Least squares of ``cpu = a * requests + b * events`` (no intercept): (a, b) seconds."""
    srr = sum(r["requests"] ** 2 for r in runs)
    see = sum(r["events"] ** 2 for r in runs)
    sre = sum(r["requests"] * r["events"] for r in runs)
    src = sum(r["requests"] * r["cpu_s"] for r in runs)
    sec = sum(r["events"] * r["cpu_s"] for r in runs)
    det = srr * see - sre * sre
    if det <= 0:
        raise BenchError("the runs do not separate per-request from per-event cost")
    return (src * see - sec * sre) / det, (sec * srr - src * sre) / det


def start_targets(ch: Children, tmp: Path, up_port: int, targets: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "pipefill" in targets:
        port = free_port()
        cfg = tmp / "pipefill.toml"
        cfg.write_text(PIPEFILL_CONFIG.format(port=port, backend=f"http://127.0.0.1:{up_port}"))
        argv = [tool("proxy"), "--config", str(cfg)]
        out["pipefill"] = (ch.start("pipefill", argv, cpu=PROXY_CPU), port)
    if "nginx" in targets:
        out["nginx"] = start_nginx(ch, tmp, up_port, PROXY_CPU)
    if "bare" in targets:
        port = free_port()
        argv = [sys.executable, __file__, "bare", "--port", str(port), "--upstream", str(up_port)]
        out["bare"] = (ch.start("bare", argv, cpu=PROXY_CPU), port)
    for child, port in out.values():
        wait_ready(child, f"http://127.0.0.1:{port}", timeout=60.0)
    return out


def render(s: dict[str, Any]) -> str:
    lines = [
        "| target | CPU per event (µs) | CPU per streamed request besides its events (µs) "
        "| CPU per token, 64-token answers (µs) | non-streamed CPU per request (ms) |",
        "|---|---:|---:|---:|---:|",
    ]
    for t, r in s["targets"].items():
        lines.append(
            f"| {t} | {r['per_event_us']:.1f} | {r['per_request_us']:.0f} | "
            f"{r['per_token_64_us']:.1f} | {r['whole_ms_per_request']:.3f} |"
        )
    lines += ["", "Runs (window totals):", ""]
    lines.append("| target | stream | events/request | requests | events | errors | proxy CPU s |")
    lines.append("|---|---|---:|---:|---:|---:|---:|")
    for t, r in s["targets"].items():
        for run in r["runs"]:
            lines.append(
                f"| {t} | {'yes' if run['stream'] else 'no'} | {run['events_per_request']} | "
                f"{run['requests']} | {run['events']} | {run['errors']} | {run['cpu_s']:.2f} |"
            )
    for ref in ("nginx", "bare"):
        ratio = s.get(f"ratio_to_{ref}")
        if ratio:
            lines += ["", f"pipefill / {ref} CPU per event: **{ratio:.1f}x**"]
    bar = s["targets"].get("pipefill")
    if bar:
        met = bar["per_event_us"] <= 10.0
        lines += [
            "",
            f"**Target (issue 18)**: per-event relay CPU <= 10 µs: pipefill "
            f"{bar['per_event_us']:.1f} µs: **{'met' if met else 'NOT met'}**.",
        ]
    return "\n".join(lines) + "\n"


def drive(args: argparse.Namespace) -> int:
    mode = "quick" if args.quick else "full"
    targets = [t for t in args.targets.split(",") if t]
    unknown = set(targets) - set(TARGETS)
    if unknown or not targets:
        print(f"relay_micro: targets must be among {','.join(TARGETS)}", file=sys.stderr)
        return 2
    if "nginx" in targets and not Path(NGINX).exists():
        print(f"relay_micro: {NGINX} not found (apt-get install nginx); or --targets pipefill",
              file=sys.stderr)  # fmt: skip
        return 2

    def on_term(_sig: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    tmp = Path(tempfile.mkdtemp(prefix="pipefill-relay-"))
    ch = Children(tmp)
    t_start = time.monotonic()
    try:
        up_port = free_port()
        lifetime = 600 if mode == "full" else 200
        ch.start(
            "upstream",
            [sys.executable, __file__, "upstream", "--port", str(up_port),
             "--lifetime", str(lifetime)],
            cpu=CLIENT_CPU,
        )  # fmt: skip
        started = start_targets(ch, tmp, up_port, targets)
        c, warmup, window = STREAM[mode]
        wc, wwarm, wwin = WHOLE[mode]
        summary: dict[str, Any] = {"targets": {}}
        for name, (child, port) in started.items():
            runs = []
            for n in LENGTHS[mode]:
                run = _measure(ch, child.pid, port, c, n, True, warmup, window)
                print(f"  {name:<9} stream  {n:>4} events/request: {run['requests']:>6} "
                      f"requests {run['events']:>7} events  CPU {run['cpu_s']:.2f} s",
                      flush=True)  # fmt: skip
                runs.append(run)
            a, b = fit(runs)
            whole = _measure(ch, child.pid, port, wc, 16, False, wwarm, wwin)
            print(f"  {name:<9} whole   {whole['requests']:>6} requests  "
                  f"CPU {whole['cpu_s']:.2f} s", flush=True)  # fmt: skip
            summary["targets"][name] = {
                "per_event_us": b * 1e6,
                "per_request_us": a * 1e6,
                # a 64-token answer carries 64 token events + role, finish, usage and [DONE]
                "per_token_64_us": (a + 68 * b) / 64 * 1e6,
                "whole_ms_per_request": whole["cpu_s"] / max(whole["requests"], 1) * 1e3,
                "runs": [*runs, whole],
            }
        measured = summary["targets"]
        for ref in ("nginx", "bare"):
            if "pipefill" in measured and ref in measured:
                summary[f"ratio_to_{ref}"] = measured["pipefill"]["per_event_us"] / max(
                    measured[ref]["per_event_us"], 1e-3
                )
        summary["meta"] = {
            "mode": mode,
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "elapsed_s": round(time.monotonic() - t_start, 1),
            "cpus": os.cpu_count(),
            "tick_ms": TICK_MS,
            "stream": STREAM[mode],
            "lengths": LENGTHS[mode],
            "whole": WHOLE[mode],
            "versions": versions(),
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        }
        text = render(summary)
        print()
        print(text)
        if args.out:
            prefix = Path(args.out)
            prefix.parent.mkdir(parents=True, exist_ok=True)
            prefix.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")
            m = summary["meta"]
            header = (
                "# Relay microbenchmark: proxy CPU per SSE event (synthetic upstream)\n\n"
                f"`{m['command']}` — {m['started_at']}, {m['elapsed_s']:.0f} s, {m['cpus']} CPUs; "
                f"upstream + client on CPU {CLIENT_CPU}, proxy on CPU {PROXY_CPU}; {c} streams, "
                f"one event per stream every {TICK_MS:g} ms, answers of "
                f"{', '.join(map(str, LENGTHS[mode]))} events; non-streamed: {wc} clients. "
                "Versions: " + ", ".join(f"{k} {v}" for k, v in m["versions"].items()) + ".\n\n"
            )
            prefix.with_suffix(".md").write_text(header + text)
            print(f"wrote {prefix.with_suffix('.md')} and {prefix.with_suffix('.json')}")
        return 0
    except BenchError as e:
        print(f"relay_micro: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("relay_micro: interrupted", file=sys.stderr)
        return 130
    finally:
        ch.stop_all()
        if not args.keep_tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="mode")
    up = sub.add_parser("upstream", help="(internal) the synthetic upstream")
    up.add_argument("--port", type=int, required=True)
    up.add_argument("--lifetime", type=float, default=600.0)
    bare = sub.add_parser("bare", help="(internal) the bare uvloop relay")
    bare.add_argument("--port", type=int, required=True)
    bare.add_argument("--upstream", type=int, required=True)
    bare.add_argument("--lifetime", type=float, default=600.0)
    cl = sub.add_parser("client", help="(internal) the raw-socket client")
    cl.add_argument("--port", type=int, required=True)
    cl.add_argument("--concurrency", type=int, required=True)
    cl.add_argument("--events", type=int, required=True)
    cl.add_argument("--warmup", type=float, required=True)
    cl.add_argument("--window", type=float, required=True)
    cl.add_argument("--no-stream", action="store_true")
    ap.add_argument("--quick", action="store_true", help="~40 s smoke run")
    ap.add_argument("--out", metavar="PREFIX", help="write PREFIX.md and PREFIX.json")
    ap.add_argument(
        "--targets", default=",".join(TARGETS), help="comma-separated: pipefill,nginx,bare"
    )
    ap.add_argument("--keep-tmp", action="store_true", help="keep the temp dir (logs)")
    args = ap.parse_args(argv)
    if args.mode in ("upstream", "client", "bare"):
        try:
            import uvloop

            uvloop.install()
        except ImportError:
            pass
        if args.mode == "upstream":
            asyncio.run(_serve_upstream(args.port, TICK_MS / 1e3, args.lifetime))
        elif args.mode == "bare":
            asyncio.run(_serve_bare(args.port, args.upstream, args.lifetime))
        else:
            asyncio.run(
                _run_client(
                    "127.0.0.1", args.port, args.concurrency, args.events, not args.no_stream,
                    args.warmup, args.window,
                )
            )  # fmt: skip
        return 0
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
