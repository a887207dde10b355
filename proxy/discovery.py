"""Backends from DNS: a backend whose ``discover = "dns"`` is a template, one backend per
address its URL's host name resolves to (a Kubernetes headless Service resolves to its ready
pods), resolved again every ``discover_interval_s``. An address that appears is added (probed,
then healthy); one that disappears is removed as the admin API removes (it drains: its requests
in flight finish). A failed resolution changes nothing. Each discovered backend is named
``{template name}@{address}`` and inherits every other key of its template.

The resolver is injectable (``Resolver``): tests resolve names to 127.0.0.x without DNS.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit, urlunsplit

from proxy.settings import BackendSettings
from proxy.tasks import stop_task

log = logging.getLogger("pipefill.discovery")

#: ``resolver(host, port)`` -> the addresses it resolves to now
Resolver = Callable[[str, int], Awaitable[list[str]]]


async def system_resolver(host: str, port: int) -> list[str]:
    """The addresses of ``host`` (the system's resolver, as getaddrinfo sees them)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def expand(template: BackendSettings, addresses: list[str]) -> list[BackendSettings]:
    """One backend's settings per address, named ``{template}@{address}``."""
    parts = urlsplit(template.url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    out = []
    for addr in addresses:
        host = f"[{addr}]" if ":" in addr else addr
        url = urlunsplit((parts.scheme, f"{host}:{port}", parts.path, "", ""))
        data = template.model_dump()
        data.update(url=url, name=f"{template.name}@{addr}", discover="static")
        out.append(BackendSettings.model_validate(data))
    return out


class Discovery:
    """Keeps the pool's discovered backends equal to what the templates resolve to."""

    def __init__(self, pool, templates: list[BackendSettings], resolver: Resolver) -> None:
        self.pool = pool
        self.templates = templates
        self.resolver = resolver
        self._owned: dict[str, set[str]] = {t.name: set() for t in templates}  # type: ignore[misc]
        self._task: asyncio.Task | None = None

    def owns(self, name: str) -> bool:
        return any(name in names for names in self._owned.values())

    async def resolve_all(self) -> None:
        await asyncio.gather(*(self.resolve(t) for t in self.templates))

    async def resolve(self, template: BackendSettings) -> None:
        parts = urlsplit(template.url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:
            addresses = await self.resolver(parts.hostname or "", port)
        except (OSError, TimeoutError) as e:
            log.warning("discovery: %s did not resolve (%s); backends kept", template.name, e)
            return
        wanted = {b.name: b for b in expand(template, addresses)}
        owned = self._owned.setdefault(template.name, set())  # type: ignore[arg-type]
        for name in sorted(owned - wanted.keys()):
            if name in self.pool:
                self.pool.remove(name)  # drains: its streams finish
            owned.discard(name)
            log.info("discovery: %s left %s", name, template.name)
        for name, settings in wanted.items():
            if name not in owned and name not in self.pool:
                self.pool.add(settings)
                owned.add(name)
                log.info("discovery: %s joined %s", name, template.name)

    def start(self) -> None:
        if self.templates and (self._task is None or self._task.done()):
            self._task = asyncio.create_task(self._run(), name="pipefill-discovery")

    async def _run(self) -> None:
        interval = min(t.discover_interval_s for t in self.templates)
        while True:
            await asyncio.sleep(interval)
            try:
                await self.resolve_all()
            except Exception:  # never let discovery die; the next round retries
                log.exception("discovery round failed")

    async def close(self) -> None:
        task, self._task = self._task, None
        await stop_task(task)
