"""OpenAI-shaped error bodies: ``{"error": {"message", "type", "code"}}``.

Every error the proxy itself produces goes through here, as a JSON response before any byte
was sent, or as a final SSE event (followed by ``[DONE]``) once a stream has started.
Errors that come from a backend are passed through unchanged instead.
"""

from __future__ import annotations

from collections.abc import Mapping

import orjson
from aiohttp import web

JSON = "application/json"

# OpenAI's error types by HTTP status; anything else is "server_error".
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
}


def error_type(status: int) -> str:
    return _TYPES.get(status, "server_error")


def error_object(message: str, *, status: int, code: str, type_: str | None = None) -> dict:
    return {"message": message, "type": type_ or error_type(status), "code": code}


def error_body(message: str, *, status: int, code: str, type_: str | None = None) -> bytes:
    return orjson.dumps({"error": error_object(message, status=status, code=code, type_=type_)})


def error_response(
    status: int,
    message: str,
    code: str,
    *,
    type_: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> web.Response:
    """A complete JSON error response (nothing of the request was forwarded, or nothing sent)."""
    return web.Response(
        status=status,
        body=error_body(message, status=status, code=code, type_=type_),
        content_type=JSON,
        headers=headers,
    )


def sse_error(message: str, *, status: int, code: str, type_: str | None = None) -> bytes:
    """The closing bytes of a stream that failed after it started: an error event, then DONE."""
    body = error_body(message, status=status, code=code, type_=type_)
    return b"data: " + body + b"\n\ndata: [DONE]\n\n"


def ndjson_error(message: str, *, status: int, code: str, type_: str | None = None) -> bytes:
    """The closing line of a newline-delimited JSON stream (the Ollama routes) that failed after
    it started: the error object on a line of its own, which an Ollama client reports."""
    return error_body(message, status=status, code=code, type_=type_) + b"\n"
