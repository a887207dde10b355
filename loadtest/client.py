"""The HTTP side of the load generator: one keep-alive pool, one request -> one RequestRecord.

Built for load: a single `aiohttp.ClientSession` whose connector holds at least as many
keep-alive connections as there are streams, a large read buffer so long streams are not
read 64 KiB at a time, and token events timestamped with `time.monotonic()` the moment
their bytes arrive (before parsing). SSE framing and token accounting are `proxy.sse`'s.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from loadtest.records import CANCELLED, RequestRecord
from loadtest.workload import RequestSpec
from proxy.settings import ServerSettings
from proxy.sse import SSEFramer, TokenCounter

READ_BUFSIZE = 4 * 1024 * 1024
#: pipefill's default ``server.backend_header``: which backend served, kept per record
SERVED_BY_HEADER: str = ServerSettings.model_fields["backend_header"].default


class TargetError(Exception):
    """The target cannot be used at all (unreachable, wrong URL, not an SGLang/OpenAI API)."""


@dataclass
class Target:
    url: str  # base URL, no trailing slash
    api: str = "chat"
    stream: bool = True
    headers: dict[str, str] = field(default_factory=dict)
    request_timeout: float | None = 600.0  # per request, seconds (None: no limit)

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")


def make_session(
    target: Target, pool_size: int, *, connect_timeout: float = 10.0
) -> aiohttp.ClientSession:
    """A session with one keep-alive pool of ``pool_size`` connections to the target."""
    connector = aiohttp.TCPConnector(
        limit=max(pool_size, 1),
        limit_per_host=0,
        # below uvicorn's 5 s idle timeout (SGLang's server), so the client never reuses a
        # connection the server is about to close
        keepalive_timeout=4.0,
        ttl_dns_cache=None,
        enable_cleanup_closed=False,
    )
    headers = {"Content-Type": "application/json", **target.headers}
    timeout = aiohttp.ClientTimeout(
        total=target.request_timeout, connect=None, sock_connect=connect_timeout
    )
    return aiohttp.ClientSession(
        connector=connector,
        headers=headers,
        timeout=timeout,
        read_bufsize=READ_BUFSIZE,
        auto_decompress=False,
        skip_auto_headers=("User-Agent",),
    )


def _error_message(body: bytes) -> str:
    """The message of an OpenAI-shaped error (nested or SGLang's top-level form), else text."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body[:200].decode("utf-8", "replace").strip() or "(empty body)"
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:300]
        if isinstance(err, str):
            return err[:300]
        if obj.get("detail"):
            return str(obj["detail"])[:300]
    return body[:200].decode("utf-8", "replace")


def _classify(exc: BaseException) -> str:
    if isinstance(exc, aiohttp.ClientConnectorError):
        return "connect"
    if isinstance(exc, asyncio.TimeoutError | aiohttp.ServerTimeoutError):
        return "timeout"
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError):
        return "disconnect"
    return "client_error"


async def execute(
    session: aiohttp.ClientSession,
    target: Target,
    spec: RequestSpec,
    rec: RequestRecord,
    *,
    closed_loop: bool = True,
) -> RequestRecord:
    """Send ``spec`` and fill ``rec`` (t_send, token events, usage, status, error, t_end).

    Closed loop: ``t_scheduled`` is set to ``t_send``; open loop keeps the scheduled time the
    caller put there, so latencies include any wait for the send (coordinated omission).

    Never raises for HTTP or network failures (they become ``rec.error``); only
    cancellation propagates, after marking the record ``cancelled``.
    """
    rec.requested_input_len = spec.input_len
    rec.requested_output_len = spec.output_len
    url = target.url + spec.path
    mono = time.monotonic
    try:
        rec.t_send = mono()
        if closed_loop:
            rec.t_scheduled = rec.t_send
        async with session.post(url, data=spec.body) as resp:
            rec.status = resp.status
            rec.served_by = resp.headers.get(SERVED_BY_HEADER)
            if resp.status >= 400:
                body = await resp.read()
                rec.error = f"http_{resp.status // 100}xx"
                rec.error_message = f"HTTP {resp.status}: {_error_message(body)}"
                return rec
            if target.stream:
                await _read_stream(resp, target.api, rec, spec.keep_answer)
            else:
                await _read_whole(resp, target.api, rec, spec.keep_answer)
    except asyncio.CancelledError:
        rec.error = rec.error or CANCELLED
        rec.error_message = rec.error_message or "stopped before the response finished"
        raise
    except Exception as exc:  # network failures become the record's error
        rec.error = _classify(exc)
        rec.error_message = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        rec.t_end = mono()
    return rec


async def _read_stream(
    resp: aiohttp.ClientResponse, api: str, rec: RequestRecord, keep_answer: bool = False
) -> None:
    framer = SSEFramer()
    counter = TokenCounter(api)  # type: ignore[arg-type]
    times, counts = rec.token_times, rec.token_counts
    mono = time.monotonic
    content = resp.content
    answer = Answer(api) if keep_answer else None
    try:
        while True:
            chunk = await content.readany()
            if not chunk:
                break
            t = mono()
            for payload in framer.feed(chunk):
                n = counter.observe(payload)
                if n:
                    times.append(t)
                    counts.append(n)
                    if answer is not None:
                        answer.event(payload)
    finally:  # also when the stream is cut (cancelled, network error): keep what arrived
        if times:
            rec.t_first = times[0]
            rec.t_last = times[-1]
    rec.completion_tokens = counter.completion_tokens
    rec.prompt_tokens = counter.prompt_tokens
    rec.cached_tokens = counter.cached_tokens
    if answer is not None:
        rec.answer = answer.text()
    rec.finish_reason = counter.finish_reason
    if counter.error is not None:
        rec.error = "stream_error"
        rec.error_message = str(counter.error.get("message", counter.error))[:300]
    elif not counter.done:
        rec.error = "incomplete"
        rec.error_message = "stream ended without [DONE]"
    elif counter.malformed:
        rec.error = "malformed"
        rec.error_message = f"{counter.malformed} event(s) were not JSON"
    elif rec.finish_reason == "abort":
        rec.error = "aborted"
        rec.error_message = "the server aborted the request"


async def _read_whole(
    resp: aiohttp.ClientResponse, api: str, rec: RequestRecord, keep_answer: bool = False
) -> None:
    body = await resp.read()
    t = time.monotonic()
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        rec.error = "malformed"
        rec.error_message = "response is not JSON"
        return
    if isinstance(obj, list) and obj:
        obj = obj[0]
    if not isinstance(obj, dict):
        rec.error = "malformed"
        rec.error_message = "unexpected response shape"
        return
    if api == "generate":
        meta = obj.get("meta_info") or {}
        n, p = meta.get("completion_tokens"), meta.get("prompt_tokens")
        fr = meta.get("finish_reason")
        rec.finish_reason = fr.get("type") if isinstance(fr, dict) else fr
        cached = meta.get("cached_tokens")
    else:
        usage = obj.get("usage") or {}
        n, p = usage.get("completion_tokens"), usage.get("prompt_tokens")
        first = (obj.get("choices") or [{}])[0]
        rec.finish_reason = first.get("finish_reason") if isinstance(first, dict) else None
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
    rec.cached_tokens = cached if isinstance(cached, int) and not isinstance(cached, bool) else None
    if keep_answer:
        rec.answer = whole_answer(api, obj)
    rec.completion_tokens = n if isinstance(n, int) else None
    rec.prompt_tokens = p if isinstance(p, int) else None
    if rec.completion_tokens:
        # a whole response is one event carrying every token: TTFT = E2E, no ITL samples
        rec.t_first = rec.t_last = t
        rec.token_times.append(t)
        rec.token_counts.append(rec.completion_tokens)
    if obj.get("error") is not None and "choices" not in obj:
        rec.error = "server_error"
        rec.error_message = _error_message(body)
    elif rec.finish_reason == "abort":
        rec.error = "aborted"
        rec.error_message = "the server aborted the request"


# ---------------------------------------------------------------------------------------
# Answers (multi-turn workloads send them back)


def _choice(obj: Any) -> dict:
    choices = obj.get("choices") if isinstance(obj, dict) else None
    first = choices[0] if isinstance(choices, list) and choices else None
    return first if isinstance(first, dict) else {}


def _str(value: Any) -> str:
    return value if isinstance(value, str) else ""


class Answer:
    """The text of a streamed answer, from its token events: chat deltas and completion texts
    add up; ``/generate`` events carry the whole text so far (SGLang's default), so the last
    one is the answer."""

    def __init__(self, api: str) -> None:
        self.api = api
        self._parts: list[str] = []
        self._whole = ""

    def event(self, payload: bytes) -> None:
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return
        if self.api == "generate":
            self._whole = _str(obj.get("text")) if isinstance(obj, dict) else self._whole
        elif self.api == "chat":
            delta = _choice(obj).get("delta")
            self._parts.append(_str(delta.get("content")) if isinstance(delta, dict) else "")
        else:
            self._parts.append(_str(_choice(obj).get("text")))

    def text(self) -> str:
        return self._whole if self.api == "generate" else "".join(self._parts)


def whole_answer(api: str, obj: dict) -> str:
    """The text of a non-streamed answer."""
    if api == "generate":
        return _str(obj.get("text"))
    if api == "chat":
        message = _choice(obj).get("message")
        return _str(message.get("content")) if isinstance(message, dict) else ""
    return _str(_choice(obj).get("text"))


# ---------------------------------------------------------------------------------------
# Discovery


async def get_json(session: aiohttp.ClientSession, url: str, limit_s: float = 10.0) -> Any:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=limit_s)) as resp:
        if resp.status >= 400:
            raise TargetError(f"GET {url}: HTTP {resp.status}: {_error_message(await resp.read())}")
        try:
            return orjson.loads(await resp.read())
        except orjson.JSONDecodeError:
            raise TargetError(f"GET {url}: response is not JSON") from None


async def discover_model(session: aiohttp.ClientSession, target: Target) -> str:
    """The first model id the target's ``/v1/models`` lists (a clear TargetError otherwise)."""
    url = target.url + "/v1/models"
    try:
        data = await get_json(session, url)
    except aiohttp.ClientConnectorError as exc:
        raise TargetError(f"cannot reach {target.url}: {exc.os_error or exc}") from None
    except (TimeoutError, aiohttp.ClientError) as exc:
        raise TargetError(f"cannot reach {target.url}: {type(exc).__name__} {exc}") from None
    try:
        return str(data["data"][0]["id"])
    except (KeyError, IndexError, TypeError):
        raise TargetError(f"GET {url}: no model listed (pass --model)") from None


async def probe(session: aiohttp.ClientSession, target: Target) -> None:
    """Fail fast with a one-line TargetError when nothing answers HTTP at the URL."""
    try:
        async with session.get(
            target.url + "/v1/models", timeout=aiohttp.ClientTimeout(total=10)
        ) as resp:
            await resp.read()
    except aiohttp.ClientConnectorError as exc:
        raise TargetError(f"cannot reach {target.url}: {exc.os_error or exc}") from None
    except (TimeoutError, aiohttp.ClientError) as exc:
        raise TargetError(f"cannot reach {target.url}: {type(exc).__name__} {exc}") from None


async def warm_connections(session: aiohttp.ClientSession, target: Target, n: int) -> None:
    """Open ``n`` keep-alive connections (concurrent cheap GETs) before a level starts, so
    no measured request pays for a TCP connect. Failures are ignored: the level reports them.
    """

    async def one() -> None:
        try:
            async with session.get(
                target.url + "/v1/models", timeout=aiohttp.ClientTimeout(total=10)
            ) as resp:
                await resp.read()
        except (TimeoutError, aiohttp.ClientError):
            pass

    await asyncio.gather(*(one() for _ in range(max(n, 0))))


async def server_info(session: aiohttp.ClientSession, target: Target) -> dict[str, Any] | None:
    """``/get_server_info`` (or the newer ``/server_info``) when the target has it.

    A pipefill proxy passes that route to one of its backends, a different one from run to
    run, so its answer would misdescribe the target: a proxy (its answer names the backend that
    served it) is recorded as such, with the backends it fronts when ``/admin/backends`` is
    readable; the answering backend's own info is kept under ``backend_info``."""
    timeout = aiohttp.ClientTimeout(total=5.0)
    for path in ("/get_server_info", "/server_info"):
        try:
            async with session.get(target.url + path, timeout=timeout) as resp:
                data = orjson.loads(await resp.read())
                answered_by = resp.headers.get(SERVED_BY_HEADER)
                status = resp.status
        except (TimeoutError, aiohttp.ClientError, orjson.JSONDecodeError):
            continue
        if status >= 400:
            # a pipefill proxy without the admin key keeps this route to its admin
            if _error_code(data) in PROXY_ADMIN_CODES:
                return {"proxy": "pipefill", "fronts": await _proxy_backends(session, target)}
            continue
        if not isinstance(data, dict):
            continue
        if answered_by is None:
            return data
        info: dict[str, Any] = {
            "proxy": "pipefill",
            "answered_by": answered_by,
            "fronts": await _proxy_backends(session, target),
            "backend_info": data,
        }
        if "sim_time_scale" in data:  # the simulators behind it share the time scale
            info["sim_time_scale"] = data["sim_time_scale"]
        return info
    return None


#: error codes only a pipefill proxy answers (its admin routes without the admin key)
PROXY_ADMIN_CODES = frozenset({"admin_disabled", "invalid_admin_key"})


def _error_code(data: Any) -> str | None:
    error = data.get("error") if isinstance(data, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) else None


async def _proxy_backends(session: aiohttp.ClientSession, target: Target) -> list[str] | None:
    """What a pipefill proxy fronts, as ``name (parallelism, state)``, if it says."""
    try:
        data = await get_json(session, target.url + "/admin/backends", limit_s=5.0)
        return [
            f"{b['name']} ({b.get('parallelism') or '?'}, {b.get('state', '?')})"
            for b in data["backends"]
        ]
    except (TimeoutError, TargetError, aiohttp.ClientError, KeyError, TypeError):
        return None
