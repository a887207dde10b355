"""A backend as the request path's decisions see it: admission binds to it, the control loop
feeds its limit, the policies rank it, the scraper reads it. proxy/backends.py's ``Backend`` is
the real one; tests and the virtual-time harness pass their own."""

from __future__ import annotations

from typing import Protocol

from proxy.limits import Limit
from proxy.stats import BackendStats


class Routed(Protocol):
    name: str
    weight: float
    in_flight: int
    limit: Limit
    stats: BackendStats

    @property
    def routable(self) -> bool: ...


def relative_load(b: Routed) -> float:
    """In flight with one more, for the backend's limit: how full one more request leaves it
    (the latency policy's tie-break: of two idle backends, the one with the larger limit)."""
    return (b.in_flight + 1) / max(b.limit.limit, 1)


def busy_share(b: Routed) -> float:
    """The share of its limit ``b`` has in flight now: zero on every idle backend, whatever its
    limit, so that an idle fleet ties (prefix routing spreads new groups by their hash there,
    not onto the backend whose limit grew first)."""
    return b.in_flight / max(b.limit.limit, 1)


class Scraped(Protocol):
    """What the scraper needs besides the stats it fills."""

    name: str
    url: str
    api_key: str | None
    stats: BackendStats
