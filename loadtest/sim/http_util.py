"""Small HTTP helpers shared by the simulator's route modules: JSON, SSE and error bodies."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

import orjson
from aiohttp import web

# the app's SimBackend (typed loosely to keep this module free of server imports)
BACKEND: web.AppKey[Any] = web.AppKey("backend", object)

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
DONE_EVENT = b"data: [DONE]\n\n"


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(
        body=orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS),
        status=status,
        content_type="application/json",
    )


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS) + b"\n\n"


def openai_error_body(message: str, err_type: str, code: int, param: str | None = None) -> dict:
    """SGLang's ``ErrorResponse``: top-level, not nested under "error"."""
    return {"object": "error", "message": message, "type": err_type, "param": param, "code": code}


def openai_error(
    message: str, err_type: str = "BadRequestError", status: int = 400, param: str | None = None
) -> web.Response:
    return json_response(openai_error_body(message, err_type, status, param), status)


def http_exception(status: int, detail: str) -> web.Response:
    """What SGLang's global ``HTTPException`` handler renders (type = status as a string)."""
    return json_response(openai_error_body(detail, str(status), status), status)


def validation_error(errors: list[dict]) -> web.Response:
    """FastAPI's request-validation error, which SGLang turns into 400 (not 422)."""
    message = str(errors)
    return json_response(openai_error_body(message, HTTPStatus.BAD_REQUEST.phrase, 400), 400)


def generate_error(message: str, status: int = 400) -> web.Response:
    """Native ``/generate`` errors: ``{"error": {"message": ...}}``."""
    return json_response({"error": {"message": message}}, status)


def status_name(code: int) -> str:
    try:
        return HTTPStatus(code).name
    except ValueError:
        return str(code)


async def read_json(request: web.Request) -> tuple[Any, web.Response | None]:
    """The parsed body, or a 400 validation response for a body that is not JSON."""
    raw = await request.read()
    try:
        return orjson.loads(raw), None
    except orjson.JSONDecodeError as exc:
        return None, validation_error(
            [
                {
                    "type": "json_invalid",
                    "loc": ["body", exc.pos],
                    "msg": "JSON decode error",
                    "input": {},
                    "ctx": {"error": exc.msg},
                }
            ]
        )


CONTENT_TYPE_METRICS = "text/plain; version=0.0.4; charset=utf-8"
