"""Server-sent events as SGLang sends them: framing and token accounting.

Shared by the proxy (which peeks at events it forwards untouched) and the load generator
(which times them). SGLang frames every event as ``data: <json>\\n\\n`` and ends a stream
with ``data: [DONE]``; it sends no ``event:``/``id:`` lines and no keep-alive comments.

What counts as a generated token follows DESIGN.md: a chat role-only chunk, the separate
finish chunk and the usage chunk (``"choices": []``) carry none. When a chunk says how many
tokens it carries (``/generate``'s cumulative ``meta_info.completion_tokens``, or OpenAI
``usage`` on every chunk with ``stream_options.continuous_usage_stats``) that count is used;
otherwise a content chunk counts as one token and the final usage reconciles the total.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import orjson

Api = Literal["chat", "completions", "generate"]

DONE = b"[DONE]"


#: what :meth:`SSEFramer.feed` yields in place of an event larger than its bound (no JSON reader
#: accepts it: TokenCounter counts it as malformed)
OVERSIZED = b""


class SSEFramer:
    """Splits a byte stream into the ``data`` payloads of complete events.

    Chunk boundaries may fall anywhere, including inside ``\\r\\n``. Multi-line ``data:``
    fields are joined with ``\\n`` as the SSE spec says; comment lines are skipped. A chunk is
    searched for event ends only from where the unterminated rest of the last one ended, and
    only a new chunk is searched for ``\\r``. With ``max_event``, an event longer than that
    many bytes is not kept: ``feed`` yields :data:`OVERSIZED` once in its place and skips to
    its end, so the buffer never holds more than ``max_event`` bytes plus one chunk.
    """

    __slots__ = ("_buf", "_cr", "_max", "_skipping", "oversized")

    def __init__(self, max_event: int | None = None) -> None:
        # the unterminated rest (a bytearray, grown in place), \r\n and \r already \n
        self._buf: bytes | bytearray = b""
        self._cr = False  # the last chunk ended in \r: its \n may open the next one
        self._max = max_event
        self._skipping = False  # inside an oversized event, until its end
        self.oversized = 0

    def feed(self, chunk: bytes) -> list[bytes]:
        if not self._buf and not self._cr and not self._skipping and b"\r" not in chunk:
            # the usual chunk: exactly one whole event
            end = chunk.find(b"\n\n")
            if end >= 0 and end + 2 == len(chunk) and (self._max is None or end <= self._max):
                payload = _data_of(chunk[:end])
                return [] if payload is None else [payload]
        if self._cr:
            chunk = b"\r" + chunk
            self._cr = False
        if b"\r" in chunk:
            if chunk.endswith(b"\r"):
                self._cr = True
                chunk = chunk[:-1]
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        rest = self._buf
        if rest:
            # the rest held no "\n\n": only its last byte can start one
            scan = len(rest) - 1
            rest += chunk  # type: ignore[operator]  # a bytearray: in place
            buf: bytes | bytearray = rest
        else:
            scan = 0
            buf = chunk
        events: list[bytes] = []
        start = 0
        if self._skipping:
            end = buf.find(b"\n\n", scan)
            if end < 0:
                self._buf = bytearray(buf[-1:])
                return events
            self._skipping = False
            start = scan = end + 2
        limit = self._max
        while True:
            end = buf.find(b"\n\n", scan)
            if end < 0:
                break
            if limit is not None and end - start > limit:
                self.oversized += 1
                events.append(OVERSIZED)
            else:
                payload = _data_of(bytes(buf[start:end]) if buf is rest else buf[start:end])
                if payload is not None:
                    events.append(payload)
            start = scan = end + 2
        left = len(buf) - start
        if limit is not None and left > limit + 1:  # (+1: a first "\n" of its end)
            self.oversized += 1
            events.append(OVERSIZED)
            self._skipping = True
            self._buf = bytearray(buf[-1:])
        elif not left:
            self._buf = b""
        elif buf is rest:
            del rest[:start]  # type: ignore[union-attr]
        else:
            self._buf = bytearray(buf[start:])
        return events

    @property
    def pending(self) -> bytes:
        """Bytes of an event not yet terminated (a stream that ends here was cut short); for an
        oversized event being skipped, only its last byte."""
        return bytes(self._buf) + b"\r" if self._cr else bytes(self._buf)


def _data_of(block: bytes) -> bytes | None:
    if block.startswith(b"data:") and b"\n" not in block:
        value = block[5:]
        return value[1:] if value.startswith(b" ") else value
    lines = [
        line[5:].removeprefix(b" ") for line in block.split(b"\n") if line.startswith(b"data:")
    ]
    return b"\n".join(lines) if lines else None


@dataclass(slots=True)
class TokenCounter:
    """Accounts for the tokens of one streamed response, event by event.

    ``observe(payload)`` returns how many newly generated tokens that event carries (0 for
    role-only, finish-only, usage-only and error events). After the stream: ``completion_tokens``
    and ``prompt_tokens`` are the server's own counts when it sent them (usage, or the last
    ``meta_info``), ``chunk_tokens`` is what the events added up to, ``error`` holds an in-stream
    error object and ``done`` tells whether ``[DONE]`` arrived.

    An event of a shape SGLang does not send (``{"choices": 5}``, a ``delta`` that is not an
    object, a ``/generate`` ``index`` that is not an integer, ...) counts in ``malformed`` and
    carries no token; it never raises.
    """

    api: Api
    chunk_tokens: int = 0
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    error: dict | None = None
    done: bool = False
    events: int = 0
    malformed: int = 0
    _per_index: dict[int, int] = field(default_factory=dict)

    def observe(self, payload: bytes) -> int:
        self.events += 1
        if not payload:  # OVERSIZED, or an empty data field: nothing SGLang sends
            self.malformed += 1
            return 0
        if payload == DONE:
            self.done = True
            return 0
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            self.malformed += 1
            return 0
        if not isinstance(obj, dict):
            self.malformed += 1
            return 0
        if "error" in obj and "choices" not in obj and "meta_info" not in obj:
            err = obj["error"]
            self.error = err if isinstance(err, dict) else {"message": str(err)}
            return 0
        if self.api == "generate":
            return self._observe_generate(obj)
        return self._observe_openai(obj)

    def _observe_generate(self, obj: dict) -> int:
        meta = obj.get("meta_info") or {}
        index = obj.get("index", 0)
        if not isinstance(meta, dict) or not isinstance(index, int):
            self.malformed += 1
            return 0
        total = meta.get("completion_tokens")
        if isinstance(meta.get("prompt_tokens"), int):
            self.prompt_tokens = meta["prompt_tokens"]
        finish = meta.get("finish_reason")
        if isinstance(finish, dict):
            self.finish_reason = finish.get("type")
        if not isinstance(total, int):
            return 0
        new = max(total - self._per_index.get(index, 0), 0)
        self._per_index[index] = max(total, self._per_index.get(index, 0))
        self.completion_tokens = sum(self._per_index.values())
        self.chunk_tokens += new
        return new

    def _observe_openai(self, obj: dict) -> int:
        choices = obj.get("choices") or []
        if not isinstance(choices, list):
            self.malformed += 1
            return 0
        carries = False
        for choice in choices:
            if not isinstance(choice, dict):
                self.malformed += 1
                return 0
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
            if self.api == "chat":
                delta = choice.get("delta") or {}
                if not isinstance(delta, dict):
                    self.malformed += 1
                    return 0
                if (
                    delta.get("content")
                    or delta.get("reasoning_content")
                    or delta.get("tool_calls")
                ):
                    carries = True
            elif choice.get("text"):
                carries = True
        usage = obj.get("usage")
        new = 0
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            if isinstance(usage.get("prompt_tokens"), int):
                self.prompt_tokens = usage["prompt_tokens"]
            previous = self.completion_tokens or 0
            self.completion_tokens = usage["completion_tokens"]
            if carries:  # continuous usage: the chunk says exactly how many it carries
                new = max(self.completion_tokens - previous, 1)
        elif carries:
            new = 1
        self.chunk_tokens += new
        return new
