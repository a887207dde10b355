"""SSE framing and token accounting shared by the proxy and the load generator."""

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

import proxy.sse as sse
from proxy.sse import OVERSIZED, SSEFramer, TokenCounter


def _stream(payloads: list[bytes], sep: bytes = b"\n") -> bytes:
    return b"".join(b"data: " + p + sep + sep for p in payloads)


@given(
    payloads=st.lists(
        st.binary(min_size=1, max_size=40).filter(lambda b: b"\n" not in b and b"\r" not in b),
        max_size=20,
    ),
    cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=10),
    crlf=st.booleans(),
)
def test_framer_reassembles_events_whatever_the_chunk_boundaries(payloads, cuts, crlf):
    data = _stream(payloads, b"\r\n" if crlf else b"\n")
    framer = SSEFramer()
    got: list[bytes] = []
    points = sorted({min(c, len(data)) for c in cuts})
    start = 0
    for point in [*points, len(data)]:
        got.extend(framer.feed(data[start:point]))
        start = point
    assert got == payloads
    assert framer.pending == b""


def test_framer_keeps_an_unterminated_event_pending():
    framer = SSEFramer()
    assert framer.feed(b'data: {"a":1}\n\ndata: {"b"') == [b'{"a":1}']
    assert framer.pending == b'data: {"b"'


def _chat(delta: dict, finish=None) -> bytes:
    return orjson.dumps(
        {
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }
    )


def test_chat_counts_content_chunks_not_role_finish_or_usage():
    counter = TokenCounter("chat")
    events = [
        _chat({"role": "assistant", "content": ""}),
        _chat({"content": "Hel"}),
        _chat({"content": "lo"}),
        _chat({}, finish="length"),
        orjson.dumps({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}}),
        b"[DONE]",
    ]
    assert [counter.observe(e) for e in events] == [0, 1, 1, 0, 0, 0]
    assert (counter.chunk_tokens, counter.completion_tokens, counter.prompt_tokens) == (2, 2, 5)
    assert counter.finish_reason == "length" and counter.done


def test_continuous_usage_gives_exact_tokens_per_chunk():
    counter = TokenCounter("completions")
    first = orjson.dumps({"choices": [{"text": "a b c"}], "usage": {"completion_tokens": 3}})
    second = orjson.dumps({"choices": [{"text": "d"}], "usage": {"completion_tokens": 4}})
    assert counter.observe(first) == 3
    assert counter.observe(second) == 1


def test_generate_uses_cumulative_completion_tokens():
    counter = TokenCounter("generate")

    def chunk(n, finish=None):
        return orjson.dumps(
            {
                "text": "x" * n,
                "meta_info": {"completion_tokens": n, "prompt_tokens": 7, "finish_reason": finish},
            }
        )

    assert [counter.observe(chunk(n)) for n in (1, 3, 4)] == [1, 2, 1]
    counter.observe(chunk(4, {"type": "length", "length": 4}))
    assert counter.completion_tokens == 4 and counter.finish_reason == "length"


def test_in_stream_error_is_recorded():
    counter = TokenCounter("chat")
    assert counter.observe(b'{"error": {"message": "boom", "code": 503}}') == 0
    assert counter.error == {"message": "boom", "code": 503}
    assert counter.observe(b"not json") == 0 and counter.malformed == 1


@pytest.mark.parametrize(
    ("api", "payload"),
    [
        ("chat", b'{"choices": 5}'),
        ("chat", b'{"choices": [{"delta": "x"}]}'),
        ("chat", b'{"choices": [7]}'),
        ("completions", b'{"choices": {"text": "a"}}'),
        ("generate", b'{"index": [1], "meta_info": {"completion_tokens": 1}}'),
        ("generate", b'{"index": "0", "meta_info": {"completion_tokens": 1}}'),
        ("generate", b'{"meta_info": 5}'),
    ],
)
def test_events_of_unexpected_shape_are_malformed_never_an_exception(api, payload):
    counter = TokenCounter(api)
    assert counter.observe(payload) == 0
    assert counter.malformed == 1 and counter.chunk_tokens == 0


@given(
    sizes=st.lists(st.integers(min_value=1, max_value=300), max_size=12),
    cuts=st.lists(st.integers(min_value=0, max_value=4000), max_size=12),
    crlf=st.booleans(),
)
def test_framer_skips_events_over_its_bound_and_keeps_framing(sizes, cuts, crlf):
    limit = 100
    payloads = [b"x" * n for n in sizes]
    data = _stream(payloads, b"\r\n" if crlf else b"\n")
    framer = SSEFramer(max_event=limit)
    got: list[bytes] = []
    start = 0
    for point in [*sorted({min(c, len(data)) for c in cuts}), len(data)]:
        got.extend(framer.feed(data[start:point]))
        assert len(framer.pending) <= limit + 2  # never more than the bound is held
        start = point
    expected = [p if len(b"data: " + p) <= limit else OVERSIZED for p in payloads]
    assert got == expected
    assert framer.oversized == expected.count(OVERSIZED)
    assert framer.pending == b""


def _sglang_chunk(text: str | None, *, created: int = 1733000000, finish=None, usage=None) -> bytes:
    """A chunk as SGLang serialises it (pydantic, compact): every field, nulls included."""
    return orjson.dumps(
        {
            "id": "abc",
            "object": "chat.completion.chunk",
            "created": created,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "delta": {"role": None, "content": text, "reasoning_content": None},
                    "logprobs": None,
                    "finish_reason": finish,
                    "matched_stop": None,
                }
            ],
            "usage": usage,
        }
    )


def _state(counter: TokenCounter) -> tuple:
    return (
        counter.chunk_tokens,
        counter.completion_tokens,
        counter.prompt_tokens,
        counter.finish_reason,
        counter.error,
        counter.done,
        counter.events,
        counter.malformed,
    )


def _observe_all(counter: TokenCounter, payloads: list[bytes]) -> list[int]:
    return [counter.observe(p) for p in payloads]


#: text a token can be, with what could break a byte-level reading: quotes, backslashes,
#: control characters, a forged rest of the chunk, invalid UTF-8, nothing
_TEXTS = st.one_of(
    st.text(max_size=6),
    st.sampled_from(
        [
            " word",
            'x","finish_reason":"stop',
            'a\\"b',
            "\n",
            "é漢",
            "",
            '"}],"usage":{"completion_tokens":9}}',
        ]
    ),
)
_RAW_MIDDLES = st.sampled_from([b"\xff\xfe", b"a\nb", b'a"b', b"ok", b"\xc3\xa9", b""])


@given(
    steps=st.lists(
        st.one_of(
            st.tuples(st.just("text"), _TEXTS),
            st.tuples(st.just("raw"), _RAW_MIDDLES),
            st.tuples(st.just("created"), st.integers(0, 3)),
            st.tuples(st.just("finish"), st.sampled_from(["stop", "length"])),
            st.tuples(st.just("usage"), st.integers(0, 50)),
        ),
        max_size=30,
    )
)
def test_events_counted_from_their_shape_count_as_parsing_every_one_would(steps):
    """An event read from the bytes around its text (no JSON parse) must leave the counter
    exactly where parsing it would: whatever the text holds, including bytes spliced in raw
    between a real chunk's head and tail."""
    created = 1733000000
    base = _sglang_chunk("TEXT")
    head, tail = base.split(b"TEXT")
    payloads = []
    for kind, value in steps:
        if kind == "text":
            payloads.append(_sglang_chunk(value, created=created))
        elif kind == "raw":
            payloads.append(head.replace(b"1733000000", str(created).encode()) + value + tail)
        elif kind == "created":
            created += value
        elif kind == "finish":
            payloads.append(_sglang_chunk(None, created=created, finish=value))
        else:
            payloads.append(
                _sglang_chunk(None, created=created, usage={"completion_tokens": value})
            )
    fast, slow = TokenCounter("chat"), TokenCounter("chat")
    real = sse._shape_of
    try:
        sse._shape_of = lambda *a: None  # the reference: every event parsed
        expected = _observe_all(slow, payloads)
    finally:
        sse._shape_of = real
    assert _observe_all(fast, payloads) == expected
    assert _state(fast) == _state(slow)


def test_a_stream_of_plain_tokens_is_parsed_once(monkeypatch):
    """After one plain token event, the events that differ from it only in their plain text
    are not parsed; one that differs anywhere else (a new ``created`` second, the finish) is."""
    parsed = []
    real = sse.orjson.loads
    monkeypatch.setattr(sse.orjson, "loads", lambda b: parsed.append(b) or real(b))
    counter = TokenCounter("chat")
    words = [" a", " bé", " c", "d", " e"]
    events = [_sglang_chunk(w) for w in words]
    events += [_sglang_chunk(" f", created=1733000001), _sglang_chunk(" g", created=1733000001)]
    events += [_sglang_chunk(None, created=1733000001, finish="stop")]
    assert _observe_all(counter, events) == [1] * 7 + [0]
    assert counter.chunk_tokens == 7 and counter.finish_reason == "stop"
    assert len(parsed) == 3  # the first token, the first of the next second, the finish


def test_completions_and_reasoning_text_take_the_shape_too(monkeypatch):
    parsed = []
    real = sse.orjson.loads
    monkeypatch.setattr(sse.orjson, "loads", lambda b: parsed.append(b) or real(b))
    completions = TokenCounter("completions")
    chunk = {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": "x"}]}
    events = []
    for word in ("one", " two", " three"):
        chunk["choices"][0]["text"] = word
        events.append(orjson.dumps(chunk))
    assert _observe_all(completions, events) == [1, 1, 1]
    reasoning = TokenCounter("chat")
    thoughts = [_chat({"content": None, "reasoning_content": w}) for w in ("Hm", " so", " ok")]
    assert _observe_all(reasoning, thoughts) == [1, 1, 1]
    assert len(parsed) == 2  # one per stream
