"""Backends and the pool that holds them.

A :class:`Backend` is one SGLang server: its configuration, its health state, the proxy's
in-flight count for it, its concurrency ``limit`` (proxy/limits.py) and its ``stats``
(proxy/stats.py, where every observation lands). The :class:`BackendPool` adds, drains and
removes backends; a backend being removed stays in ``all()`` until its last request finished,
so no stream in flight is cut.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterator
from typing import Any

from proxy.settings import BackendSettings, LimitSettings
from proxy.stats import BackendStats


class State(enum.StrEnum):
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"
    PROBING = "probing"  # half-open: new, or back from ejection; one request at a time
    DRAINING = "draining"  # no new traffic; removed once idle if ``removing``


class Backend:
    __slots__ = (
        "api_key",
        "check_failures",
        "check_successes",
        "consecutive_failures",
        "ejected_until",
        "ejections",
        "fresh",
        "in_flight",
        "last_check_error",
        "limit",
        "models",
        "models_at",
        "name",
        "parallelism",
        "pp_size",
        "removing",
        "settings",
        "state",
        "state_since",
        "stats",
        "url",
        "weight",
    )

    def __init__(self, settings: BackendSettings, *, limit: Any, stats: BackendStats) -> None:
        self.settings = settings
        self.name: str = settings.name  # type: ignore[assignment]
        self.url = settings.url
        self.weight = settings.weight
        self.parallelism = settings.parallelism
        self.pp_size = settings.pp_size
        self.api_key = settings.api_key
        self.limit = limit
        self.stats = stats
        self.in_flight = 0
        self.state = State.PROBING
        self.state_since = time.monotonic()
        self.removing = False
        self.consecutive_failures = 0  # passive: request failures in a row
        self.check_failures = 0  # active: failed health checks in a row
        self.check_successes = 0
        self.ejected_until = 0.0
        self.ejections = 0
        self.fresh = True  # never unhealthy yet
        self.last_check_error: str | None = None
        self.models: list[dict] = []
        self.models_at = 0.0  # monotonic time /v1/models was last read

    @property
    def routable(self) -> bool:
        """May take a new request now (half-open allows one at a time)."""
        state = self.state
        if state is State.HEALTHY:
            return True
        return state is State.PROBING and self.in_flight == 0

    @property
    def healthy(self) -> bool:
        return self.state is State.HEALTHY

    def set_state(self, state: State) -> bool:
        if state is self.state:
            return False
        self.state = state
        self.state_since = time.monotonic()
        return True

    def describe(self) -> dict:
        out = {
            "name": self.name,
            "url": self.url,
            "state": self.state.value,
            "routable": self.routable,
            "removing": self.removing,
            "in_flight": self.in_flight,
            "limit": self.limit.limit,
            "weight": self.weight,
            "parallelism": self.parallelism,
            "pp_size": self.pp_size,
            "state_age_s": round(time.monotonic() - self.state_since, 3),
            "consecutive_failures": self.consecutive_failures,
            "ejections": self.ejections,
            "last_check_error": self.last_check_error,
            "models": [m.get("id") for m in self.models],
        }
        out["limit_state"] = self.limit.snapshot()
        out["stats"] = self.stats.snapshot()
        return out

    def __repr__(self) -> str:
        return (
            f"Backend({self.name!r}, {self.url!r}, {self.state.value}, in_flight={self.in_flight})"
        )


LimitFactory = Callable[[LimitSettings, BackendSettings], Any]


def default_limit_factory(limits: LimitSettings, backend: BackendSettings) -> Any:
    """proxy/limits.py's ``make_limit``; given the merged [limits] and the backend's hints."""
    from proxy.limits import make_limit

    return make_limit(limits, parallelism=backend.parallelism, pp_size=backend.pp_size)


class BackendPool:
    """The set of backends. ``on_change`` is called whenever routability may have changed."""

    def __init__(
        self,
        limit_factory: Callable[[BackendSettings], Any],
        *,
        stats_factory: Callable[[BackendSettings], BackendStats] | None = None,
    ) -> None:
        self._limit_factory = limit_factory
        self._stats_factory = stats_factory or (lambda _b: BackendStats())
        self._backends: dict[str, Backend] = {}
        self._leaving: list[Backend] = []
        self.listeners: list[Callable[[Backend | None], None]] = []

    def __iter__(self) -> Iterator[Backend]:
        return iter(self.all())

    def __len__(self) -> int:
        return len(self._backends)

    def __contains__(self, name: str) -> bool:
        return name in self._backends

    def get(self, name: str) -> Backend | None:
        return self._backends.get(name)

    def all(self) -> list[Backend]:
        """Every backend, including removed ones still finishing their last requests."""
        if self._leaving:
            return [*self._backends.values(), *self._leaving]
        return list(self._backends.values())

    def names(self) -> list[str]:
        return list(self._backends)

    def routable(self) -> list[Backend]:
        return [b for b in self._backends.values() if b.routable]

    def any_healthy(self) -> bool:
        return any(b.state is State.HEALTHY for b in self._backends.values())

    def changed(self, backend: Backend | None = None) -> None:
        for listener in self.listeners:
            listener(backend)

    def add(self, settings: BackendSettings) -> Backend:
        if settings.name in self._backends:
            raise KeyError(f"backend {settings.name!r} exists")
        backend = Backend(
            settings, limit=self._limit_factory(settings), stats=self._stats_factory(settings)
        )
        self._backends[backend.name] = backend
        self.changed(backend)
        return backend

    def drain(self, name: str) -> Backend:
        backend = self._require(name)
        backend.set_state(State.DRAINING)
        self.changed(backend)
        return backend

    def undrain(self, name: str) -> Backend:
        backend = self._require(name)
        if backend.state is State.DRAINING:
            backend.set_state(State.PROBING)
            self.changed(backend)
        return backend

    def remove(self, name: str) -> Backend:
        """Take a backend out: it gets no new requests and leaves once its last one ended.
        Its name is free at once (a replacement may be added while it drains)."""
        backend = self._backends.pop(self._require(name).name)
        backend.removing = True
        backend.set_state(State.DRAINING)
        if backend.in_flight > 0:
            self._leaving.append(backend)
        self.changed(None)
        return backend

    def reap(self, backend: Backend | None = None) -> None:
        """Forget removed backends whose last request finished."""
        if self._leaving:
            self._leaving = [b for b in self._leaving if b.in_flight > 0]

    def _require(self, name: str) -> Backend:
        backend = self._backends.get(name)
        if backend is None:
            raise KeyError(f"no backend named {name!r}")
        return backend
