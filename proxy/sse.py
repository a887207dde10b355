"""Streams as SGLang sends them: framing and token accounting.

Shared by the proxy (which peeks at events it forwards untouched) and the load generator
(which times them). SGLang frames every OpenAI and native event as ``data: <json>\\n\\n`` and
ends such a stream with ``data: [DONE]``; ``/v1/messages`` (Anthropic) and ``/v1/responses``
add an ``event: <type>`` line to each event (the JSON's ``type`` says the same); the Ollama
routes (``/api/chat``, ``/api/generate``) stream newline-delimited JSON instead (one object a
line, the last one ``"done": true``), which :class:`LineFramer` splits.

Token-carrying events per API: OpenAI chat/completions content chunks; ``/generate``'s
cumulative ``meta_info.completion_tokens``; Anthropic ``content_block_delta``; Responses
``response.*.delta`` events; Ollama lines with ``done: false`` and text. The final count is the
server's own where the stream says it (OpenAI ``usage``, Anthropic ``message_delta.usage``,
Responses ``response.completed``'s ``response.usage``, Ollama's ``eval_count``).

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

Api = Literal[
    "chat", "completions", "generate", "messages", "responses", "ollama_chat", "ollama_generate"
]
#: APIs whose stream is newline-delimited JSON, not SSE
NDJSON_APIS: frozenset[str] = frozenset({"ollama_chat", "ollama_generate"})

DONE = b"[DONE]"

#: the bytes that may change what surrounds them in a JSON string's text (quote, backslash,
#: control characters); text without them is plain (UTF-8 validity is checked apart)
_NOT_PLAIN = b'"\\' + bytes(range(0x20))


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
        if (
            chunk.startswith(b"data: ")
            and chunk.find(b"\n") == len(chunk) - 2
            and chunk.endswith(b"\n\n")
            and not self._buf
            and not self._cr
            and not self._skipping
            and b"\r" not in chunk
            and (self._max is None or len(chunk) - 2 <= self._max)
        ):
            return [chunk[6:-2]]  # the usual chunk: exactly one whole one-line event
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


class LineFramer:
    """Splits a newline-delimited JSON stream into its lines (the Ollama routes): the same
    interface as :class:`SSEFramer`, each non-empty line one payload. A line longer than
    ``max_event`` yields :data:`OVERSIZED` once and is skipped to its end."""

    __slots__ = ("_buf", "_max", "_skipping", "oversized")

    def __init__(self, max_event: int | None = None) -> None:
        self._buf = bytearray()
        self._max = max_event
        self._skipping = False
        self.oversized = 0

    def feed(self, chunk: bytes) -> list[bytes]:
        out: list[bytes] = []
        start = 0
        while True:
            end = chunk.find(b"\n", start)
            if end < 0:
                break
            if self._skipping:
                self._skipping = False
            else:
                line = bytes(self._buf) + chunk[start:end] if self._buf else chunk[start:end]
                self._buf.clear()
                line = line.strip()
                if self._max is not None and len(line) > self._max:
                    self.oversized += 1
                    out.append(OVERSIZED)
                elif line:
                    out.append(line)
            start = end + 1
        if not self._skipping and start < len(chunk):
            self._buf += chunk[start:]
            if self._max is not None and len(self._buf) > self._max:
                self.oversized += 1
                out.append(OVERSIZED)
                self._buf.clear()
                self._skipping = True
        return out

    @property
    def pending(self) -> bytes:
        """The bytes of an unterminated last line (a stream that ends here was cut short)."""
        return bytes(self._buf)


def framer_for(api: Api, max_event: int | None = None) -> SSEFramer | LineFramer:
    """The framer of ``api``'s stream."""
    return LineFramer(max_event) if api in NDJSON_APIS else SSEFramer(max_event)


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
    ``meta_info``), ``cached_tokens`` what it reported of its prefix cache (``usage.
    prompt_tokens_details.cached_tokens``, ``meta_info.cached_tokens``, Responses'
    ``input_tokens_details.cached_tokens``), ``chunk_tokens`` is what the events added up to,
    ``error`` holds an in-stream error object and ``done`` tells whether ``[DONE]`` arrived.

    Most events of an OpenAI stream are the previous one with other text in it, and the relay
    peeks at every event of every stream on one event loop, so a JSON parse per event is most
    of what relaying an event costs. After an event that carried one token and nothing else
    (no finish reason, no usage count, no error), its bytes around the text are kept as the
    stream's *shape*; an event that is those same bytes around other non-empty plain text
    (no quote, backslash or control character, valid UTF-8) parses to that same object with
    only the text changed, so it is counted as one token without parsing. Anything else
    (another ``created`` second, a finish, usage, logprobs) is parsed as before.

    An event of a shape SGLang does not send (``{"choices": 5}``, a ``delta`` that is not an
    object, a ``/generate`` ``index`` that is not an integer, ...) counts in ``malformed`` and
    carries no token; it never raises.
    """

    api: Api
    chunk_tokens: int = 0
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    #: prompt tokens the server says it had cached (its prefix cache), when it says
    cached_tokens: int | None = None
    finish_reason: str | None = None
    error: dict | None = None
    done: bool = False
    events: int = 0
    malformed: int = 0
    _per_index: dict[int, int] = field(default_factory=dict)
    #: (bytes before, bytes after) the text of the last event that carried one plain token
    _shape: tuple[bytes, bytes] | None = None

    def observe(self, payload: bytes) -> int:
        self.events += 1
        shape = self._shape
        if shape is not None and _same_shape(payload, shape):
            self.chunk_tokens += 1
            return 1
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
        api = self.api
        if api == "generate":
            return self._observe_generate(obj)
        if api == "messages":
            return self._observe_messages(obj)
        if api == "responses":
            return self._observe_responses(obj)
        if api in NDJSON_APIS:
            return self._observe_ollama(obj)
        return self._observe_openai(obj, payload)

    def _count(self, carries: bool) -> int:
        """One token for an event that carries text (the final usage reconciles the total)."""
        if carries:
            self.chunk_tokens += 1
            return 1
        return 0

    def _observe_messages(self, obj: dict) -> int:
        kind = obj.get("type")
        if kind == "content_block_delta":
            delta = obj.get("delta")
            if not isinstance(delta, dict):
                self.malformed += 1
                return 0
            return self._count(
                bool(delta.get("text") or delta.get("partial_json") or delta.get("thinking"))
            )
        usage = obj.get("usage")
        if kind == "message_start" and isinstance(obj.get("message"), dict):
            usage = obj["message"].get("usage")
        if isinstance(usage, dict):
            if isinstance(usage.get("input_tokens"), int) and usage["input_tokens"]:
                self.prompt_tokens = usage["input_tokens"]
            if kind == "message_delta" and isinstance(usage.get("output_tokens"), int):
                self.completion_tokens = usage["output_tokens"]
        if kind == "message_delta" and isinstance(obj.get("delta"), dict):
            self.finish_reason = obj["delta"].get("stop_reason") or self.finish_reason
        return 0

    def _observe_responses(self, obj: dict) -> int:
        kind = obj.get("type")
        if not isinstance(kind, str):
            self.malformed += 1
            return 0
        if kind.endswith(".delta"):
            return self._count(bool(obj.get("delta")))
        response = obj.get("response")
        if isinstance(response, dict):
            usage = response.get("usage")
            if isinstance(usage, dict):
                if isinstance(usage.get("output_tokens"), int):
                    self.completion_tokens = usage["output_tokens"]
                if isinstance(usage.get("input_tokens"), int):
                    self.prompt_tokens = usage["input_tokens"]
                cached = _cached(usage.get("input_tokens_details"))
                if cached is not None:
                    self.cached_tokens = cached
            if kind in ("response.failed", "response.incomplete"):
                err = response.get("error")
                self.error = err if isinstance(err, dict) else {"message": kind}
            elif kind == "response.completed":
                self.finish_reason = "completed"
        return 0

    def _observe_ollama(self, obj: dict) -> int:
        if obj.get("done") is True:
            if isinstance(obj.get("eval_count"), int):
                self.completion_tokens = obj["eval_count"]
            if isinstance(obj.get("prompt_eval_count"), int):
                self.prompt_tokens = obj["prompt_eval_count"]
            self.finish_reason = obj.get("done_reason") or "stop"
            self.done = True
            return 0
        message = obj.get("message")
        if self.api == "ollama_chat":
            if not isinstance(message, dict):
                self.malformed += 1
                return 0
            return self._count(bool(message.get("content") or message.get("thinking")))
        return self._count(bool(obj.get("response")))

    def _observe_generate(self, obj: dict) -> int:
        meta = obj.get("meta_info") or {}
        index = obj.get("index", 0)
        if not isinstance(meta, dict) or not isinstance(index, int):
            self.malformed += 1
            return 0
        total = meta.get("completion_tokens")
        if isinstance(meta.get("prompt_tokens"), int):
            self.prompt_tokens = meta["prompt_tokens"]
        if _is_int(meta.get("cached_tokens")):
            self.cached_tokens = meta["cached_tokens"]
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

    def _observe_openai(self, obj: dict, payload: bytes) -> int:
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
            cached = _cached(usage.get("prompt_tokens_details"))
            if cached is not None:
                self.cached_tokens = cached
            previous = self.completion_tokens or 0
            self.completion_tokens = usage["completion_tokens"]
            if carries:  # continuous usage: the chunk says exactly how many it carries
                new = max(self.completion_tokens - previous, 1)
        elif carries:
            new = 1
            if not self.finish_reason and "error" not in obj:
                self._shape = _shape_of(payload, self.api, choices[0])
        self.chunk_tokens += new
        return new


def _shape_of(payload: bytes, api: Api, choice: dict) -> tuple[bytes, bytes] | None:
    """``payload``'s bytes before and after the text that made ``choice`` carry a token (chat:
    ``delta.content`` or ``delta.reasoning_content``; completions: ``text``), if that text is
    plain and appears in it once."""
    if api == "chat":
        delta = choice.get("delta") or {}
        names = ("content", "reasoning_content")
    elif api == "completions":
        delta, names = choice, ("text",)
    else:
        return None
    for name in names:
        text = delta.get(name)
        if isinstance(text, str) and text:
            break
    else:
        return None
    raw = text.encode()
    if not _plain(raw):
        return None
    needle = b'"%s":"%s"' % (name.encode(), raw)
    at = payload.find(needle)
    if at < 0 or payload.find(needle, at + 1) >= 0:
        return None
    start = at + len(name) + 4  # past '"name":"'
    return payload[:start], payload[start + len(raw) :]


def _same_shape(payload: bytes, shape: tuple[bytes, bytes]) -> bool:
    """Is ``payload`` the shape's bytes around other non-empty plain text?"""
    head, tail = shape
    end = len(payload) - len(tail)
    if end <= len(head) or not payload.startswith(head) or not payload.endswith(tail):
        return False
    return _plain(payload[len(head) : end])


def _plain(text: bytes) -> bool:
    """Is ``text`` valid UTF-8 with no byte of ``_NOT_PLAIN`` (the same JSON string whatever
    surrounds it)?"""
    if len(text.translate(None, _NOT_PLAIN)) != len(text):
        return False
    if not text.isascii():
        try:
            text.decode()
        except UnicodeDecodeError:
            return False
    return True


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _cached(details: object) -> int | None:
    """``cached_tokens`` of a ``prompt_tokens_details`` / ``input_tokens_details`` object."""
    if isinstance(details, dict) and _is_int(details.get("cached_tokens")):
        return details["cached_tokens"]
    return None


@dataclass(slots=True)
class BodyUsage:
    """What a whole answer's usage says (None: it does not say)."""

    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None


def body_usage(data: bytes) -> BodyUsage:
    """The usage a whole (non-streamed) answer reports, in any of SGLang's shapes: OpenAI and
    Responses ``usage`` (``completion_tokens`` / ``output_tokens``, also Anthropic's; cached
    tokens in ``prompt_tokens_details`` / ``input_tokens_details``), ``/generate``'s
    ``meta_info`` (one object, or a list for a batch; ``cached_tokens``), Vertex
    ``predictions``, Ollama's ``eval_count``. Counts of a batch are summed."""
    out = BodyUsage()
    if not data or data[:1] not in (b"{", b"["):
        return out
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return out
    if isinstance(obj, dict) and isinstance(obj.get("predictions"), list):
        obj = obj["predictions"]
    items = obj if isinstance(obj, list) else [obj]
    total = prompt = cached = 0
    seen_prompt = seen_cached = False
    for item in items:
        if not isinstance(item, dict):
            continue
        usage = item.get("usage") or item.get("meta_info") or {}
        if not isinstance(usage, dict):
            continue
        n = usage.get("completion_tokens", usage.get("output_tokens"))
        if n is None:
            n = item.get("eval_count")
        if _is_int(n):
            total += n
        p = usage.get("prompt_tokens", usage.get("input_tokens"))
        if _is_int(p):
            prompt += p
            seen_prompt = True
        c = usage.get("cached_tokens")
        if not _is_int(c):
            c = _cached(usage.get("prompt_tokens_details") or usage.get("input_tokens_details"))
        if c is not None:
            cached += c
            seen_cached = True
    out.completion_tokens = total or None
    out.prompt_tokens = prompt if seen_prompt else None
    out.cached_tokens = cached if seen_cached else None
    return out


def body_tokens(data: bytes) -> int | None:
    """Generated tokens a whole (non-streamed) answer reports (see :func:`body_usage`); None
    when it does not say."""
    return body_usage(data).completion_tokens
