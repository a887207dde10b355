"""What the load generator records about each request, on the monotonic clock.

The runner fills one `RequestRecord` per request; statistics, reports and merges read only
these. Times are `time.monotonic()` seconds (comparable across processes on one host, so a
simulator's trace can be checked against them); `t_wall_offset` in the run's metadata maps
them to wall-clock time for merging runs from several machines.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

#: ``RequestRecord.error`` of a request the run stopped itself (its --drain-timeout, Ctrl-C):
#: not an error of the target, counted apart from errors
CANCELLED = "cancelled"


@dataclass(slots=True)
class RequestRecord:
    """One request, as measured by the client (definitions in docs/loadtest-metrics.md)."""

    level: int  # requested concurrency (closed loop) or 0 for open loop
    worker: int  # which closed-loop worker (or arrival index for open loop) sent it
    t_scheduled: float  # open loop: the scheduled send time; closed loop: equals t_send
    t_send: float  # just before the request was written
    t_first: float | None = None  # first token-carrying event
    t_last: float | None = None  # last token-carrying event
    t_end: float | None = None  # response fully read (or failed)
    # one entry per token-carrying event: its arrival time and how many tokens it carried
    token_times: list[float] = field(default_factory=list)
    token_counts: list[int] = field(default_factory=list)
    completion_tokens: int | None = None  # the server's usage.completion_tokens
    prompt_tokens: int | None = None  # the server's usage.prompt_tokens
    requested_input_len: int = 0
    requested_output_len: int = 0
    status: int | None = None  # HTTP status
    error: str | None = None  # error kind: connect, timeout, http_4xx, http_5xx, stream_error, ...
    error_message: str | None = None
    finish_reason: str | None = None
    served_by: str | None = None  # the backend a proxy named in X-Pipefill-Backend, if any
    # prompt tokens the server said it had in its prefix cache (usage.prompt_tokens_details or
    # meta_info); None when it said nothing (SGLang's OpenAI routes without
    # --enable-cache-report)
    cached_tokens: int | None = None
    # the answer's text, kept only while a multi-turn workload needs it (never saved)
    answer: str | None = field(default=None, repr=False)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def chunk_tokens(self) -> int:
        return sum(self.token_counts)

    @property
    def output_tokens(self) -> int:
        """The server's count when it sent one, else what the events added up to."""
        return self.completion_tokens if self.completion_tokens is not None else self.chunk_tokens

    @property
    def ttft(self) -> float | None:
        return None if self.t_first is None else self.t_first - self.t_scheduled

    @property
    def e2e(self) -> float | None:
        return None if self.t_last is None else self.t_last - self.t_scheduled

    @property
    def tpot(self) -> float | None:
        n = self.output_tokens
        if self.t_first is None or self.t_last is None or n < 2:
            return None
        return (self.t_last - self.t_first) / (n - 1)

    def itl_samples(self) -> list[float]:
        """Gaps between token-carrying events; an event with k tokens gives k samples of gap/k."""
        out: list[float] = []
        times, counts = self.token_times, self.token_counts
        for i in range(1, len(times)):
            k = max(counts[i], 1)
            out.extend([(times[i] - times[i - 1]) / k] * k)
        return out

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        del out["answer"]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestRecord:
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})
