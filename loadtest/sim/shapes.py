"""Random but plausible backend shapes: an engine profile plus the workload that loads it.

The proxy's adaptive limit was tuned on three calibrated profiles (pp8, tp8, ep8); tuned on a
few shapes, an algorithm fits their accidents. ``generate_shape(seed)`` draws a shape from a
seeded distribution wide enough to judge whether it generalises, on seeds it was not tuned on
(``SPLITS``: ``tune`` and ``accept`` are disjoint seed ranges):

- pipeline stages 1-16 (``pp`` with ``pp_size`` 2-16; ``tp`` and ``ep``, the latter with 1-8
  data-parallel attention ranks, with one);
- a step cost from mostly fixed per pass to mostly per request: the per-request part of a full
  pass over its fixed part (``cost_ratio``) spans ``COST_RATIO`` (two orders of magnitude), for
  half the shapes partly through the saturating MoE expert-read term;
- running caps (``max_running_requests``) from 8 to 1024;
- KV pools that bind before the running cap for this workload's prompt and answer lengths
  (``kv_bound``) and ones that leave the cap binding, with SGLang's ``new_token_ratio``
  reservation from 0 (admit on prompt fit, retract later) to 0.5;
- prefill from a few % of the engine's busy time to most of it, prompts of 32-8192 tokens;
- short and long answers (a mean of 16-1024 tokens, each request drawn from a range around it);
- step-time noise (``Profile.step_noise``) on three shapes in four.

The profile and the workload are drawn together because whether the pool or the cap binds,
and how heavy prefill is, depends on both. A lone request decodes at ``SINGLE_ITL_MS`` (a
realistic band); shapes that would be unaffordable to simulate many times over (too many
tokens per second or in flight, a loaded step slower than ``MAX_LOADED_ITL_S``) are redrawn
from the same seeded stream, so a seed always gives the same shape.

Used by benchmarks/limit_shapes.py and tests/test_limit_shapes.py.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Literal

from loadtest.sim.profiles import Profile
from loadtest.sim.scheduler import active_experts, handoff_ms, step_cost_ms
from loadtest.sim.tokens import stable_seed

# --- what is drawn -------------------------------------------------------------------------
PARALLELISM_WEIGHTS = {"pp": 0.45, "tp": 0.3, "ep": 0.25}
PP_STAGES = (2, 16)
RUNNING_CAP = (8, 1024)
EP_DP_SIZES = (1, 2, 4, 8)
EP_MIN_PER_RANK = 4  # ep: at least this many requests per data-parallel rank at the cap
SINGLE_ITL_MS = (5.0, 100.0)  # a lone request's inter-token latency
COST_RATIO = (0.1, 10.0)  # per-request part of a full pass / its fixed part (log-uniform)
HOP_SHARE = (0.15, 0.6)  # pp: stage hand-offs' share of a lone request's loop
OVERHEAD_SHARE = (0.2, 0.6)  # of the fixed part: step_overhead_ms (the rest weights_ms)
MOE_SHARE = 0.5  # shapes whose per-request cost is partly the saturating expert-read term
MOE_PART = (0.2, 0.7)  # ...and how much of it
PROMPT_LEN = (32, 8192)
OUTPUT_MEAN = (16, 1024)
OUTPUT_SPREAD = (0.2, 0.6)  # answers drawn from mean * (1 -+ spread)
PREFILL_FRACTION = (0.01, 0.7)  # target share of busy time spent in prefill at capacity
PREFILL_MS_PER_TOKEN = (0.002, 2.0)  # 500 000 to 500 prompt tokens/s
MAX_PROMPT_PREFILL_MS = 4000.0  # one prompt's prefill
KV_BOUND_SHARE = 0.5
KV_BOUND_AT = (0.15, 0.8)  # kv-bound: the pool holds this fraction of the running cap
KV_ROOM = (1.3, 4.0)  # cap-bound: the pool holds this multiple of the running cap
NEW_TOKEN_RATIOS = (0.0, 0.1, 0.3, 0.5)
CHUNKED_PREFILL_SIZES = (2048, 4096, 8192)
NOISY_SHARE = 0.75
STEP_NOISE = (0.03, 0.3)
#: context beyond the workload's prompt and longest answer: a chat template's tokens around the
#: prompt (the context length only validates requests; the engine never reads it)
CHAT_ROOM = 64

# --- affordability (redraw beyond these) ---------------------------------------------------
MAX_TOKENS_PER_S = 3000.0  # output tokens/s at capacity
MAX_TOKENS_IN_FLIGHT = 30_000  # capacity x mean answer: tokens of one generation of requests
MAX_LOADED_ITL_S = 0.5  # inter-token latency at capacity
MAX_ATTEMPTS = 1000

# --- labels in a shape's name --------------------------------------------------------------
FIXED_COST_BELOW = 0.5  # cost_ratio below: "fixedcost"; above PER_REQUEST_COST_ABOVE: "perreq"
PER_REQUEST_COST_ABOVE = 2.0
LIGHT_PREFILL_BELOW = 0.1
HEAVY_PREFILL_ABOVE = 0.3
SHORT_OUTPUT_BELOW = 128
LONG_OUTPUT_ABOVE = 512


@dataclass(frozen=True, slots=True)
class SeedRange:
    """A split's seeds: ``start`` up to (not including) ``stop``; ``default`` shapes by default."""

    start: int
    stop: int
    default: int


SPLITS: dict[str, SeedRange] = {
    "tune": SeedRange(0, 1000, 60),
    "accept": SeedRange(1000, 1_000_000_000, 200),
}


def split_seeds(split: str, n: int | None = None, base: int | None = None) -> list[int]:
    """``n`` seeds of ``split`` from ``base`` (default: the split's start); never outside it,
    so a tune run can never draw an accept shape."""
    r = SPLITS[split]
    n = r.default if n is None else n
    base = r.start if base is None else base
    if n < 1 or base < r.start or base + n > r.stop:
        raise ValueError(f"split {split!r} has seeds {r.start}..{r.stop - 1}; asked {base}+{n}")
    return list(range(base, base + n))


@dataclass(frozen=True, slots=True)
class Estimate:
    """What a profile should do under a workload, from its cost model (for sizing runs).

    ``capacity`` is the most requests it runs at once: the running cap, or fewer if the KV pool
    or prefill binds first. ``kv_capacity`` counts each running request at its prompt, half its
    answer and the ``new_token_ratio`` reserve on the other half (requests at evenly spread
    progress). ``prefill_capacity``: a pass prefills at most ``chunked_prefill_size`` prompt
    tokens, so at most chunk / prompt requests join a batch (pp: a micro-batch) per pass, and
    each stays for its answer's passes; with long prompts and short answers more requests only
    wait in the engine's queue.
    """

    running_cap: int
    kv_capacity: int
    prefill_capacity: int
    capacity: int
    single_itl_s: float
    loaded_itl_s: float  # decode only, at capacity
    prefill_fraction: float  # of busy time at capacity
    request_s: float  # one request at capacity, prefill included
    tokens_per_s: float  # output tokens/s at capacity
    cost_ratio: float  # per-request part of a full pass / its fixed part

    @property
    def binding(self) -> Literal["cap", "kv", "prefill"]:
        """What bounds the capacity first (the running cap on a tie)."""
        if self.capacity == self.running_cap:
            return "cap"
        return "kv" if self.capacity == self.kv_capacity else "prefill"

    @property
    def kv_bound(self) -> bool:
        """The KV pool binds before the running cap (whether or not prefill binds sooner)."""
        return self.kv_capacity < self.running_cap


def estimate(profile: Profile, input_len: int, output_len: tuple[int, int]) -> Estimate:
    """Capacity, latencies and token rate of ``profile`` for this workload (closed loop)."""
    p = profile
    s = p.stages
    mean_out = (output_len[0] + output_len[1]) / 2
    running_cap = s * p.micro_batch_cap if p.parallelism == "pp" else p.max_running_requests
    running_cap = min(running_cap, p.max_running_requests)
    per_request_kv = input_len + (1 + p.new_token_ratio) / 2 * mean_out
    kv_capacity = max(1, int(p.max_total_tokens / per_request_kv))
    joins_per_pass = p.chunked_prefill_size / input_len
    passes = mean_out + math.ceil(input_len / p.chunked_prefill_size)  # a request's lifetime
    prefill_capacity = max(1, int(s * joins_per_pass * passes))
    capacity = min(running_cap, kv_capacity, prefill_capacity)

    def loop_s(batch: int) -> float:  # one pass of `batch` requests, and for pp the hand-offs
        ms = step_cost_ms(p, batch)
        if p.parallelism == "pp":
            ms += s * handoff_ms(p, batch)
        return ms / 1000.0

    batch = math.ceil(capacity / s)  # pp: requests per micro-batch
    full_batch = p.micro_batch_cap
    fixed_ms = step_cost_ms(p, 0)
    cost_ratio = (step_cost_ms(p, full_batch) - fixed_ms) / fixed_ms if fixed_ms else math.inf
    prompt_ms = input_len * p.prefill_ms_per_token
    decode_ms = mean_out * step_cost_ms(p, batch) / batch
    prefill_fraction = prompt_ms / (prompt_ms + decode_ms)
    loaded = loop_s(batch)
    request_s = prompt_ms / 1000.0 + mean_out * loaded / (1.0 - prefill_fraction)
    return Estimate(
        running_cap=running_cap,
        kv_capacity=kv_capacity,
        prefill_capacity=prefill_capacity,
        capacity=capacity,
        single_itl_s=loop_s(1),
        loaded_itl_s=loaded,
        prefill_fraction=prefill_fraction,
        request_s=request_s,
        tokens_per_s=capacity * mean_out / request_s,
        cost_ratio=cost_ratio,
    )


@dataclass(frozen=True, slots=True)
class Shape:
    """One generated backend: the engine, the workload its clients send, and its estimate."""

    seed: int
    profile: Profile
    input_len: int
    output_len: tuple[int, int]  # each request's answer length is drawn from this range
    est: Estimate

    @property
    def name(self) -> str:
        return self.profile.name


def generate_shape(seed: int) -> Shape:
    """The shape for ``seed``: the same in every process and on every run."""
    rng = random.Random(stable_seed(seed, "backend-shape"))
    for _ in range(MAX_ATTEMPTS):
        shape = _draw(rng, seed)
        if shape is not None:
            return shape
    raise RuntimeError(f"seed {seed}: no affordable shape in {MAX_ATTEMPTS} draws")


def generate_shapes(split: str, n: int | None = None, base: int | None = None) -> list[Shape]:
    return [generate_shape(seed) for seed in split_seeds(split, n, base)]


def _log_uniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def _draw(rng: random.Random, seed: int) -> Shape | None:
    """One attempt: a full shape, or None if it is not affordable to simulate."""
    kinds = list(PARALLELISM_WEIGHTS)
    parallelism = rng.choices(kinds, weights=[PARALLELISM_WEIGHTS[k] for k in kinds])[0]
    stages = rng.randint(*PP_STAGES) if parallelism == "pp" else 1
    drawn = _log_uniform(rng, max(RUNNING_CAP[0], 2 * stages), RUNNING_CAP[1])
    # requests in the largest pass (pp: one micro-batch); pp's cap is a whole number of full
    # micro-batches, so that the cap is what it says, and stays within RUNNING_CAP
    lo, hi = math.ceil(RUNNING_CAP[0] / stages), RUNNING_CAP[1] // stages
    pass_cap = min(max(round(drawn / stages), lo, 2), hi)
    cap = pass_cap * stages
    dp = 1
    if parallelism == "ep":
        dp = rng.choice([d for d in EP_DP_SIZES if d * EP_MIN_PER_RANK <= pass_cap])
    single_itl_ms = _log_uniform(rng, *SINGLE_ITL_MS)
    ratio = _log_uniform(rng, *COST_RATIO)
    hop_share = rng.uniform(*HOP_SHARE) if parallelism == "pp" else 0.0
    moe_part = rng.uniform(*MOE_PART) if rng.random() < MOE_SHARE else 0.0
    overhead_share = rng.uniform(*OVERHEAD_SHARE)

    base = Profile(
        name="draft",
        model_name="draft",
        parallelism=parallelism,
        pp_size=stages,
        dp_size=dp,
        context_length=2,
        max_running_requests=cap,
        max_total_tokens=2,
        step_overhead_ms=0.0,
        weights_ms=0.0,
        expert_read_ms=0.0,
        compute_ms_per_token=0.0,
        prefill_ms_per_token=0.0,
    )
    # A full pass costs fixed * (1 + ratio); its per-request part is split between per-token
    # compute (linear; for ep per token of the busiest of dp ranks) and expert reads, which
    # grow as active_experts(b)/k: exactly 1 at b = 1, `saturation` at the full pass.
    saturation = active_experts(base, pass_cap) / base.experts_per_token
    fixed = (
        single_itl_ms
        * (1 - hop_share)
        / (1 + ratio * ((1 - moe_part) * dp / pass_cap + moe_part / saturation))
    )
    per_request = ratio * fixed

    input_len = round(_log_uniform(rng, *PROMPT_LEN))
    mean_out = _log_uniform(rng, *OUTPUT_MEAN)
    spread = rng.uniform(*OUTPUT_SPREAD)
    output_len = (max(1, round(mean_out * (1 - spread))), max(2, round(mean_out * (1 + spread))))
    mean_out = sum(output_len) / 2
    new_token_ratio = rng.choice(NEW_TOKEN_RATIOS)
    per_request_kv = input_len + (1 + new_token_ratio) / 2 * mean_out
    if rng.random() < KV_BOUND_SHARE:
        fits = max(2, round(cap * rng.uniform(*KV_BOUND_AT)))
    else:
        fits = cap * rng.uniform(*KV_ROOM)
    max_total_tokens = max(math.ceil(fits * per_request_kv), input_len + output_len[1] + 1)

    profile = base.with_overrides(
        context_length=input_len + output_len[1] + CHAT_ROOM,
        max_total_tokens=max_total_tokens,
        new_token_ratio=new_token_ratio,
        chunked_prefill_size=rng.choice(CHUNKED_PREFILL_SIZES),
        step_overhead_ms=fixed * overhead_share,
        weights_ms=fixed * (1 - overhead_share),
        expert_read_ms=moe_part * per_request / saturation,
        compute_ms_per_token=(1 - moe_part) * per_request * dp / pass_cap,
        p2p_latency_ms=single_itl_ms * hop_share / stages,
    )
    # prefill: per prompt token, so that prefill takes the drawn share of busy time at capacity
    est = estimate(profile, input_len, output_len)
    batch = math.ceil(est.capacity / stages)
    decode_ms = mean_out * step_cost_ms(profile, batch) / batch
    share = _log_uniform(rng, *PREFILL_FRACTION)
    prefill_ms = share / (1 - share) * decode_ms / input_len
    prefill_ms = min(max(prefill_ms, PREFILL_MS_PER_TOKEN[0]), PREFILL_MS_PER_TOKEN[1])
    prefill_ms = min(prefill_ms, MAX_PROMPT_PREFILL_MS / input_len)
    noise = _log_uniform(rng, *STEP_NOISE) if rng.random() < NOISY_SHARE else 0.0
    profile = profile.with_overrides(prefill_ms_per_token=prefill_ms, step_noise=noise)

    est = estimate(profile, input_len, output_len)
    if (
        est.tokens_per_s > MAX_TOKENS_PER_S
        or est.loaded_itl_s > MAX_LOADED_ITL_S
        or est.capacity * mean_out > MAX_TOKENS_IN_FLIGHT
    ):
        return None
    name = _name(seed, profile, est, mean_out)
    profile = profile.with_overrides(
        name=name,
        model_name=f"sim/{name}",
        description=(
            f"generated shape (seed {seed}): capacity {est.capacity}, lone ITL "
            f"{est.single_itl_s * 1000:.0f} ms, {input_len}-token prompts, "
            f"{output_len[0]}-{output_len[1]}-token answers"
        ),
    )
    return Shape(seed, profile, input_len, output_len, est)


def _name(seed: int, p: Profile, est: Estimate, mean_out: float) -> str:
    """E.g. ``s17-pp6-cap96-kv40-perreq-prefillheavy-out200-noise0.10``: seed, stages, running
    cap, what binds first (``capbound``, ``kvN`` or ``chunkN``: the KV pool or the prefill
    budget at N requests), step cost, prefill, mean answer, noise."""
    kind = f"pp{p.pp_size}" if p.parallelism == "pp" else p.parallelism
    if p.parallelism == "ep" and p.dp_size > 1:
        kind += f"dp{p.dp_size}"
    parts = [f"s{seed}", kind, f"cap{p.max_running_requests}"]
    parts.append(
        {"cap": "capbound", "kv": f"kv{est.capacity}", "prefill": f"chunk{est.capacity}"}[
            est.binding
        ]
    )
    if est.cost_ratio < FIXED_COST_BELOW:
        parts.append("fixedcost")
    elif est.cost_ratio > PER_REQUEST_COST_ABOVE:
        parts.append("perreq")
    else:
        parts.append("mixedcost")
    if est.prefill_fraction > HEAVY_PREFILL_ABOVE:
        parts.append("prefillheavy")
    elif est.prefill_fraction < LIGHT_PREFILL_BELOW:
        parts.append("prefilllight")
    if mean_out < SHORT_OUTPUT_BELOW:
        parts.append(f"short{round(mean_out)}")
    elif mean_out > LONG_OUTPUT_ABOVE:
        parts.append(f"long{round(mean_out)}")
    else:
        parts.append(f"out{round(mean_out)}")
    if p.step_noise > 0:
        parts.append(f"noise{p.step_noise:.2f}")
    return "-".join(parts)
