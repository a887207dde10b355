"""How many sequences one admitted request makes SGLang generate: what it counts against a
backend's limit and holds of the proxy's queue.

SGLang runs a batch as that many requests in its scheduler: ``/generate`` with a list of
``text`` or of ``input_ids`` runs one per prompt, ``n`` > 1 (``sampling_params.n``, or the OpenAI
field) runs n per prompt, ``/v1/completions`` with a list of prompts one per prompt, a Vertex
call one per instance, ``/v1/embeddings`` with a list of inputs one per input. A request the
backend will refuse (``n`` not a positive integer, ...) counts as one: it is the backend's to
answer, not the proxy's to guess.
"""

from __future__ import annotations

from typing import Any, Literal

#: the shape of an admitted request's body, as far as counting its sequences goes
Body = Literal["chat", "completions", "generate", "vertex", "embeddings", "single"]


def count(body: Body, obj: dict[str, Any]) -> int:
    """Sequences ``obj`` (a request body of shape ``body``) asks for; at least 1."""
    if body == "chat":
        return _n(obj.get("n"))
    if body == "completions":
        return _prompts(obj.get("prompt")) * _n(obj.get("n"))
    if body == "generate":
        return _generate(obj)
    if body == "vertex":
        instances = obj.get("instances")
        return len(instances) if isinstance(instances, list) and instances else 1
    if body == "embeddings":
        return _prompts(obj.get("input"))
    return 1


def _n(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    return 1


def _prompts(prompt: Any) -> int:
    """A string or a list of token ids is one prompt; a list of strings or of id lists, many."""
    if not isinstance(prompt, list) or not prompt:
        return 1
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        return 1
    return len(prompt)


def _generate(obj: dict[str, Any]) -> int:
    text, ids = obj.get("text"), obj.get("input_ids")
    if isinstance(text, list) and text:
        prompts = len(text)
    elif isinstance(ids, list) and ids and all(isinstance(p, list) for p in ids):
        prompts = len(ids)
    else:
        prompts = 1
    params = obj.get("sampling_params")
    if isinstance(params, list) and len(params) == prompts:
        return sum(_n(p.get("n")) if isinstance(p, dict) else 1 for p in params)
    if isinstance(params, dict):
        return prompts * _n(params.get("n"))
    return prompts
