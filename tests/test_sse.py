"""SSE framing and token accounting shared by the proxy and the load generator."""

import itertools
import json

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

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


def _parsed(payload: bytes) -> TokenCounter:
    """A chat counter fed ``payload`` through full JSON parsing (no byte-level shortcut)."""
    counter = TokenCounter("chat")
    counter.events += 1
    counter.chunk_tokens += counter._observe_openai(orjson.loads(payload))
    return counter


_ABSENT = object()


def _chunks():
    """Chat chunks of every combination that decides the accounting: one or two choices;
    content text (with quotes too), empty, null or absent; reasoning and tool calls absent, null
    or set; finished or not; usage absent, null or set; compact or spaced JSON."""
    fields = {
        "content": [_ABSENT, None, "", "ab", '"usage":{"completion_tokens":9}', '"'],
        "reasoning_content": [_ABSENT, None, "think"],
        "tool_calls": [_ABSENT, None, [{"index": 0, "id": "c"}]],
    }
    for content, reasoning, tools in itertools.product(*fields.values()):
        delta = {
            k: v
            for k, v in zip(fields, (content, reasoning, tools), strict=True)
            if v is not _ABSENT
        }
        for n, finish, usage, spaced in itertools.product(
            (1, 2), (None, "stop"), (_ABSENT, None, {"prompt_tokens": 3, "completion_tokens": 2}),
            (False, True),
        ):  # fmt: skip
            obj = {
                "id": "x",
                "object": "chat.completion.chunk",
                "choices": [
                    {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}
                    for i in range(n)
                ],
            }
            if usage is not _ABSENT:
                obj["usage"] = usage
            yield json.dumps(obj).encode() if spaced else orjson.dumps(obj)


def test_the_usual_chunk_counts_as_full_parsing_would():
    """Chat chunks found without parsing (one choice with text, nothing else to account) count
    exactly as parsing them would, whatever the text holds."""
    quick_ones = 0
    for payload in _chunks():
        quick = TokenCounter("chat")
        n = quick.observe(payload)
        full = _parsed(payload)
        quick_ones += quick.chunk_tokens == 1 and b'"usage":{' not in payload
        assert n == full.chunk_tokens, payload
        assert (quick.chunk_tokens, quick.completion_tokens, quick.prompt_tokens) == (
            full.chunk_tokens,
            full.completion_tokens,
            full.prompt_tokens,
        ), payload
        assert (quick.finish_reason, quick.error, quick.malformed) == (
            full.finish_reason,
            full.error,
            full.malformed,
        ), payload
    assert quick_ones  # the shortcut was taken
    # two choices, one of them finished: parsed, so the finish is seen
    mixed = orjson.dumps(
        {
            "choices": [
                {"index": 0, "delta": {"content": "a"}, "finish_reason": "stop"},
                {"index": 1, "delta": {"content": "b"}, "finish_reason": None},
            ]
        }
    )
    counter = TokenCounter("chat")
    assert counter.observe(mixed) == 1 and counter.finish_reason == "stop"


def test_text_that_looks_like_accounting_fields_is_still_one_token():
    for text in ['"usage":{"completion_tokens":9}', '","finish_reason":"stop', '"index":1']:
        payload = _chat({"content": text})
        counter = TokenCounter("chat")
        assert counter.observe(payload) == 1
        assert counter.finish_reason is None and counter.completion_tokens is None
