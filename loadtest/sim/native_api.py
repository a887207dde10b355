"""SGLang's native routes: ``/generate``, health, info, load, abort, flush and ``/metrics``.

``/generate`` takes ``text`` or ``input_ids`` (one prompt or a list), ``sampling_params``
(one dict, or one per prompt) and ``stream``. A list answers a JSON array in input order;
streamed, the items' chunks interleave, each with ``"index"``. Chunks are cumulative as in
SGLang's default (no ``--incremental-streaming-output``): the text and ``output_ids`` so
far, and the full ``meta_info`` with ``completion_tokens`` so far.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from aiohttp import web

from loadtest.sim import tokens
from loadtest.sim.engine import GenRequest
from loadtest.sim.generation import Generation, RequestError, Step, parse_stop, validate_lengths
from loadtest.sim.http_util import (
    BACKEND,
    CONTENT_TYPE_METRICS,
    DONE_EVENT,
    generate_error,
    http_exception,
    json_response,
    read_json,
    sse,
)
from loadtest.sim.prom import stat
from loadtest.sim.streaming import StreamWriter

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's SamplingParams default
HEALTH_TIMEOUT_S = 20.0  # SGLANG_HEALTH_CHECK_TIMEOUT
FLUSH_MESSAGE = (
    "Cache flushed.\nPlease check backend logs for more details. (When there are running or "
    "waiting requests, the operation will not be performed.)\n"
)


def add_routes(app: web.Application) -> None:
    r = app.router
    for method in ("POST", "PUT"):
        r.add_route(method, "/generate", generate)
    r.add_get("/health", health)
    r.add_get("/health_generate", health_generate)
    r.add_get("/ping", ping)
    r.add_get("/get_model_info", model_info)
    r.add_get("/model_info", model_info)
    r.add_post("/abort_request", abort_request)
    r.add_route("GET", "/flush_cache", flush_cache)
    r.add_route("POST", "/flush_cache", flush_cache)
    if app[BACKEND].inference_only:
        return  # what it says of itself, its load and its metrics: not served (404)
    r.add_get("/get_server_info", server_info)
    r.add_get("/server_info", server_info)
    r.add_get("/get_load", get_load)
    r.add_get("/v1/loads", v1_loads)
    r.add_get("/metrics", metrics)


# ---- /generate ---------------------------------------------------------------------------


def _prompts(body: dict) -> tuple[list[tuple[int, ...]], bool]:
    """Prompt token ids, and whether the request was a single prompt."""
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise RequestError("Either text, input_ids or input_embeds should be provided.")
    if text is not None:
        if isinstance(text, str):
            return [tuple(tokens.prompt_token_ids(text))], True
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return [tuple(tokens.prompt_token_ids(t)) for t in text], False
        raise RequestError("text must be a string or a non-empty list of strings.")
    if isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids):
        return [tuple(ids)], True
    if (
        isinstance(ids, list)
        and ids
        and all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in ids)
    ):
        return [tuple(p) for p in ids], False
    raise RequestError("input_ids must be a non-empty list of ints or a list of such lists.")


def _int_or_none(params: dict, key: str) -> int | None:
    value = params.get(key)
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise RequestError(f"{key} must be an integer, got {value!r}.")


def _gens(request: web.Request, body: dict) -> tuple[list[Generation], bool]:
    backend = request.app[BACKEND]
    prompts, single = _prompts(body)
    counts = [len(ids) for ids in prompts]
    params = body.get("sampling_params") or {}
    plist = params if isinstance(params, list) else [params] * len(counts)
    if len(plist) != len(counts) or not all(isinstance(p, dict) for p in plist):
        raise RequestError("sampling_params must be a dict or a list of dicts, one per prompt.")
    rid = body.get("rid")
    if rid is None:
        rids = [backend.new_rid() for _ in counts]
    elif isinstance(rid, str):
        rids = [rid] if single else [f"{rid}_{i}" for i in range(len(counts))]
    elif isinstance(rid, list) and len(rid) == len(counts):
        rids = [str(r) for r in rid]
    else:
        raise RequestError("The rid should be a string or a list of strings of the batch size.")
    if len(set(rids)) != len(rids):
        raise RequestError("Duplicate request ids in the batch.")
    gens = []
    for ids, p, r in zip(prompts, plist, rids, strict=True):
        n = len(ids)
        max_new = _int_or_none(p, "max_new_tokens")
        validate_lengths(n, max_new, backend.profile.context_length)
        gens.append(
            Generation(
                backend,
                route="generate",
                rid=r,
                prompt_tokens=n,
                prompt_ids=ids,
                max_new_tokens=DEFAULT_MAX_NEW_TOKENS if max_new is None else max_new,
                ignore_eos=bool(p.get("ignore_eos", False)),
                stop=parse_stop(p.get("stop")),
            )
        )
    return gens, single


def meta_info(gen: Generation) -> dict:
    meta: dict[str, Any] = {
        "id": gen.rid,
        "finish_reason": gen.finish,
        "prompt_tokens": gen.prompt_tokens,
        "weight_version": "default",
        "num_retractions": gen.num_retractions,
        "reasoning_tokens": 0,
        "completion_tokens": gen.completion_tokens,
        "cached_tokens": gen.cached_tokens,
        "cached_tokens_details": None,
        "dp_rank": None,
    }
    if gen.finish is not None:
        meta["e2e_latency"] = (time.monotonic() - gen.arrival) / gen.backend.time_scale
    meta["response_sent_to_client_ts"] = time.time()
    return meta


def _output(gen: Generation) -> dict:
    return {"text": gen.text, "output_ids": list(gen.output_ids), "meta_info": meta_info(gen)}


class GenerateStream:
    """Cumulative ``/generate`` chunks; a batch's chunks carry ``"index"``."""

    headers_first = True

    def __init__(self, gens: list[Generation], single: bool) -> None:
        self.gens, self.single = gens, single

    def opening(self) -> list[bytes]:
        return []

    def content(self, step: Step, usage: dict | None, index: int = 0) -> bytes | None:
        if not step.token_ids and step.finish is None:
            return None
        out = _output(self.gens[index])
        if not self.single:
            out["index"] = index
        return sse(out)

    def closing(self, include_usage: bool) -> list[bytes]:
        return [DONE_EVENT]

    def reject(self, finish: dict) -> web.Response:
        return _reject(finish)


def _reject(finish: dict) -> web.Response:
    code = int(finish["status_code"])
    message = finish.get("message") or "Abort"
    return generate_error(message, 400) if code == 400 else http_exception(code, message)


async def generate(request: web.Request) -> web.StreamResponse:
    body, err = await read_json(request)
    if err is not None:
        return err
    if not isinstance(body, dict):
        return generate_error("The request body must be a JSON object.")
    backend = request.app[BACKEND]
    try:
        gens, single = _gens(request, body)
    except RequestError as exc:
        return generate_error(str(exc))
    stream = bool(body.get("stream", False))
    decision = backend.faults.decide(stream)
    if decision.fate == "error":
        return generate_error("Injected fault: server error", decision.status)
    try:
        try:
            for g in gens:
                g.submit()
        except RequestError as exc:
            return generate_error(str(exc))
        if stream:
            return await StreamWriter(request, gens, decision).run(GenerateStream(gens, single))
        await asyncio.gather(*(g.run_to_end() for g in gens))
        for g in gens:
            f = g.finish or {}
            if f.get("type") == "abort" and f.get("status_code"):
                return _reject(f)
            g.mark_write(g.completion_tokens)
        outs = [_output(g) for g in gens]
        return json_response(outs[0] if single else outs)
    finally:
        for g in gens:
            g.close()


# ---- health and info ---------------------------------------------------------------------


async def _health_gate(backend) -> bool:
    backend.health_checks += 1
    faults = backend.faults.config
    if faults.health_delay_s:
        await asyncio.sleep(faults.health_delay_s)
    return backend.ready and not faults.health_fail


async def health(request: web.Request) -> web.Response:
    ok = await _health_gate(request.app[BACKEND])
    return web.Response(status=200 if ok else 503)


async def health_generate(request: web.Request) -> web.Response:
    """Like SGLang's: runs a one-token generation through the engine (20 s timeout)."""
    backend = request.app[BACKEND]
    if not await _health_gate(backend):
        return web.Response(status=503)
    rid = f"HEALTH_CHECK_{time.time()}_{backend.new_rid()[:8]}"
    stream = backend.engine.submit(
        GenRequest(rid=rid, prompt_tokens=1, max_new_tokens=1, ignore_eos=True)
    )
    done = False
    try:
        async with asyncio.timeout(HEALTH_TIMEOUT_S):
            async for event in stream:
                if event.finish is not None or event.token_ids:
                    done = True
                    break
    except TimeoutError:
        pass
    finally:
        with contextlib.suppress(Exception):
            backend.engine.abort(rid)
    return web.Response(status=200 if done else 503)


async def ping(request: web.Request) -> web.Response:
    return web.Response(status=200)


def _model_info(backend) -> dict:
    p = backend.profile
    return {
        "model_path": p.model_name,
        "tokenizer_path": p.model_name,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": getattr(p, "model_type", None) or "kimi_k2",
        "architectures": getattr(p, "architectures", None) or ["DeepseekV3ForCausalLM"],
    }


async def model_info(request: web.Request) -> web.Response:
    return json_response(_model_info(request.app[BACKEND]))


def server_args(backend) -> dict:
    p = backend.profile
    return {
        "model_path": p.model_name,
        "tokenizer_path": p.model_name,
        "served_model_name": p.model_name,
        "host": backend.host,
        "port": backend.port,
        "tp_size": p.tp_size,
        "pp_size": p.pp_size,
        "ep_size": p.ep_size,
        "dp_size": p.dp_size,
        "context_length": p.context_length,
        # the argument as given: null when the operator left it to the scheduler
        "max_running_requests": p.max_running_requests if backend.max_running_arg else None,
        "max_total_tokens": p.max_total_tokens,
        "decode_log_interval": p.decode_log_interval,
        "stream_interval": 1,
        "enable_metrics": backend.enable_metrics,
        "enable_dp_attention": p.dp_size > 1,
        "incremental_streaming_output": False,
        "skip_server_warmup": False,
        "pp_async_batch_depth": 0,
        "enable_http2": False,
        "random_seed": backend.seed,
        "sim_profile": p.name,
        "sim_time_scale": backend.time_scale,
    }


async def server_info(request: web.Request) -> web.Response:
    backend = request.app[BACKEND]
    p = backend.profile
    logged = backend.engine.logged_stats()
    info = {
        **server_args(backend),
        "max_total_num_tokens": p.max_total_tokens,
        "max_req_input_len": p.context_length - 1,
        "internal_states": [  # one per DP rank
            {
                "dp_rank": rank,
                "last_gen_throughput": float(stat(logged, "gen_throughput")) / p.dp_size,
                "avg_spec_accept_length": None,
                "memory_usage": {},
            }
            for rank in range(p.dp_size)
        ],
        "version": backend.version,
    }
    return json_response(info)


async def get_load(request: web.Request) -> web.Response:
    """One entry per DP rank, from the engine's true current state."""
    rows = request.app[BACKEND].engine.get_load()
    tic = time.perf_counter()
    return json_response([{**row, "ts_tic": tic} for row in rows])


def _split(total: int, parts: int, rank: int) -> int:
    return total // parts + (rank < total % parts)


async def v1_loads(request: web.Request) -> web.Response:
    """Newer SGLang's snapshot load report (``?format=prometheus`` for gauges)."""
    backend = request.app[BACKEND]
    p = backend.profile
    live = backend.engine.live_stats()
    dp = p.dp_size
    loads = []
    for rank in range(dp):
        used = _split(int(stat(live, "num_used_tokens")), dp, rank)
        total = _split(p.max_total_tokens, dp, rank)
        loads.append(
            {
                "dp_rank": rank,
                "num_running_reqs": _split(int(stat(live, "num_running_reqs")), dp, rank),
                "num_waiting_reqs": _split(int(stat(live, "num_queue_reqs")), dp, rank),
                "num_used_tokens": used,
                "num_total_tokens": total,
                "max_total_num_tokens": total,
                "max_running_requests": _split(p.max_running_requests, dp, rank),
                "token_usage": used / total if total else 0.0,
                "gen_throughput": float(stat(live, "gen_throughput")) / dp,
                "cache_hit_rate": 0.0,
                "utilization": 0.0,
            }
        )
    if request.query.get("format") == "prometheus":
        lines = [
            f'sglang_{key}{{dp_rank="{row["dp_rank"]}"}} {float(value)}'
            for row in loads
            for key, value in row.items()
            if key != "dp_rank"
        ]
        return web.Response(
            text="\n".join(lines) + "\n", headers={"Content-Type": CONTENT_TYPE_METRICS}
        )
    return json_response(
        {
            "timestamp": time.time(),
            "version": backend.version,
            "accelerator": "simulated",
            "num_accelerators": p.tp_size * p.pp_size,
            "loads": loads,
        }
    )


async def abort_request(request: web.Request) -> web.Response:
    body, err = await read_json(request)
    if err is not None:
        return err
    body = body if isinstance(body, dict) else {}
    engine = request.app[BACKEND].engine
    if body.get("abort_all"):
        engine.abort_all()
    elif body.get("rid"):
        engine.abort(str(body["rid"]))
    return web.Response(status=200)


async def flush_cache(request: web.Request) -> web.Response:
    flushed = request.app[BACKEND].engine.flush_cache()
    return web.Response(text=FLUSH_MESSAGE, status=200 if flushed else 400)


async def metrics(request: web.Request) -> web.Response:
    if not request.app[BACKEND].enable_metrics:
        raise web.HTTPNotFound()  # SGLang serves no /metrics without --enable-metrics
    body = request.app[BACKEND].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_METRICS})
