"""What a reload (SIGHUP) can change while the proxy runs, and what needs a restart.

:func:`plan` compares the running settings with the file read again: the backend list and the
keys in :data:`LIVE` are applied (:meth:`proxy.app.Proxy.reload`); any other change is named as
needing a restart, so an operator is never left guessing whether an edit took effect. Values are
never logged, only key names (keys are secrets).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from proxy.settings import Settings

#: settings a reload applies at once (read per request, or re-read by Proxy.reload)
LIVE = frozenset(
    {
        "server.api_keys",
        "server.admin_key",
        "server.metrics_public",
        "server.log_level",
        "server.log_prompts",
        "server.access_log",
        "queue.batch_api_keys",
    }
)


@dataclass
class ReloadPlan:
    """Changed keys (dotted), split into those applied live and those that need a restart."""

    live: list[str] = field(default_factory=list)
    restart: list[str] = field(default_factory=list)

    def section_updates(self, new: Settings) -> dict[str, dict[str, Any]]:
        """Per section, the live keys' new values (for ``model_copy(update=...)``)."""
        out: dict[str, dict[str, Any]] = {}
        for key in self.live:
            section, name = key.split(".", 1)
            out.setdefault(section, {})[name] = getattr(getattr(new, section), name)
        return out


def changed_keys(old: Settings, new: Settings) -> list[str]:
    """Dotted keys whose value differs, the backend list excepted (reloaded as a whole)."""
    out = []
    for section in Settings.model_fields:
        if section == "backends":
            continue
        a, b = getattr(old, section), getattr(new, section)
        if isinstance(a, BaseModel):
            keys = type(a).model_fields
            out += [f"{section}.{k}" for k in keys if getattr(a, k) != getattr(b, k)]
        elif a != b:
            out.append(section)
    return out


def plan(old: Settings, new: Settings) -> ReloadPlan:
    p = ReloadPlan()
    for key in changed_keys(old, new):
        (p.live if key in LIVE else p.restart).append(key)
    return p
