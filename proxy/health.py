"""Backend health: active checks, passive ejection and half-open recovery.

States (proxy/backends.State): a new backend is PROBING (half-open: one request at a time)
until its first check passes. HEALTHY -> UNHEALTHY after ``unhealthy_threshold`` failed checks,
or at once (ejection, for ``eject_s`` doubling per repeat up to 16x) after ``passive_failures``
request failures in a row. After an ejection, or on the first passing check of an unhealthy
backend, it is PROBING again: one successful request or ``healthy_threshold`` passing checks in
a row make it HEALTHY, one failure makes it UNHEALTHY. DRAINING is only left through the admin API.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import aiohttp
import orjson

from proxy.backends import Backend, BackendPool, State
from proxy.logs import OPS
from proxy.metrics import Metrics
from proxy.settings import HealthSettings
from proxy.tasks import stop_task

log = logging.getLogger("pipefill.health")


class Health:
    def __init__(
        self,
        pool: BackendPool,
        settings: HealthSettings,
        session: aiohttp.ClientSession,
        metrics: Metrics,
    ) -> None:
        self.pool = pool
        self.settings = settings
        self.session = session
        self.metrics = metrics
        self._task: asyncio.Task | None = None
        self._kick = asyncio.Event()
        self._timeout = aiohttp.ClientTimeout(total=settings.timeout_s)

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="pipefill-health")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await stop_task(task)

    def kick(self) -> None:
        """Check now (a backend was added or changed)."""
        self._kick.set()

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(b) for b in self.pool.all()))

    async def _run(self) -> None:
        while True:
            try:
                await self.check_all()
                for b in self.pool.all():
                    self.pool.reap(b)
            except Exception:  # never let the checker die
                log.exception("health loop")
            self._kick.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.settings.interval_s):
                    await self._kick.wait()

    # ---- active checks ---------------------------------------------------------------------

    async def check(self, b: Backend) -> None:
        if b.state is State.DRAINING:
            return
        now = time.monotonic()
        if b.state is State.UNHEALTHY and now < b.ejected_until:
            return
        ok, error = await self._probe(b)
        self.metrics.health_checks.labels(b.name, "ok" if ok else "fail").inc()
        if self.pool.get(b.name) is not b or b.state is State.DRAINING:
            return
        if ok:
            b.last_check_error = None
            b.check_failures = 0
            b.check_successes += 1
            if b.state is State.UNHEALTHY:
                b.ejected_until = 0.0
                self._set(b, State.PROBING, "check passed")
            # A new backend that never failed is trusted on its first passing check.
            if b.state is State.PROBING and (
                b.fresh or b.check_successes >= self.settings.healthy_threshold
            ):
                self._set(b, State.HEALTHY, "checks passed")
            if b.state is State.HEALTHY and (
                not b.models or time.monotonic() - b.models_at >= self.settings.models_refresh_s
            ):
                await self._fetch_models(b)
        else:
            b.last_check_error = error
            b.check_successes = 0
            b.check_failures += 1
            if b.state is State.PROBING or (
                b.state is State.HEALTHY and b.check_failures >= self.settings.unhealthy_threshold
            ):
                self._set(b, State.UNHEALTHY, f"check failed: {error}")

    async def _probe(self, b: Backend) -> tuple[bool, str | None]:
        try:
            async with self.session.get(
                b.url + self.settings.path, timeout=self._timeout, headers=_auth(b)
            ) as resp:
                await resp.read()
                if resp.status == 200:
                    return True, None
                return False, f"HTTP {resp.status}"
        except TimeoutError:
            return False, "timeout"
        except aiohttp.ClientError as e:
            return False, type(e).__name__
        except OSError as e:
            return False, type(e).__name__

    async def refresh_models(self, backends: list[Backend]) -> None:
        """Read these backends' /v1/models now (after an adapter was loaded or unloaded)."""
        await asyncio.gather(*(self._fetch_models(b) for b in backends))

    async def _fetch_models(self, b: Backend) -> None:
        b.models_at = time.monotonic()
        try:
            async with self.session.get(
                b.url + "/v1/models", timeout=self._timeout, headers=_auth(b)
            ) as resp:
                if resp.status != 200:
                    return
                data = orjson.loads(await resp.read())
                models = data.get("data") if isinstance(data, dict) else None
                if isinstance(models, list):
                    b.models = [m for m in models if isinstance(m, dict) and "id" in m]
        except (aiohttp.ClientError, OSError, TimeoutError, orjson.JSONDecodeError):
            pass

    # ---- passive (called by forwarding) --------------------------------------------------

    def record_success(self, b: Backend) -> None:
        b.consecutive_failures = 0
        if b.state is State.PROBING:
            self._set(b, State.HEALTHY, "request succeeded")

    def record_failure(self, b: Backend, kind: str) -> None:
        b.consecutive_failures += 1
        if b.state is State.PROBING or (
            b.state is State.HEALTHY and b.consecutive_failures >= self.settings.passive_failures
        ):
            self.eject(b, kind)

    def eject(self, b: Backend, why: str) -> None:
        b.ejections += 1
        b.check_successes = 0
        factor = 2 ** min(b.ejections - 1, 4)
        b.ejected_until = time.monotonic() + self.settings.eject_s * factor
        self.metrics.ejections.labels(b.name).inc()
        OPS.warning(
            "backend %s ejected after %s (%d failures in a row); back for a probe in %.0f s",
            b.name,
            why,
            b.consecutive_failures,
            self.settings.eject_s * factor,
            extra={
                "event": "ejection",
                "backend": b.name,
                "kind": why,
                "failures": b.consecutive_failures,
                "eject_s": self.settings.eject_s * factor,
            },
        )
        self._set(b, State.UNHEALTHY, f"ejected after {why}")
        self.kick()

    def _set(self, b: Backend, state: State, why: str) -> None:
        previous = b.state
        if b.set_state(state):
            level = logging.INFO if state is State.HEALTHY else logging.WARNING
            log.log(level, "backend %s: %s -> %s (%s)", b.name, previous.value, state.value, why)
            if state is State.UNHEALTHY:
                b.fresh = False
                b.models = []  # re-read when it comes back (it may serve another model)
                if any(o is not b for o in self.pool.routable()):
                    # What it has not started answering would otherwise wait for its first-byte
                    # timeout: retry those elsewhere now (nothing reached their clients yet).
                    with contextlib.suppress(AttributeError):
                        b.stats.recall_unanswered(b.in_flight)
            if state is State.HEALTHY:
                b.ejections = 0
                if not b.fresh:  # back after being down (at start-up nothing restarted)
                    with contextlib.suppress(AttributeError):
                        b.stats.mark_restarted()
            self.pool.changed(b)


def _auth(b: Backend) -> dict[str, str] | None:
    return {"Authorization": f"Bearer {b.api_key}"} if b.api_key else None
