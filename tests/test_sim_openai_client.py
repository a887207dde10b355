"""The official `openai` client against the simulator, streaming and not."""

from __future__ import annotations

import pytest
from sim_util import running_sim

openai = pytest.importorskip("openai")


@pytest.fixture
async def client():
    async with running_sim("pp8") as (url, backend):
        c = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="sk-sim", max_retries=0)
        try:
            yield c, backend
        finally:
            await c.close()


async def test_models_list(client):
    c, backend = client
    models = await c.models.list()
    assert [m.id for m in models.data] == [backend.model_name]


async def test_chat_non_stream(client):
    c, backend = client
    out = await c.chat.completions.create(
        model=backend.model_name,
        messages=[{"role": "user", "content": "hi there"}],
        max_tokens=6,
        extra_body={"ignore_eos": True},
    )
    assert out.object == "chat.completion"
    assert out.choices[0].finish_reason == "length"
    assert len(out.choices[0].message.content.split()) == 6
    assert out.usage.completion_tokens == 6
    assert out.usage.total_tokens == out.usage.prompt_tokens + 6


async def test_chat_stream_with_usage(client):
    c, backend = client
    stream = await c.chat.completions.create(
        model=backend.model_name,
        messages=[{"role": "user", "content": "hi there"}],
        max_tokens=9,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    text, finish, usage, roles = "", None, None, []
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.role:
                roles.append(choice.delta.role)
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert roles == ["assistant"]
    assert len(text.split()) == 9
    assert finish == "length"
    assert usage.completion_tokens == 9


async def test_completions_stream_and_not(client):
    c, backend = client
    out = await c.completions.create(
        model=backend.model_name, prompt="one two", max_tokens=4, extra_body={"ignore_eos": True}
    )
    assert len(out.choices[0].text.split()) == 4 and out.usage.completion_tokens == 4
    stream = await c.completions.create(
        model=backend.model_name,
        prompt="one two",
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    pieces, usage = [], None
    async for chunk in stream:
        pieces += [ch.text for ch in chunk.choices]
        usage = chunk.usage or usage
    assert len("".join(pieces).split()) == 5 and usage.completion_tokens == 5


async def test_errors_map_to_openai_exceptions(client):
    c, backend = client
    with pytest.raises(openai.BadRequestError) as info:
        await c.chat.completions.create(
            model=backend.model_name,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=backend.profile.context_length * 2,
        )
    assert "maximum context length" in str(info.value)
    with pytest.raises(openai.BadRequestError):
        await c.chat.completions.create(
            model=backend.model_name,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=-3,
            stream=True,
        )
