"""Simulator profiles: one deployment's capacity and cost model, as data (config/profiles/*.toml).

Every duration parameter is in milliseconds (or microseconds where the name says `_us`) of
modelled time. How they combine into a step time is in `loadtest/sim/engine.py` (`step_cost`)
and docs/simulator-engine.md.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

PROFILE_DIR = Path(__file__).resolve().parents[2] / "config" / "profiles"
PROFILE_NAMES = ("tp8", "pp8", "ep8")


class ProfileError(ValueError):
    """A profile that cannot be found or does not validate (one-line message)."""


class Profile(BaseModel):
    """A simulated SGLang deployment."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # --- identity -------------------------------------------------------------------------
    name: str = Field(description="profile name, e.g. tp8")
    description: str = Field("", description="one line shown by `loadtest sim --help`")
    model_name: str = Field(description="served model id (/v1/models, model_name label)")
    parallelism: Literal["tp", "pp", "ep"] = Field(description="which step-cost model applies")
    tp_size: int = Field(1, ge=1)
    pp_size: int = Field(1, ge=1, description="pipeline stages S (pp profiles)")
    ep_size: int = Field(1, ge=1)
    dp_size: int = Field(
        1, ge=1, description="data-parallel attention ranks (/get_load rows, dp_rank series)"
    )
    priority_scheduling: bool = Field(
        False,
        description="as --enable-priority-scheduling: running/queue gauges are written as a "
        'total (priority="") and again per priority',
    )

    # --- capacity -------------------------------------------------------------------------
    context_length: int = Field(ge=2, description="longest prompt + output, tokens")
    max_running_requests: int = Field(ge=1, description="cap on requests in running batches")
    max_total_tokens: int = Field(ge=2, description="KV pool size, tokens (prompt + generated)")
    chunked_prefill_size: int = Field(
        8192, ge=1, description="prefill tokens one step may process; longer prompts are chunked"
    )
    new_token_ratio: float = Field(
        0.3,
        ge=0.0,
        le=1.0,
        description="admission reserves this fraction of every running request's remaining "
        "max_new_tokens in the KV pool (SGLang's new_token_ratio); 0 = admit on prompt fit only",
    )
    decode_log_interval: int = Field(40, ge=1, description="decode steps between gauge updates")
    pp_async_batch_depth: int = Field(0, ge=0, description="extra micro-batch slots (pp)")
    pp_max_micro_batch_size: int | None = Field(
        None, ge=1, description="requests per micro-batch; default max(max_running // S, 1)"
    )

    # --- cost model: compute (whole model, all layers) ------------------------------------
    num_layers: int = Field(61, ge=1)
    step_overhead_ms: float = Field(
        ge=0, description="per step (per micro-batch per full pass for pp): launch, scheduling"
    )
    weights_ms: float = Field(
        ge=0, description="per step: streaming dense + shared-expert weights (batch independent)"
    )
    num_experts: int = Field(384, ge=1, description="routed experts per MoE layer (physical)")
    effective_experts: float = Field(
        100.0,
        gt=0,
        description="equally popular experts that give the same distinct-expert count as the "
        "real, skewed routing (smaller than num_experts); used in the expert-read term",
    )
    experts_per_token: int = Field(8, ge=1, description="top-k routed experts per token")
    expert_read_ms: float = Field(
        ge=0,
        description="per step: streaming the routed experts ONE token activates (all layers); "
        "a batch of b tokens activates E*(1-(1-k/E)^b) distinct experts (E = effective_experts, "
        "k = experts_per_token), so this term grows "
        "almost linearly at small batch and saturates at large batch",
    )
    compute_ms_per_token: float = Field(
        ge=0, description="per decoded token per step: attention, KV reads, dense FLOPs"
    )
    prefill_ms_per_token: float = Field(ge=0, description="per prompt token prefilled")

    # --- cost model: communication -------------------------------------------------------
    comm_ops_per_layer: int = Field(
        2, ge=0, description="tp: all-reduces per layer; ep: all-to-alls (dispatch+combine)"
    )
    comm_latency_us: float = Field(
        0.0, ge=0, description="tp/ep: fixed latency of one collective (per layer per op)"
    )
    comm_us_per_token: float = Field(
        0.0, ge=0, description="tp/ep: bandwidth cost of one collective per token in the batch"
    )
    p2p_latency_ms: float = Field(
        0.0, ge=0, description="pp: hand-off of a micro-batch from one stage to the next"
    )
    p2p_us_per_token: float = Field(0.0, ge=0, description="pp: per-token hand-off cost")

    # --- cost model: noise ----------------------------------------------------------------
    step_noise: float = Field(
        0.0,
        ge=0,
        le=1,
        description="sigma of a log-normal factor (mean 1) multiplying every pass's cost, drawn "
        "per pass from the scheduler's seed: real step times jitter (kernels, host scheduling, "
        "collectives), and a limit tuned on noise-free steps can over-read small differences; "
        "0 = every pass costs exactly step_cost_ms",
    )

    # --- natural output lengths (ignore_eos = false) ---------------------------------------
    output_len_median: float = Field(
        256.0, gt=0, description="median natural answer length (log-normal), tokens"
    )
    output_len_sigma: float = Field(0.8, ge=0, description="log-normal sigma of answer length")
    output_len_min: int = Field(1, ge=1, description="shortest natural answer, tokens")

    @model_validator(mode="after")
    def _check(self) -> Profile:
        if self.parallelism == "pp" and self.pp_size < 2:
            raise ValueError("a pp profile needs pp_size >= 2")
        if self.parallelism != "pp" and self.pp_size != 1:
            raise ValueError("only pp profiles may set pp_size > 1")
        if self.experts_per_token > min(self.num_experts, self.effective_experts):
            raise ValueError("experts_per_token cannot exceed num_experts or effective_experts")
        return self

    # --- derived ---------------------------------------------------------------------------
    @property
    def stages(self) -> int:
        """Pipeline stages S (1 unless pp)."""
        return self.pp_size if self.parallelism == "pp" else 1

    @property
    def num_slots(self) -> int:
        """Micro-batch slots the scheduler cycles through (S + async depth for pp, else 1)."""
        return self.pp_size + self.pp_async_batch_depth if self.parallelism == "pp" else 1

    @property
    def micro_batch_cap(self) -> int:
        """Most requests one micro-batch (slot) holds."""
        if self.parallelism != "pp":
            return self.max_running_requests
        if self.pp_max_micro_batch_size is not None:
            return self.pp_max_micro_batch_size
        return max(self.max_running_requests // self.pp_size, 1)

    def with_overrides(self, **changes: object) -> Profile:
        """A validated copy with some fields changed (tests, `--set`-style tweaks)."""
        return Profile.model_validate({**self.model_dump(), **changes})


def profile_path(name_or_path: str) -> Path:
    if name_or_path in PROFILE_NAMES or (
        "/" not in name_or_path and not name_or_path.endswith(".toml")
    ):
        return PROFILE_DIR / f"{name_or_path}.toml"
    return Path(name_or_path)


def load_profile(name_or_path: str) -> Profile:
    """A profile by name (tp8|pp8|ep8, from config/profiles/) or from a .toml path."""
    path = profile_path(name_or_path)
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in PROFILE_DIR.glob("*.toml"))) or "none"
        raise ProfileError(f"no profile {name_or_path!r} (known: {known}; or give a .toml path)")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"{path}: invalid TOML: {exc}") from None
    data.setdefault("name", path.stem)
    try:
        return Profile.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "profile"
        raise ProfileError(f"{path}: {where}: {first['msg']}") from None
