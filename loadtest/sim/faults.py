"""Fault injection for the simulator: set by CLI flags, changed at run time via /sim/faults.

Faults are what a proxy must survive in production: a backend answering 5xx before the
stream starts, a stream that stops mid-way without closing (stall), a connection dropped
mid-stream, health checks that are slow or failing, and a start-up period during which
the server is not ready (``/health`` 503).

Each request draws its fate once, when it arrives, from a seeded RNG, so a run with the
same seed and the same request order injects the same faults.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

Fate = Literal["ok", "error", "stall", "drop"]


class FaultConfig(BaseModel):
    """The fault settings of one simulated backend (all off by default)."""

    model_config = ConfigDict(extra="forbid")

    error_rate: float = Field(0.0, ge=0.0, le=1.0, description="share of requests answered 5xx")
    error_status: int = Field(503, ge=500, le=599, description="HTTP status of injected errors")
    stall_rate: float = Field(0.0, ge=0.0, le=1.0, description="share of streams that stall")
    stall_after_tokens: int = Field(1, ge=0, description="tokens sent before a stall or drop")
    drop_rate: float = Field(0.0, ge=0.0, le=1.0, description="share of streams cut mid-way")
    health_delay_s: float = Field(0.0, ge=0.0, description="wall seconds before health answers")
    health_fail: bool = Field(False, description="health checks answer 503")
    startup_s: float = Field(0.0, ge=0.0, description="wall seconds /health is 503 after start")


@dataclass(frozen=True, slots=True)
class Decision:
    fate: Fate
    after_tokens: int = 0
    status: int = 503


class Faults:
    """Current fault settings plus the RNG that decides each request's fate."""

    def __init__(self, config: FaultConfig | None = None, seed: int = 0) -> None:
        self.config = config or FaultConfig()
        self._rng = random.Random(seed ^ 0x5EED)
        self.started_at = time.monotonic()
        self.injected: dict[str, int] = {"error": 0, "stall": 0, "drop": 0}

    def update(self, changes: dict) -> FaultConfig:
        """Apply a partial update; raises ``ValueError`` with a readable message if invalid."""
        if not isinstance(changes, dict):
            raise ValueError("fault settings must be a JSON object")
        merged = {**self.config.model_dump(), **changes}
        try:
            self.config = FaultConfig.model_validate(merged)
        except ValidationError as exc:
            raise ValueError(_short(exc)) from None
        if "startup_s" in changes:  # a new start-up period begins now
            self.started_at = time.monotonic()
        return self.config

    def reset(self) -> FaultConfig:
        self.config = FaultConfig()
        return self.config

    @property
    def starting(self) -> bool:
        return time.monotonic() - self.started_at < self.config.startup_s

    def decide(self, stream: bool) -> Decision:
        """The fate of one generation request (stall and drop only apply to streams)."""
        c = self.config
        if c.error_rate and self._rng.random() < c.error_rate:
            self.injected["error"] += 1
            return Decision("error", status=c.error_status)
        if stream and c.stall_rate and self._rng.random() < c.stall_rate:
            self.injected["stall"] += 1
            return Decision("stall", after_tokens=c.stall_after_tokens)
        if stream and c.drop_rate and self._rng.random() < c.drop_rate:
            self.injected["drop"] += 1
            return Decision("drop", after_tokens=c.stall_after_tokens)
        return Decision("ok")

    def snapshot(self) -> dict:
        return {**self.config.model_dump(), "starting": self.starting, "injected": self.injected}


def _short(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors()
    )


def add_fault_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("fault injection (also changeable at run time: POST /sim/faults)")
    g.add_argument(
        "--fault-error-rate",
        type=float,
        default=0.0,
        metavar="P",
        help="share of generation requests answered with a 5xx before streaming",
    )
    g.add_argument(
        "--fault-error-status",
        type=int,
        default=503,
        metavar="CODE",
        help="HTTP status of injected errors (default 503)",
    )
    g.add_argument(
        "--fault-stall-rate",
        type=float,
        default=0.0,
        metavar="P",
        help="share of streams that stop sending mid-way and never finish",
    )
    g.add_argument(
        "--fault-drop-rate",
        type=float,
        default=0.0,
        metavar="P",
        help="share of streams whose connection is closed mid-way",
    )
    g.add_argument(
        "--fault-after-tokens",
        type=int,
        default=1,
        metavar="N",
        help="tokens sent before a stall or drop (default 1)",
    )
    g.add_argument(
        "--fault-health-delay",
        type=float,
        default=0.0,
        metavar="S",
        help="seconds before /health and /health_generate answer",
    )
    g.add_argument(
        "--fault-health-fail", action="store_true", help="/health and /health_generate answer 503"
    )
    g.add_argument(
        "--startup-delay",
        type=float,
        default=0.0,
        metavar="S",
        help="seconds after start during which /health answers 503 (not ready)",
    )


def config_from_args(args: argparse.Namespace) -> FaultConfig:
    """Raises ``ValueError`` with a one-line message for out-of-range values."""
    try:
        return FaultConfig(
            error_rate=args.fault_error_rate,
            error_status=args.fault_error_status,
            stall_rate=args.fault_stall_rate,
            drop_rate=args.fault_drop_rate,
            stall_after_tokens=args.fault_after_tokens,
            health_delay_s=args.fault_health_delay,
            health_fail=args.fault_health_fail,
            startup_s=args.startup_delay,
        )
    except ValidationError as exc:
        raise ValueError(_short(exc)) from None
