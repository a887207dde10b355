"""What the load generator sends: prompts, length distributions, datasets and request payloads.

Synthetic prompts need no tokenizer: they are made of common English words that every
mainstream BPE tokenizer (Llama, Qwen, Mistral, GPT-style) encodes as ONE token each when
preceded by a space, so a prompt of N words is about N tokens (the chat template adds a
fixed overhead; the server's own ``prompt_tokens`` is recorded beside the requested length).
The simulator (`loadtest sim`) counts exactly one token per whitespace-separated word.

Every payload is a pure function of ``(seed, index)``: the same seed gives the same sequence
of requests whatever the timing, so runs are reproducible and the payloads can be saved.

Three workloads (``WorkloadConfig.workload``): ``unique`` prompts, where a prefix cache cannot
help; ``shared-prefix`` groups (one of G system prompts of S tokens, then a unique question,
the shape of SGLang bench_serving's ``generated-shared-prefix``); and ``multi-turn``
conversations, where each closed-loop client re-sends its history with the answers it got
(`Conversation`), so turn k's prompt holds turn k-1's prompt and answer as its prefix. Only a
multi-turn history depends on the server: its questions still follow from ``(seed, index)``.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import orjson

Api = Literal["chat", "completions", "generate"]
WorkloadKind = Literal["unique", "shared-prefix", "multi-turn"]
WORKLOADS: tuple[str, ...] = ("unique", "shared-prefix", "multi-turn")
#: what separates a system prompt from its question, and turns of a text history
TURN_SEPARATOR = "\n\n"

API_PATHS: dict[str, str] = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "generate": "/generate",
}

# Common English words that are a single token (with their leading space) in the usual
# BPE vocabularies. 256 of them, so a 4-word salt has 2**32 values.
WORDS: tuple[str, ...] = tuple(
    """the of and to in is was for on as with by he at from his an were are which this be
    or has had not but one new first also after who its they have her two been other when
    there all during into time more she would over only can year most years between about
    city many some where out made up such these so three state may later while him world
    than people part under before then known being used both well them found through
    each same game season team however series since film school early second family
    including work back against four until like because end way last name high government
    group area any life national best long around off number following day very began
    public main just five now music even local often much took law several line could make
    did west side began head does based became few band old great set water small great
    north south east house white water house road black open book park point order man
    women men war club form army good late held million place left land next down field
    power home air told here around days run among came major top play party three light
    king our full used six force given what lost list case top large again early church
    final help real line seven upon story free age show place low best second young whole
    hand along eight body money near past love art case sea food mind view true round
    hours fact love door class type rate ten kind plan role wife cost level total word
    voice test site data""".split()
)
WORDS = tuple(dict.fromkeys(WORDS))  # drop duplicates, keep order

SALT_WORDS = 4


# ---------------------------------------------------------------------------------------
# Length distributions


@dataclass(frozen=True, slots=True)
class LengthDist:
    """A token-length distribution: ``512``, ``uniform:256-768`` or ``normal:512,64``.

    Samples are integers clamped to ``>= minimum`` (normal is also clamped to mean +- 4 sd
    so one unlucky draw cannot produce an absurd request).
    """

    kind: Literal["fixed", "uniform", "normal"]
    a: float
    b: float = 0.0
    minimum: int = 1

    @classmethod
    def parse(cls, text: str, minimum: int = 1) -> LengthDist:
        t = text.strip().lower()
        try:
            if t.isdigit():
                return cls._checked("fixed", int(t), 0, minimum, text)
            if t.startswith("fixed:"):
                return cls._checked("fixed", int(t[6:]), 0, minimum, text)
            if t.startswith("uniform:"):
                lo, hi = re.split(r"[-,]", t[8:], maxsplit=1)
                return cls._checked("uniform", int(lo), int(hi), minimum, text)
            if t.startswith("normal:"):
                mean, sd = t[7:].split(",", 1)
                return cls._checked("normal", float(mean), float(sd), minimum, text)
        except ValueError:
            pass
        raise ValueError(
            f"bad length {text!r}: expected N, uniform:LO-HI or normal:MEAN,SD (e.g. 512, "
            "uniform:256-768, normal:512,64)"
        )

    @classmethod
    def _checked(cls, kind, a, b, minimum: int, text: str) -> LengthDist:
        if kind == "fixed" and a < minimum:
            raise ValueError(f"bad length {text!r}: must be >= {minimum}")
        if kind == "uniform" and not (minimum <= a <= b):
            raise ValueError(f"bad length {text!r}: need {minimum} <= LO <= HI")
        if kind == "normal" and (a < minimum or b < 0):
            raise ValueError(f"bad length {text!r}: need MEAN >= {minimum} and SD >= 0")
        return cls(kind, a, b, minimum)

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        x = rng.gauss(self.a, self.b)
        x = min(max(x, self.a - 4 * self.b), self.a + 4 * self.b)
        return max(self.minimum, round(x))

    @property
    def mean(self) -> float:
        if self.kind == "uniform":
            return (self.a + self.b) / 2
        return self.a

    def describe(self) -> str:
        if self.kind == "fixed":
            return str(int(self.a))
        if self.kind == "uniform":
            return f"uniform:{int(self.a)}-{int(self.b)}"
        return f"normal:{self.a:g},{self.b:g}"


# ---------------------------------------------------------------------------------------
# Datasets


@dataclass(frozen=True, slots=True)
class DatasetPrompt:
    """A prompt from a file: chat messages (the completions/generate APIs get their text)."""

    messages: tuple[tuple[str, str], ...]  # (role, content)
    output_len: int | None = None  # a hint from the file (e.g. "max_tokens"); None if absent

    @property
    def text(self) -> str:
        return "\n".join(content for _, content in self.messages)


_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "chatgpt": "assistant",
    "bard": "assistant",
}


def _prompt_from_obj(obj: Any) -> DatasetPrompt | None:
    """One dataset entry -> a prompt, or None when it has no usable user turn."""
    if isinstance(obj, str):
        return DatasetPrompt((("user", obj),)) if obj.strip() else None
    if not isinstance(obj, dict):
        return None
    hint = obj.get("max_tokens") or obj.get("output_len") or obj.get("max_new_tokens")
    hint = int(hint) if isinstance(hint, int | float) and hint >= 1 else None
    convs = obj.get("conversations") or obj.get("conversation")
    if isinstance(convs, list):  # ShareGPT: the turns up to (excluding) the first reply
        msgs: list[tuple[str, str]] = []
        for turn in convs:
            if not isinstance(turn, dict):
                continue
            role = _SHAREGPT_ROLES.get(str(turn.get("from", turn.get("role", ""))).lower())
            value = turn.get("value", turn.get("content"))
            if role is None or not isinstance(value, str):
                continue
            if role == "assistant":
                if any(r == "user" for r, _ in msgs):
                    break
                continue
            msgs.append((role, value))
        return DatasetPrompt(tuple(msgs), hint) if any(r == "user" for r, _ in msgs) else None
    messages = obj.get("messages")
    if isinstance(messages, list):
        msgs = [
            (str(m.get("role", "user")), m["content"])
            for m in messages
            if isinstance(m, dict) and isinstance(m.get("content"), str)
        ]
        while msgs and msgs[-1][0] == "assistant":
            msgs.pop()
        return DatasetPrompt(tuple(msgs), hint) if msgs else None
    for key in ("prompt", "text", "input", "question"):
        if isinstance(obj.get(key), str) and obj[key].strip():
            return DatasetPrompt((("user", obj[key]),), hint)
    return None


def load_dataset(path: str | Path) -> list[DatasetPrompt]:
    """Read ShareGPT JSON (a list of ``{"conversations": [...]}``) or JSONL prompts.

    JSONL lines may be ShareGPT entries, ``{"messages": [...]}``, ``{"prompt": "..."}``
    (optionally with ``max_tokens``/``output_len``), or bare JSON strings.
    Raises ValueError with a one-line reason when the file is unusable.
    """
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read dataset {str(p)!r}: {exc.strerror or exc}") from None
    entries: list[Any]
    try:
        data = orjson.loads(raw)
        entries = data if isinstance(data, list) else [data]
    except orjson.JSONDecodeError:
        entries = []
        for lineno, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                entries.append(orjson.loads(line))
            except orjson.JSONDecodeError:
                raise ValueError(
                    f"dataset {str(p)!r}: line {lineno} is not JSON "
                    "(expected ShareGPT JSON or JSONL)"
                ) from None
    prompts = [pr for pr in map(_prompt_from_obj, entries) if pr is not None]
    if not prompts:
        raise ValueError(f"dataset {str(p)!r} has no usable prompts")
    return prompts


# ---------------------------------------------------------------------------------------
# Requests


@dataclass(slots=True)
class RequestSpec:
    """One request ready to send: its path, encoded body and what was asked for."""

    index: int
    path: str
    body: bytes
    input_len: int  # requested prompt length in tokens (words) — 0 when unknown (dataset)
    output_len: int  # max_tokens / max_new_tokens asked for
    keep_answer: bool = False  # multi-turn: the client keeps the answer's text for the next turn


@dataclass(slots=True)
class Conversation:
    """One closed-loop client's conversation: the messages so far and the question in flight."""

    messages: list[dict[str, str]] = field(default_factory=list)
    turns: int = 0  # answered turns
    question: str | None = None  # asked, not answered yet


@dataclass
class WorkloadConfig:
    api: Api = "chat"
    model: str = "default"
    stream: bool = True
    input_len: LengthDist = LengthDist("fixed", 1024)
    output_len: LengthDist = LengthDist("fixed", 512)
    output_len_given: bool = True  # False: a dataset's own per-prompt hint wins
    ignore_eos: bool | None = None  # None: on for synthetic prompts, off for a dataset
    shared_prefix: int = 0  # words shared by every prompt (prefix-cache workloads)
    workload: WorkloadKind = "unique"
    prefix_groups: int = 8  # shared-prefix: how many system prompts
    prefix_tokens: int = 2048  # shared-prefix: words (tokens) of each system prompt
    # shared-prefix: group 0's share of the requests (the rest spread evenly); None: uniform
    prefix_skew: float | None = None
    turns: int = 4  # multi-turn: turns per conversation
    seed: int = 0
    dataset: list[DatasetPrompt] | None = None
    temperature: float | None = None
    extra_body: dict[str, Any] | None = None

    @property
    def effective_ignore_eos(self) -> bool:
        return (self.dataset is None) if self.ignore_eos is None else self.ignore_eos

    def validate(self) -> None:
        """Raise ValueError (one line naming the option) for a workload that cannot be made."""
        if self.workload not in WORKLOADS:
            raise ValueError(f"unknown workload {self.workload!r}: expected {', '.join(WORKLOADS)}")
        if self.workload != "unique" and self.dataset is not None:
            raise ValueError(f"--workload {self.workload} makes synthetic prompts: drop --dataset")
        if self.workload != "unique" and self.shared_prefix:
            raise ValueError(
                f"--shared-prefix is for unique prompts; --workload {self.workload} has its own "
                "prefixes"
            )
        if self.prefix_groups < 1:
            raise ValueError(f"--prefix-groups must be >= 1, got {self.prefix_groups}")
        if self.prefix_tokens < 1:
            raise ValueError(f"--prefix-tokens must be >= 1, got {self.prefix_tokens}")
        if self.prefix_skew is not None:
            if not 0.0 < self.prefix_skew <= 1.0:
                raise ValueError(
                    f"--prefix-skew is group 0's share of the requests: a number in (0, 1], "
                    f"got {self.prefix_skew:g}"
                )
            if self.prefix_groups < 2:
                raise ValueError("--prefix-skew needs --prefix-groups >= 2")
        if self.turns < 1:
            raise ValueError(f"--turns must be >= 1, got {self.turns}")

    def describe(self) -> dict[str, Any]:
        extra: dict[str, Any] = {}
        if self.workload == "shared-prefix":
            extra = {
                "prefix_groups": self.prefix_groups,
                "prefix_tokens": self.prefix_tokens,
                "prefix_skew": self.prefix_skew,
            }
        elif self.workload == "multi-turn":
            extra = {"turns": self.turns}
        return {
            "workload": self.workload,
            **extra,
            "api": self.api,
            "model": self.model,
            "stream": self.stream,
            "input_len": "dataset" if self.dataset else self.input_len.describe(),
            "output_len": self.output_len.describe(),
            "ignore_eos": self.effective_ignore_eos,
            "shared_prefix": self.shared_prefix,
            "seed": self.seed,
            "dataset_prompts": len(self.dataset) if self.dataset else None,
            "tokens_per_word": 1.0,
        }


class Workload:
    """Deterministic request factory: ``spec(i)`` depends only on the config and ``i``."""

    def __init__(
        self,
        config: WorkloadConfig,
        *,
        start: int = 0,
        step: int = 1,
        sink: list[tuple[int, str, bytes]] | None = None,
    ) -> None:
        self.config = config
        self._next = start
        self._step = step  # several processes share one sequence: process p takes p, p+N, ...
        self.sink = sink  # when a list, every spec handed out is appended (--save-payloads)
        self._prefix = self._words(random.Random(f"{config.seed}:prefix"), config.shared_prefix)
        self._groups = (
            [self._group_prompt(g) for g in range(config.prefix_groups)]
            if config.workload == "shared-prefix"
            else []
        )
        self._conversations: dict[int, Conversation] = {}
        self._order: list[int] = []
        if config.dataset:
            self._order = list(range(len(config.dataset)))
            random.Random(f"{config.seed}:order").shuffle(self._order)

    @staticmethod
    def _words(rng: random.Random, n: int) -> list[str]:
        return rng.choices(WORDS, k=n) if n > 0 else []

    def _group_prompt(self, g: int) -> str:
        """Group g's system prompt: ``prefix_tokens`` words, the first ``SALT_WORDS`` of them
        g written in base len(WORDS), so that groups differ from their first block on."""
        rng = random.Random(f"{self.config.seed}:group:{g}")
        n = self.config.prefix_tokens
        salt, x = [], g
        for _ in range(min(SALT_WORDS, n)):
            salt.append(WORDS[x % len(WORDS)])
            x //= len(WORDS)
        return " ".join([*salt, *self._words(rng, n - len(salt))])

    def group_of(self, i: int) -> int:
        """Which system prompt request i uses: group 0 with probability ``prefix_skew`` (the
        rest uniform over the others), or uniform over all without a skew."""
        c = self.config
        rng = random.Random(f"{c.seed}:{i}:group")
        if c.prefix_skew is None:
            return rng.randrange(c.prefix_groups)
        if rng.random() < c.prefix_skew:
            return 0
        return 1 + rng.randrange(c.prefix_groups - 1)

    @property
    def needs_answers(self) -> bool:
        """Multi-turn: the next request of a client depends on the answer it got."""
        return self.config.workload == "multi-turn"

    def next(self, worker: int = 0) -> RequestSpec:
        """The next request; ``worker`` names the client whose conversation it continues."""
        i = self._next
        self._next += self._step
        spec = self.turn(i, worker) if self.needs_answers else self.spec(i)
        if self.sink is not None:
            self.sink.append((spec.index, spec.path, spec.body))
        return spec

    def answered(self, worker: int, answer: str | None) -> None:
        """The worker's request finished with ``answer`` (None: it failed, so the
        conversation starts over: its history is not what a server has seen)."""
        conv = self._conversations.get(worker)
        if conv is None or conv.question is None:
            return
        if answer is None:
            del self._conversations[worker]
            return
        conv.messages += [
            {"role": "user", "content": conv.question},
            {"role": "assistant", "content": answer},
        ]
        conv.turns += 1
        conv.question = None

    def turn(self, i: int, worker: int) -> RequestSpec:
        """Multi-turn: the worker's history, then a new question of ``input_len`` words; a
        conversation of ``turns`` answered turns is replaced by a new one."""
        c = self.config
        conv = self._conversations.get(worker)
        if conv is None or conv.turns >= c.turns:
            conv = self._conversations[worker] = Conversation()
        rng = random.Random(f"{c.seed}:{i}")
        output_len = c.output_len.sample(rng)
        conv.question = self.synthetic_prompt(i, rng, c.input_len.sample(rng))
        messages = [*conv.messages, {"role": "user", "content": conv.question}]
        text = TURN_SEPARATOR.join(m["content"] for m in messages)
        return self._request(i, messages, text, len(text.split()), output_len, keep=True)

    def synthetic_prompt(self, i: int, rng: random.Random, n_words: int) -> str:
        """``n_words`` words: the shared prefix, a unique salt from ``i``, then random words."""
        words = self._prefix[:n_words]
        room = n_words - len(words)
        if room > 0:
            salt_n = min(SALT_WORDS, room)
            x = i
            salt = []
            for _ in range(salt_n):  # i written in base len(WORDS): unique for i < 256**4
                salt.append(WORDS[x % len(WORDS)])
                x //= len(WORDS)
            words = [*words, *salt, *self._words(rng, room - salt_n)]
        return " ".join(words)

    def spec(self, i: int) -> RequestSpec:
        c = self.config
        rng = random.Random(f"{c.seed}:{i}")
        output_len = c.output_len.sample(rng)
        messages: list[dict[str, str]]
        if c.dataset:
            prompt = c.dataset[self._order[i % len(self._order)]]
            if prompt.output_len and not c.output_len_given:
                output_len = prompt.output_len
            messages = [{"role": r, "content": t} for r, t in prompt.messages]
            text = prompt.text
            input_len = 0
        else:
            input_len = c.input_len.sample(rng)
            text = self.synthetic_prompt(i, rng, input_len)
            messages = [{"role": "user", "content": text}]
            if self._groups:  # shared-prefix: a group's system prompt before the question
                system = self._groups[self.group_of(i)]
                messages.insert(0, {"role": "system", "content": system})
                text = system + TURN_SEPARATOR + text
                input_len += c.prefix_tokens
        return self._request(i, messages, text, input_len, output_len)

    def _request(
        self,
        i: int,
        messages: list[dict[str, str]],
        text: str,
        input_len: int,
        output_len: int,
        keep: bool = False,
    ) -> RequestSpec:
        c = self.config
        body = build_payload(
            c.api,
            model=c.model,
            messages=messages,
            text=text,
            max_tokens=output_len,
            stream=c.stream,
            ignore_eos=c.effective_ignore_eos,
            temperature=c.temperature,
            extra=c.extra_body,
        )
        return RequestSpec(
            i, API_PATHS[c.api], orjson.dumps(body), input_len, output_len, keep_answer=keep
        )


def build_payload(
    api: Api,
    *,
    model: str,
    messages: list[dict[str, str]],
    text: str,
    max_tokens: int,
    stream: bool,
    ignore_eos: bool,
    temperature: float | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON body for one request, in the shape SGLang's route expects.

    Streaming chat/completions ask for ``include_usage`` and ``continuous_usage_stats`` so that
    every chunk says how many tokens it carries and the final usage gives the exact total.
    """
    body: dict[str, Any]
    if api == "generate":
        sampling: dict[str, Any] = {"max_new_tokens": max_tokens, "ignore_eos": ignore_eos}
        if temperature is not None:
            sampling["temperature"] = temperature
        body = {"text": text, "sampling_params": sampling, "stream": stream}
    else:
        body = {"model": model, "max_tokens": max_tokens, "stream": stream}
        if api == "chat":
            body["messages"] = messages
        else:
            body["prompt"] = text
        if ignore_eos:
            body["ignore_eos"] = True
        if temperature is not None:
            body["temperature"] = temperature
        if stream:
            body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    if extra:
        body.update(extra)
    return body
