"""Routing policies: which of the backends with a free slot gets the next request.

A policy only ranks; proxy/admission.py decides who is a candidate (routable, not excluded,
below its limit) and increments ``in_flight`` right after ``pick`` returns, with no await in
between. Policies read backends duck-typed: ``name``, ``weight``, ``in_flight``, ``limit``
(``.limit``, ``.knee``) and ``stats`` (proxy/stats.BackendStats).

- ``round_robin``: smooth weighted round robin (nginx's algorithm).
- ``least_in_flight``: fewest in flight per unit of weight; ties rotate.
- ``p2c_peak_ewma``: two random candidates, the lower peak-EWMA TTFT x (in_flight + 1) wins
  (Finagle/tower/Linkerd); errors and 429s enter the EWMA as slow samples.
- ``latency`` (default): the soonest expected completion,
  ``ttft + out_tokens x itl(in_flight + 1) x max(1, (in_flight + 1) / knee)`` with this
  backend's measured TTFT, its ITL at the in-flight count it would have (the ITL EWMA moved
  along the slope measured between ITL and in flight: a TP or EP step grows with its batch, so
  below the knee too the emptier of two similar backends is faster), and its knee (limit) as the
  number of requests it drains in parallel before queueing; ``out_tokens`` is the same for
  every candidate (mean measured output length), so only the backend's speed decides.

With ``prefix_affinity`` on, the latency policy also reads the prompt: a request with one is ranked
by proxy/prefix.py (the expected completion with the TTFT discounted by the prefix a backend is
expected to hold, under a bounded load; rendezvous hashing for a cold prefix). The other policies
never read prompts.

A backend without measurements yet (new, restarted, or failing) ranks first in the latency
policies so that it gets probed; admission caps a backend whose latest request failed at
``probe_in_flight`` requests until one succeeds (a new one passed its health checks).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from proxy.prefix import LOOKAHEAD, UNMEASURED_BUSY, PrefixIndex, PrefixRouting, near_best
from proxy.routed import Routed, relative_load

PolicyName = Literal["latency", "p2c_peak_ewma", "round_robin", "least_in_flight"]


class RoutingSettings(BaseModel):
    """``[routing]``."""

    model_config = ConfigDict(extra="forbid")

    policy: PolicyName = "latency"
    probe_in_flight: int = Field(
        1,
        ge=1,
        description="requests a backend whose latest request failed may hold until one succeeds",
    )
    default_output_tokens: int = Field(
        128, ge=1, description="latency policy: output length assumed before any is measured"
    )
    seed: int | None = Field(None, description="p2c_peak_ewma: random seed (tests)")
    prefix_affinity: bool = Field(
        True,
        description="latency policy: weigh the prompt prefix each backend is expected to hold "
        "cached (its TTFT discounted by it), under a bounded load; false: prompts are not read",
    )
    prefix_block_chars: int = Field(
        128,
        ge=16,
        le=4096,
        description="prefix affinity: bytes of routing text per hashed block (the match unit)",
    )
    prefix_index_bytes: int = Field(
        64 * 1024 * 1024,
        ge=64 * 1024,
        description="prefix affinity: memory cap of the index of blocks routed (LRU)",
    )
    prefix_load_factor: float = Field(
        2.0,
        ge=1.0,
        description="prefix affinity: a backend with more in flight than this times its share "
        "(by limit) of the fleet's loses its claim to a prefix",
    )
    prefix_lookahead: int = Field(
        LOOKAHEAD,
        ge=1,
        description="prefix affinity: a freed slot may go to the best-matching of this many "
        "oldest waiters of the first class waiting, and no waiter is passed over more than "
        "this many times per backend (1: strict FIFO)",
    )
    prefix_lookahead_age_s: float | None = Field(
        None,
        ge=0,
        description="prefix affinity: also never pass over a waiter that waited this long "
        "(default: none; later requests go before a waiter at most prefix_lookahead times per "
        "backend)",
    )


class Policy(Protocol):
    name: str

    def pick(self, candidates: list[Routed]) -> Routed: ...


def _weight(b: Routed) -> float:
    return max(float(b.weight or 1.0), 1e-6)


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._current: dict[str, float] = {}

    def pick(self, candidates: list[Routed]) -> Routed:
        total = 0.0
        best = None
        best_cw = 0.0
        for b in candidates:
            w = _weight(b)
            total += w
            cw = self._current.get(b.name, 0.0) + w
            self._current[b.name] = cw
            if best is None or cw > best_cw:
                best, best_cw = b, cw
        assert best is not None, "pick() needs at least one candidate"
        self._current[best.name] = best_cw - total
        return best


class LeastInFlight:
    name = "least_in_flight"

    def __init__(self) -> None:
        self._tick = itertools.count()

    def pick(self, candidates: list[Routed]) -> Routed:
        n = len(candidates)
        offset = next(self._tick) % n
        rotated = candidates[offset:] + candidates[:offset]
        return min(rotated, key=lambda b: (b.in_flight + 1) / _weight(b))


class P2CPeakEwma:
    name = "p2c_peak_ewma"

    #: cost of a backend with requests in flight but no latency sample yet (Finagle's penalty)
    PENALTY = 1e6

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def cost(self, b: Routed) -> float:
        rtt = b.stats.ttft
        if rtt is None or rtt == 0:
            return self.PENALTY + b.in_flight if b.in_flight else 0.0
        return rtt * (b.in_flight + 1) / _weight(b)

    def pick(self, candidates: list[Routed]) -> Routed:
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._rng.sample(candidates, 2)
        return a if self.cost(a) <= self.cost(b) else b


class Latency:
    name = "latency"

    def __init__(self, default_output_tokens: int = 128) -> None:
        self.default_output_tokens = default_output_tokens
        self._tick = itertools.count()

    def expected_completion(self, b: Routed, out_tokens: float, cached: float = 0.0) -> float:
        """Seconds until a request sent to ``b`` now would finish. Without data: -1 (probe
        it) when nothing is in flight there, else infinite (``UNMEASURED_BUSY``): the
        requests it has are the probe, and a backend too slow to have answered any yet must
        not draw every request meanwhile. ``cached``: the fraction of its prompt ``b`` is
        expected to hold in its prefix cache, prefill it skips (proxy/prefix.py): it
        discounts the TTFT by as much."""
        ttft, itl = b.stats.ttft, b.stats.itl_at(b.in_flight + 1)
        if ttft is None or itl is None:
            return -1.0 if b.in_flight == 0 else UNMEASURED_BUSY
        knee = b.limit.knee or b.limit.limit
        slowdown = max(1.0, (b.in_flight + 1) / max(knee, 1))
        return (ttft * (1.0 - cached) + out_tokens * itl * slowdown) / _weight(b)

    def mean_output(self, candidates: Sequence[Routed]) -> float:
        """The output length every candidate is judged on: the mean measured one."""
        outs = [b.stats.output_tokens for b in candidates if b.stats.output_tokens]
        return sum(outs) / len(outs) if outs else float(self.default_output_tokens)

    def pick(self, candidates: list[Routed]) -> Routed:
        """The soonest expected completion; among the candidates within ``NEAR_BEST`` of it
        (the estimate is not finer), the least loaded for its limit. Step time never falls
        with the batch, so the emptier of two equal estimates is not slower, and spreading
        keeps every backend's estimate fresh and a failure's loss small."""
        out = self.mean_output(candidates)
        n = len(candidates)
        offset = next(self._tick) % n  # rotate so exact ties spread
        rotated = candidates[offset:] + candidates[:offset]
        costs = [self.expected_completion(b, out) for b in rotated]
        return min(near_best(rotated, costs), key=relative_load)


def make_policy(name: str | RoutingSettings = "latency", **kwargs: Any) -> Policy:
    """Build a policy by name (or from ``RoutingSettings``)."""
    if isinstance(name, RoutingSettings):
        kwargs.setdefault("seed", name.seed)
        kwargs.setdefault("default_output_tokens", name.default_output_tokens)
        name = name.policy
    if name == "round_robin":
        return RoundRobin()
    if name == "least_in_flight":
        return LeastInFlight()
    if name == "p2c_peak_ewma":
        return P2CPeakEwma(seed=kwargs.get("seed"))
    if name == "latency":
        return Latency(default_output_tokens=kwargs.get("default_output_tokens", 128))
    raise ValueError(
        f"unknown routing policy {name!r} (choose latency, p2c_peak_ewma, round_robin, "
        "least_in_flight)"
    )


def make_prefix_routing(settings: RoutingSettings, policy: Policy) -> PrefixRouting | None:
    """Prefix affinity for the latency policy when ``prefix_affinity`` is on; else None."""
    if not settings.prefix_affinity or not isinstance(policy, Latency):
        return None
    return PrefixRouting(
        PrefixIndex(settings.prefix_index_bytes),
        policy,
        block_chars=settings.prefix_block_chars,
        load_factor=settings.prefix_load_factor,
        lookahead=settings.prefix_lookahead,
        lookahead_age_s=settings.prefix_lookahead_age_s,
    )
