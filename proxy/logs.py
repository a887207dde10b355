"""Logging set-up: plain text for a terminal or journald, one JSON object per line for a log
pipeline (``--log-format json``), and the optional access log.

Operational events are logged with structured fields passed as ``extra`` (``event``,
``request_id``, ``backend``, ...): the text format shows them in its message, the JSON format
adds each as a key, and tests read them from the records. ``event`` names the kind of line
(``access``, ``admin``, ``retry``, ``ejection``, ``stream_failure``, ``reload``) so that a pipeline
can filter on it.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, Literal

import orjson
from aiohttp import web

LogFormat = Literal["text", "json"]

#: the access log's logger: one line per request (``server.access_log``)
ACCESS = logging.getLogger("pipefill.access")
#: operations: admin actions, retries, ejections, mid-stream failures, reloads
OPS = logging.getLogger("pipefill.ops")


class Outcome:
    """What the access log says of a request beyond its response: filled in by forwarding
    (proxy/forward.py) when the app asks for it (``request[OUTCOME]``, set only with
    ``server.access_log`` on)."""

    __slots__ = ("backend", "tokens", "ttft")

    def __init__(self) -> None:
        self.backend: str | None = None  # the last backend tried
        self.ttft: float | None = None  # sent upstream -> first token (as pipefill_ttft_seconds)
        self.tokens: int | None = None  # output tokens relayed


OUTCOME = web.RequestKey("pipefill_outcome", Outcome)

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

#: attributes every LogRecord has; anything else on a record came from ``extra``
_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {
    "message",
    "asctime",
    "taskName",
}


def fields(record: logging.LogRecord) -> dict[str, Any]:
    """The structured fields a record carries (what was passed as ``extra``)."""
    return {k: v for k, v in record.__dict__.items() if k not in _STANDARD}


class JSONFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, ISO 8601), level, logger, message, then the
    record's structured fields; an exception as ``exc``."""

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        out: dict[str, Any] = {
            "ts": f"{ts}.{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        out.update(fields(record))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(out, default=str).decode()


def configure(level: str, fmt: LogFormat = "text") -> None:
    """The root logger's one handler (stderr) in ``fmt``, at ``level``. The access log is
    written at INFO whatever the level (the proxy writes it only with ``server.access_log``)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JSONFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    set_level(level)
    ACCESS.setLevel(logging.INFO)


def set_level(level: str) -> None:
    logging.getLogger().setLevel(level.upper())
