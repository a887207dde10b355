"""The simulator's deterministic stand-in for a tokenizer.

Rule: a prompt has one token per whitespace-separated word (`str.split()`), at least one.
The load generator builds synthetic prompts from single-token common words, so a prompt of N
words is N tokens here and about N on a real tokenizer. Chat prompts add a fixed template
overhead per message (role markers), as a chat template does.

Generated tokens are ids into `VOCAB`; `token_text(id)` is " word". Ids come from a seeded
generator keyed by (seed, rid or prompt), so the same seed and key always give the same text.

Prompt token ids (`prompt_token_ids`, `chat_prompt_ids`) are a deterministic function of the
text, so the prefix cache (loadtest/sim/prefix_cache.py) sees the same tokens for the same
text in every process: a `VOCAB` word is its index (so generated text sent back in the next
turn of a conversation maps to the very ids that were generated), any other word a stable
hash above the special ids. A chat prompt is rendered as a chat template would: per message
`[START, role, NEWLINE] + content + [END]`, then `[START, assistant, NEWLINE]` for the turn
the model writes; so a prompt's first three tokens (the first message's header) are shared by
every chat prompt whose first message has the same role, as on a real template.
"""

from __future__ import annotations

import functools
import hashlib
import random
from collections.abc import Iterable, Mapping
from typing import Any

# Tokens a chat template adds per message (e.g. "<|im_start|>", role, "<|im_end|>", newline).
CHAT_TOKENS_PER_MESSAGE = 4
# Tokens the template adds once, for the assistant turn the model is asked to write.
CHAT_TOKENS_PER_PROMPT = 3

# Common English words, each a single token on typical BPE vocabularies.
_WORDS = (
    "the of and to in is that it for was on are as with be at by this have from or one had not"
    " but what all were when we there can an your which their said if do will each about how up"
    " out them then she many some so these would other into has more her two like him see time"
    " could no make than first been its who now people my made over did down only way find use"
    " may water long little very after words called just where most know get through back much"
    " before go good new write our used me man too any day same right look think also around"
    " another came come work three word must because does part even place well such here take"
    " why things help put years different away again off went old number great tell men say"
    " small every found still between name should home big give air line set own under read"
    " last never us left end along while might next sound below saw something thought both few"
    " those always looked show large often together asked house world going want school important"
    " until form food keep children feet land side without boy once animals life enough took"
    " sometimes four head above kind began almost live page got earth need far hand high year"
    " mother light parts country father let night following picture being study second eyes soon"
    " times story boys since white days ever paper hard near sentence better best across during"
    " today others however sure means knew try told young miles sun ways thing whole hear"
    " example heard several change answer room sea against top turned learn point city play"
    " toward five using himself usually"
).split()

VOCAB: tuple[str, ...] = tuple(dict.fromkeys(_WORDS))
EOS_TOKEN_ID = len(VOCAB)  # outside VOCAB: never emitted as text

# Special ids of the chat template, just above EOS (an assistant message ends with EOS, as
# templates whose end-of-turn token is the EOS token do).
CHAT_START_ID = EOS_TOKEN_ID + 1
CHAT_NEWLINE_ID = EOS_TOKEN_ID + 2
CHAT_END_ID = EOS_TOKEN_ID
EMPTY_PROMPT_ID = EOS_TOKEN_ID + 3  # the one token of an empty prompt
# Words outside VOCAB (and role names) hash into [HASHED_ID_BASE, HASHED_ID_BASE + SPACE).
HASHED_ID_BASE = 1024
HASHED_ID_SPACE = 1 << 30
_VOCAB_INDEX = {w: i for i, w in enumerate(VOCAB)}
_WORD_ID_CACHE_SIZE = 1 << 16


@functools.lru_cache(maxsize=_WORD_ID_CACHE_SIZE)
def _hashed_id(word: str) -> int:
    digest = hashlib.blake2b(word.encode(), digest_size=8).digest()
    return HASHED_ID_BASE + int.from_bytes(digest, "big") % HASHED_ID_SPACE


def word_token_id(word: str) -> int:
    """The id of one word: its VOCAB index, else a stable hash (the same in every process)."""
    index = _VOCAB_INDEX.get(word)
    return index if index is not None else _hashed_id(word)


def _word_ids(text: str) -> list[int]:
    return [word_token_id(w) for w in text.split()]


def prompt_token_ids(text: str) -> list[int]:
    """Token ids of a text prompt: one per whitespace-separated word, at least one."""
    return _word_ids(text) or [EMPTY_PROMPT_ID]


def count_prompt_tokens(text: str) -> int:
    """Tokens of a text prompt: one per whitespace-separated word, at least 1."""
    return max(len(text.split()), 1)


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    return str(content)


def _turn_header(role: str) -> list[int]:
    return [CHAT_START_ID, word_token_id(f"<|role:{role}|>"), CHAT_NEWLINE_ID]


def chat_prompt_ids(messages: Iterable[Mapping[str, Any]]) -> list[int]:
    """Token ids of a chat prompt as the template renders it (see the module docstring):
    ``CHAT_TOKENS_PER_MESSAGE`` per message around its words, ``CHAT_TOKENS_PER_PROMPT`` for
    the assistant turn to write."""
    ids: list[int] = []
    for m in messages:
        ids += _turn_header(str(m.get("role", "user")))
        ids += _word_ids(_content_text(m.get("content")))
        ids.append(CHAT_END_ID)
    ids += _turn_header("assistant")
    return ids


def chat_prompt_tokens(messages: Iterable[Mapping[str, Any]]) -> int:
    """Tokens of a chat prompt: words of every message + the template's fixed overhead."""
    n = CHAT_TOKENS_PER_PROMPT
    for m in messages:
        n += CHAT_TOKENS_PER_MESSAGE + len(_content_text(m.get("content")).split())
    return n


def token_text(token_id: int) -> str:
    """Text of one generated token: a space and a word (EOS has no text)."""
    if 0 <= token_id < len(VOCAB):
        return " " + VOCAB[token_id]
    return ""


def stable_seed(seed: int, key: str | int | Iterable[int]) -> int:
    """A 64-bit seed from (seed, key) that is the same in every process (unlike hash())."""
    if isinstance(key, str):
        raw = key.encode()
    elif isinstance(key, int):
        raw = str(key).encode()
    else:
        raw = ",".join(str(int(k)) for k in key).encode()
    digest = hashlib.blake2b(raw, digest_size=8, key=str(int(seed)).encode()).digest()
    return int.from_bytes(digest, "big")


class TokenSource:
    """The deterministic token stream of one request: `take(n)` continues where it stopped."""

    __slots__ = ("_rng",)

    def __init__(self, seed: int, key: str | int | Iterable[int]) -> None:
        self._rng = random.Random(stable_seed(seed, key))

    def take(self, n: int) -> list[int]:
        r = self._rng.randrange
        size = len(VOCAB)
        return [r(size) for _ in range(n)]


def generate_token_ids(seed: int, rid_or_prompt: str | int | Iterable[int], n: int) -> list[int]:
    """The first n generated token ids for this key: deterministic for a seed."""
    return TokenSource(seed, rid_or_prompt).take(n)
