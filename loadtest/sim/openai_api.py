"""``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models`` in SGLang's shapes.

Streaming follows SGLang's serving_chat/serving_completions: HTTP 200 goes out only with
the first chunk (so validation and context-length errors are still a 400 JSON body);
chat sends a role chunk, content deltas, a separate finish chunk (empty delta,
``finish_reason``, ``matched_stop``), then with ``include_usage`` a usage chunk with
``"choices": []``, then ``[DONE]``; completions put the finish reason on the last content
chunk. ``continuous_usage_stats`` adds usage to every content chunk. An error after the
stream began is ``data: {"error": {...}}`` then ``[DONE]``.
"""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, ValidationError

from loadtest.sim import tokens
from loadtest.sim.generation import Generation, RequestError, Step, parse_stop, validate_lengths
from loadtest.sim.http_util import (
    BACKEND,
    DONE_EVENT,
    http_exception,
    json_response,
    openai_error,
    openai_error_body,
    read_json,
    sse,
    status_name,
    validation_error,
)
from loadtest.sim.streaming import StreamWriter


class StreamOptions(BaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    stop: str | list[str] | None = None
    n: int = 1
    temperature: float | None = None
    rid: str | None = None


class ChatCompletionRequest(_Common):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model:.+}", model_card)


def _card(backend) -> dict:
    name = backend.model_name
    return {
        "id": name,
        "object": "model",
        "created": backend.created,
        "owned_by": "sglang",
        "root": name,
        "parent": None,
        "max_model_len": backend.profile.context_length,
    }


async def models(request: web.Request) -> web.Response:
    return json_response({"object": "list", "data": [_card(request.app[BACKEND])]})


async def model_card(request: web.Request) -> web.Response:
    backend = request.app[BACKEND]
    name = request.match_info["model"]
    if name != backend.model_name:
        return json_response(
            {
                "error": {
                    "message": f"The model '{name}' does not exist",
                    "type": "invalid_request_error",
                    "param": "model",
                    "code": "model_not_found",
                }
            },
            404,
        )
    return json_response(_card(backend))


async def _parse(request: web.Request, model: type[BaseModel]):
    ctype = request.headers.get("Content-Type", "").split(";", 1)[0].strip().lower()
    if ctype != "application/json":
        return None, validation_error(
            [
                {
                    "loc": ["header", "content-type"],
                    "msg": "Unsupported Media Type: Only 'application/json' is allowed",
                    "type": "value_error",
                }
            ]
        )
    body, err = await read_json(request)
    if err is not None:
        return None, err
    try:
        return model.model_validate(body), None
    except ValidationError as exc:
        errors = [
            {"type": e["type"], "loc": ["body", *e["loc"]], "msg": e["msg"]} for e in exc.errors()
        ]
        return None, validation_error(errors)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    req, err = await _parse(request, ChatCompletionRequest)
    if err is not None:
        return err
    backend = request.app[BACKEND]
    ids = tuple(tokens.chat_prompt_ids(req.messages))
    return await _serve(request, backend, "chat", req, ids, req.max_completion_tokens)


async def completions(request: web.Request) -> web.StreamResponse:
    req, err = await _parse(request, CompletionRequest)
    if err is not None:
        return err
    backend = request.app[BACKEND]
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            return openai_error("The simulator serves one prompt per /v1/completions request.")
        prompt = prompt[0]
    ids = tuple(tokens.prompt_token_ids(prompt) if isinstance(prompt, str) else prompt)
    return await _serve(request, backend, "completions", req, ids, None)


async def _serve(
    request: web.Request,
    backend,
    api: str,
    req: _Common,
    prompt_ids: tuple[int, ...],
    alt_max: int | None,
) -> web.StreamResponse:
    prompt_tokens = len(prompt_ids)
    max_tokens = req.max_tokens if req.max_tokens is not None else alt_max
    context = backend.profile.context_length
    try:
        if req.n != 1:
            raise RequestError("The simulator supports only n=1.")
        stop = parse_stop(req.stop)
        validate_lengths(prompt_tokens, max_tokens, context)
    except RequestError as exc:
        return openai_error(str(exc))
    decision = backend.faults.decide(req.stream)
    if decision.fate == "error":
        return openai_error("Injected fault: server error", status_name(decision.status),
                            decision.status)  # fmt: skip
    gen = Generation(
        backend,
        route=api,
        rid=req.rid or f"{'chatcmpl' if api == 'chat' else 'cmpl'}-{backend.new_rid()}",
        prompt_tokens=prompt_tokens,
        prompt_ids=prompt_ids,
        max_new_tokens=max_tokens if max_tokens is not None else context - prompt_tokens,
        ignore_eos=req.ignore_eos,
        stop=stop,
    )
    model = req.model or backend.model_name
    try:
        try:
            gen.submit()
        except RequestError as exc:
            return openai_error(str(exc))
        if req.stream:
            opts = req.stream_options or StreamOptions()
            shaper = ChatStream(gen, model) if api == "chat" else CompletionStream(gen, model)
            return await StreamWriter(request, gen, decision).run(
                shaper, bool(opts.include_usage), bool(opts.continuous_usage_stats)
            )
        await gen.run_to_end()
        finish = gen.finish or {}
        if finish.get("type") == "abort" and finish.get("status_code"):
            return _reject(finish)
        gen.mark_write(gen.completion_tokens)
        body = _chat_response(gen, model) if api == "chat" else _completion_response(gen, model)
        return json_response(body)
    finally:
        gen.close()


def _usage(gen: Generation, exclude_none: bool = False) -> dict:
    u = {
        "prompt_tokens": gen.prompt_tokens,
        "total_tokens": gen.prompt_tokens + gen.completion_tokens,
        "completion_tokens": gen.completion_tokens,
        "prompt_tokens_details": gen.prompt_tokens_details(),
        "reasoning_tokens": 0,
    }
    if exclude_none and u["prompt_tokens_details"] is None:
        del u["prompt_tokens_details"]
    return u


def _finish_fields(finish: dict | None) -> tuple[str | None, Any]:
    if not finish:
        return None, None
    return finish["type"], finish.get("matched")


def _chat_response(gen: Generation, model: str) -> dict:
    reason, matched = _finish_fields(gen.finish)
    return {
        "id": gen.rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": gen.text,
                    "reasoning_content": None,
                    "tool_calls": None,
                },
                "logprobs": None,
                "finish_reason": reason,
                "matched_stop": matched,
            }
        ],
        "usage": _usage(gen),
        "metadata": {"weight_version": "default"},
    }


def _completion_response(gen: Generation, model: str) -> dict:
    reason, matched = _finish_fields(gen.finish)
    return {
        "id": gen.rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "text": gen.text,
                "logprobs": None,
                "finish_reason": reason,
                "matched_stop": matched,
            }
        ],
        "usage": _usage(gen),
        "metadata": {"weight_version": "default"},
    }


def _reject(finish: dict) -> web.Response:
    code = int(finish["status_code"])
    message = finish.get("message") or "Abort"
    if code == 400:
        return openai_error(message)
    return http_exception(code, message)


def _stream_error(finish: dict) -> bytes:
    code = int(finish["status_code"])
    body = openai_error_body(
        finish.get("message") or "Generation aborted.", status_name(code), code
    )
    return sse({"error": body})


class ChatStream:
    """Event shapes of a chat completion stream (one choice)."""

    headers_first = False

    def __init__(self, gen: Generation, model: str) -> None:
        self.gen, self.model = gen, model
        self.created = int(time.time())

    def _chunk(self, delta: dict, finish: str | None = None, matched: Any = None) -> dict:
        return {
            "id": self.gen.rid,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": 0,
                    "delta": {"reasoning_content": None, **delta},
                    "logprobs": None,
                    "finish_reason": finish,
                    "matched_stop": matched,
                }
            ],
        }

    def opening(self) -> list[bytes]:
        return [sse(self._chunk({"role": "assistant", "content": ""}))]

    def reject(self, finish: dict) -> web.Response:
        return _reject(finish)

    def content(self, step: Step, usage: dict | None, index: int = 0) -> bytes | None:
        if not step.text and not step.token_ids:
            return None
        chunk = self._chunk({"content": step.text})
        if usage is not None:
            chunk["usage"] = usage
        return sse(chunk)

    def closing(self, include_usage: bool) -> list[bytes]:
        finish = self.gen.finish or {}
        out = []
        if finish.get("type") == "abort" and finish.get("status_code"):
            out.append(_stream_error(finish))
        else:
            reason, matched = _finish_fields(finish)
            out.append(sse(self._chunk({}, reason, matched)))
        if include_usage:
            out.append(sse(self.usage_chunk()))
        out.append(DONE_EVENT)
        return out

    def usage_chunk(self) -> dict:
        return {
            "id": self.gen.rid,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": _usage(self.gen),
        }


class CompletionStream:
    """Event shapes of a text completion stream (finish reason on the last content chunk)."""

    headers_first = False

    def __init__(self, gen: Generation, model: str) -> None:
        self.gen, self.model = gen, model
        self.created = int(time.time())

    def _chunk(self, text: str, finish: str | None, matched: Any, usage: dict | None) -> dict:
        return {
            "id": self.gen.rid,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": 0,
                    "text": text,
                    "logprobs": None,
                    "finish_reason": finish,
                    "matched_stop": matched,
                }
            ],
            "usage": usage,
        }

    def opening(self) -> list[bytes]:
        return []

    def reject(self, finish: dict) -> web.Response:
        return _reject(finish)

    def content(self, step: Step, usage: dict | None, index: int = 0) -> bytes | None:
        finish = step.finish
        if finish and finish.get("type") == "abort" and finish.get("status_code"):
            return None  # rendered as an error event by closing()
        reason, matched = _finish_fields(finish)
        if not step.text and not step.token_ids and reason is None:
            return None
        return sse(self._chunk(step.text, reason, matched, usage))

    def closing(self, include_usage: bool) -> list[bytes]:
        finish = self.gen.finish or {}
        out = []
        if finish.get("type") == "abort" and finish.get("status_code"):
            out.append(_stream_error(finish))
        if include_usage:
            out.append(
                sse(
                    {
                        "id": self.gen.rid,
                        "object": "text_completion",
                        "created": self.created,
                        "model": self.model,
                        "choices": [],
                        "usage": _usage(self.gen, exclude_none=True),
                    }
                )
            )
        out.append(DONE_EVENT)
        return out
