"""SSE framing and token accounting shared by the proxy and the load generator."""

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
