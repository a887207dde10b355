"""One generation request's life in the simulator's HTTP layer, shared by every route.

`Generation` submits to the engine, yields token steps, applies ``stop`` strings, and on
``close()`` aborts the engine request if it did not finish (client gone, fault, error),
records the per-request histograms and writes the trace line. Routes only shape JSON.

Times: ``time.monotonic()`` taken right before the server writes an event (the trace's
truth for clients to compare against). Histograms get modelled seconds: TTFT and E2E from
the engine's own clock, inter-token gaps from the writes divided by the time scale.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from loadtest.sim import tokens
from loadtest.sim.engine import GenRequest

if TYPE_CHECKING:
    from loadtest.sim.server import SimBackend


class RequestError(ValueError):
    """A request SGLang rejects with HTTP 400 (message text as SGLang words it)."""


@dataclass(slots=True)
class Step:
    """Tokens new since the previous step, and the finish once generation ended."""

    token_ids: list[int]
    text: str
    finish: dict | None = None  # SGLang's finish_reason JSON, e.g. {"type": "length", "length": 8}


def finish_json(finish: Any) -> dict:
    """The engine's Finish as SGLang's ``FINISH_*.to_json()``."""
    kind = getattr(finish, "type", None) or "abort"
    if kind == "length":
        return {"type": "length", "length": getattr(finish, "length", None)}
    if kind == "stop":
        return {"type": "stop", "matched": getattr(finish, "matched", None)}
    out: dict = {"type": "abort", "message": getattr(finish, "message", None) or "Abort"}
    status = getattr(finish, "status_code", None)
    if status is not None:
        out["status_code"] = int(status)
        out["err_type"] = getattr(finish, "err_type", None)
    return out


def validate_lengths(prompt_tokens: int, max_new_tokens: int | None, context_length: int) -> None:
    """SGLang's tokenizer-manager checks, with its messages."""
    if max_new_tokens is not None and max_new_tokens < 0:
        raise RequestError(f"max_new_tokens must be at least 0, got {max_new_tokens}.")
    if prompt_tokens >= context_length:
        raise RequestError(
            f"The input ({prompt_tokens} tokens) is longer than the model's context length "
            f"({context_length} tokens)."
        )
    if max_new_tokens is not None and prompt_tokens + max_new_tokens > context_length:
        total = prompt_tokens + max_new_tokens
        raise RequestError(
            f"Requested token count exceeds the model's maximum context length of "
            f"{context_length} tokens. You requested a total of {total} tokens: "
            f"{prompt_tokens} tokens from the input messages and {max_new_tokens} tokens for "
            f"the completion. Please reduce the number of tokens in the input messages or the "
            f"completion to fit within the limit."
        )


def parse_stop(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value else []
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return [s for s in value if s]
    raise RequestError("stop must be a string or a list of strings")


@dataclass
class Generation:
    backend: SimBackend
    route: str
    rid: str
    prompt_tokens: int
    max_new_tokens: int
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    prompt_ids: tuple[int, ...] | None = None  # what the prefix cache matches and keeps
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish: dict | None = None
    num_retractions: int = 0
    t_first: float | None = None
    t_last: float | None = None
    _t_prev: float | None = None
    _stream: Any = None
    _closed: bool = False

    def submit(self) -> None:
        """Queue in the engine; ``RequestError`` if the rid is already live there."""
        try:
            self._stream = self.backend.engine.submit(
                GenRequest(
                    rid=self.rid,
                    prompt_tokens=self.prompt_tokens,
                    max_new_tokens=self.max_new_tokens,
                    ignore_eos=self.ignore_eos,
                    prompt_ids=self.prompt_ids,
                )
            )
        except ValueError as exc:
            raise RequestError(f"Duplicate request id {self.rid!r}: {exc}") from None

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the prefix cache held at admission (0 before it)."""
        return 0 if self._stream is None else int(self._stream.cached_tokens)

    def prompt_tokens_details(self) -> dict | None:
        """OpenAI usage's ``prompt_tokens_details``: SGLang fills it only when started with
        ``--enable-cache-report``."""
        if not self.backend.enable_cache_report:
            return None
        return {"cached_tokens": self.cached_tokens}

    async def steps(self) -> AsyncIterator[Step]:
        """Token steps as the engine produces them; the last one carries ``finish``."""
        if self._stream is None:
            self.submit()
        async for event in self._stream:
            ids = list(event.token_ids)
            piece = "".join(tokens.token_text(t) for t in ids)
            finish = finish_json(event.finish) if event.finish is not None else None
            text = self.text + piece
            if self.stop and ids:
                ids, text, finish = self._apply_stop(ids, finish)
                piece = text[len(self.text) :]
            self.output_ids.extend(ids)
            self.text = text
            self.num_retractions = int(getattr(self._stream, "num_retractions", 0) or 0)
            if finish is not None:
                self.finish = finish
            yield Step(ids, piece, finish)
            if finish is not None:
                return
        if self.finish is None:  # engine ended the stream without a finish: treat as abort
            self.finish = {"type": "abort", "message": "Abort"}
            yield Step([], "", self.finish)

    def _apply_stop(self, ids: list[int], finish: dict | None) -> tuple[list[int], str, Any]:
        """Stop at the first stop string: it is trimmed from the text, as SGLang does, and
        the rest of the generation is aborted in the engine."""
        text = self.text
        for i, token in enumerate(ids):
            text += tokens.token_text(token)
            for s in self.stop:
                at = text.find(s, max(len(self.text) - len(s) + 1, 0))
                if at >= 0:
                    self.backend.engine.abort(self.rid)
                    return ids[: i + 1], text[:at], {"type": "stop", "matched": s}
        return ids, text, finish

    async def run_to_end(self) -> None:
        async for _ in self.steps():
            pass

    def mark_write(self, new_tokens: int) -> None:
        """Call right before writing an event that carries ``new_tokens`` generated tokens."""
        if new_tokens <= 0:
            return
        now = time.monotonic()
        scale = self.backend.time_scale
        if self.t_first is None:
            self.t_first = now
            ttft = self._modelled("t_first")
            self.backend.metrics.observe_first_token(
                ttft if ttft is not None else (now - self.arrival) / scale
            )
        elif self._t_prev is not None:
            self.backend.metrics.observe_chunk((now - self._t_prev) / scale, new_tokens)
        self._t_prev = self.t_last = now

    def _modelled(self, attr: str) -> float | None:
        """Engine-side (modelled) seconds from arrival to ``attr``, as SGLang measures them."""
        t, t0 = getattr(self._stream, attr, None), getattr(self._stream, "t_arrival", None)
        return None if t is None or t0 is None else max(t - t0, 0.0)

    def close(self) -> None:
        """Abort in the engine if unfinished; record histograms and the trace (idempotent)."""
        if self._closed:
            return
        self._closed = True
        finished = self.finish is not None
        if not finished and self._stream is not None:
            self.backend.engine.abort(self.rid)
        now = time.monotonic()
        if finished and self.finish.get("type") != "abort":
            e2e = self._modelled("t_last")
            if e2e is None:
                e2e = (now - self.arrival) / self.backend.time_scale
            self.backend.metrics.observe_finish(e2e, self.num_retractions)
        self.backend.trace_write(
            {
                "rid": self.rid,
                "route": self.route,
                "port": self.backend.port,
                "arrival": self.arrival,
                "first_token": self.t_first,
                "last_token": self.t_last,
                "end": now,
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "finish": (self.finish or {}).get("type", "disconnect"),
                "num_retractions": self.num_retractions,
            }
        )
