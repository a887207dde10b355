"""Duck-typed backends for policy/admission/scrape tests (no dependency on proxy/backends.py)."""

from __future__ import annotations

from proxy.limits import FixedLimit
from proxy.stats import BackendStats


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


class FakeBackend:
    def __init__(
        self,
        name: str,
        limit: int = 4,
        *,
        weight: float = 1.0,
        trusted: bool = True,
        clock=None,
        url: str = "",
        limit_obj=None,
    ) -> None:
        self.name = name
        self.url = url
        self.api_key: str | None = None
        self.weight = weight
        self.routable = True
        self.in_flight = 0
        self.limit = limit_obj if limit_obj is not None else FixedLimit(limit)
        self.stats = BackendStats(clock=clock) if clock is not None else BackendStats()
        if trusted:
            self.stats.observe_first_byte()

    def __repr__(self) -> str:
        return f"FakeBackend({self.name})"
