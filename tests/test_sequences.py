"""Sequences per request (proxy/sequences.py) and the token accounting of every stream format
SGLang serves (proxy/sse.py), on bodies shaped as SGLang's serving code writes them."""

from __future__ import annotations

import orjson
import pytest

from proxy import sequences
from proxy.sse import LineFramer, TokenCounter, body_tokens, framer_for


@pytest.mark.parametrize(
    ("body", "obj", "n"),
    [
        ("chat", {"messages": [], "n": 3}, 3),
        ("chat", {"messages": []}, 1),
        ("chat", {"messages": [], "n": "3"}, 1),  # the backend's to refuse
        ("chat", {"messages": [], "n": True}, 1),
        ("completions", {"prompt": ["a", "b"], "n": 2}, 4),
        ("completions", {"prompt": [1, 2, 3]}, 1),  # token ids: one prompt
        ("completions", {"prompt": [[1], [2], [3]]}, 3),
        ("generate", {"text": ["a", "b", "c"]}, 3),
        ("generate", {"input_ids": [[1, 2], [3]]}, 2),
        ("generate", {"input_ids": [1, 2]}, 1),
        ("generate", {"text": "a", "sampling_params": {"n": 4}}, 4),
        ("generate", {"text": ["a", "b"], "sampling_params": {"n": 2}}, 4),
        ("generate", {"text": ["a", "b"], "sampling_params": [{"n": 2}, {}]}, 3),
        ("vertex", {"instances": [{"text": "a"}, {"text": "b"}]}, 2),
        ("embeddings", {"input": ["a", "b", "c"]}, 3),
        ("single", {"n": 9}, 1),
    ],
)
def test_sequences_count_as_sglang_runs_them(body, obj, n):
    assert sequences.count(body, obj) == n


def _feed(api, raw: bytes, chunk: int = 7) -> tuple[TokenCounter, list[int]]:
    framer = framer_for(api)
    counter = TokenCounter(api)
    per_event = []
    for i in range(0, len(raw), chunk):
        for payload in framer.feed(raw[i : i + chunk]):
            per_event.append(counter.observe(payload))
    return counter, per_event


def _sse(event: str, obj: dict) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(obj) + b"\n\n"


def test_anthropic_messages_stream():
    raw = _sse(
        "message_start",
        {"type": "message_start", "message": {"usage": {"input_tokens": 9, "output_tokens": 0}}},
    )
    raw += _sse("content_block_start", {"type": "content_block_start", "index": 0})
    for w in ("Hel", "lo"):
        raw += _sse(
            "content_block_delta",
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": w}},
        )
    raw += _sse("content_block_stop", {"type": "content_block_stop", "index": 0})
    raw += _sse(
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": "max_tokens"},
            "usage": {"input_tokens": 9, "output_tokens": 2},
        },
    )
    raw += _sse("message_stop", {"type": "message_stop"})
    c, per_event = _feed("messages", raw)
    assert sum(per_event) == 2 and c.completion_tokens == 2 and c.prompt_tokens == 9
    assert c.finish_reason == "max_tokens" and c.error is None and c.malformed == 0


def test_responses_stream():
    raw = _sse("response.created", {"type": "response.created", "response": {"id": "resp_1"}})
    for w in ("a", "b", "c"):
        raw += _sse(
            "response.output_text.delta", {"type": "response.output_text.delta", "delta": w}
        )
    raw += _sse(
        "response.completed",
        {
            "type": "response.completed",
            "response": {"id": "resp_1", "usage": {"input_tokens": 4, "output_tokens": 3}},
        },
    )
    c, per_event = _feed("responses", raw)
    assert sum(per_event) == 3 and c.completion_tokens == 3 and c.prompt_tokens == 4


@pytest.mark.parametrize(
    ("api", "field"), [("ollama_chat", "message"), ("ollama_generate", "response")]
)
def test_ollama_ndjson_stream(api, field):
    def line(text: str, done: bool, **extra) -> bytes:
        value = {"role": "assistant", "content": text} if field == "message" else text
        return orjson.dumps({"model": "m", field: value, "done": done, **extra}) + b"\n"

    raw = line("a", False) + line("b", False) + line("", True, done_reason="stop", eval_count=2)
    c, per_event = _feed(api, raw, chunk=5)
    assert sum(per_event) == 2 and c.done and c.completion_tokens == 2 and c.malformed == 0


def test_line_framer_bounds_a_long_line_and_keeps_a_cut_one():
    f = LineFramer(max_event=10)
    assert f.feed(b'{"a": 1}\n' + b"x" * 30) == [b'{"a": 1}', b""]
    assert f.feed(b"yyy\n{}\n") == [b"{}"]
    assert f.feed(b'{"cut"') == [] and f.pending == b'{"cut"'


@pytest.mark.parametrize(
    ("body", "tokens"),
    [
        ({"usage": {"prompt_tokens": 3, "completion_tokens": 5}}, 5),
        ({"usage": {"input_tokens": 3, "output_tokens": 6}}, 6),  # Anthropic and Responses
        ({"model": "m", "response": "hi", "done": True, "eval_count": 7}, 7),  # Ollama
        ({"predictions": [{"meta_info": {"completion_tokens": 2}}] * 3}, 6),  # Vertex
        ([{"meta_info": {"completion_tokens": 4}}] * 2, 8),  # a /generate batch
        ({"object": "list", "data": []}, None),
    ],
)
def test_whole_answers_say_their_tokens(body, tokens):
    assert body_tokens(orjson.dumps(body)) == tokens
