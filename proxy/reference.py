"""The configuration and metrics references, generated from the code so they cannot drift.

``proxy --print-config-reference`` and ``proxy --print-metrics-reference`` print them as
Markdown; README.md carries copies between ``<!-- config-reference:start/end -->`` and
``<!-- metrics-reference:start/end -->`` markers that a test compares.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from proxy.settings import BackendSettings, Settings

ENV_PREFIX = "PIPEFILL_"


def _type_name(field: FieldInfo) -> str:
    text = str(field.annotation).replace("typing.", "")
    for noise in ("<class '", "'>"):
        text = text.replace(noise, "")
    return text.replace("NoneType", "None")


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value: Any = field.default_factory()  # type: ignore[call-arg]
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return ""
    if isinstance(value, str):
        return f'`"{value}"`'
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


def _rows(section: str, model: type[BaseModel], env: bool) -> list[str]:
    rows = []
    for name, field in model.model_fields.items():
        key = f"`{name}`"
        env_var = f"`{ENV_PREFIX}{section.upper()}__{name.upper()}`" if env else "—"
        doc = (field.description or "").replace("|", "\\|")
        type_name = _type_name(field).replace("|", "\\|")
        rows.append(f"| {key} | {type_name} | {_default(field)} | {env_var} | {doc} |")
    return rows


def config_markdown() -> str:
    """The whole reference: one table per ``[section]``, then ``[[backends]]``."""
    header = "| key | type | default | environment | meaning |\n|---|---|---|---|---|"
    out: list[str] = []
    for section, field in Settings.model_fields.items():
        model = field.annotation
        if section == "backends" or not (isinstance(model, type) and issubclass(model, BaseModel)):
            continue
        out += [f"#### `[{section}]`", "", header, *_rows(section, model, env=True), ""]
    out += [
        "#### `[[backends]]` (one table per backend)",
        "",
        f"Set all at once from the environment as JSON: `{ENV_PREFIX}BACKENDS="
        '\'[{"url": "http://127.0.0.1:30000"}]\'`; `limits` overrides any `[limits]` key.',
        "",
        header,
        *_rows("backends", BackendSettings, env=False),
    ]
    return "\n".join(out) + "\n"


def metrics_markdown() -> str:
    """Every metric the proxy exports: exposed name, type, labels, meaning."""
    from proxy.app import Proxy
    from proxy.settings import load_settings

    proxy = Proxy(load_settings(None, backends=[{"url": "http://127.0.0.1:9", "name": "b"}]))
    registry = proxy.metrics.registry
    labels_of: dict[str, tuple[str, ...]] = {}
    for collector in list(registry._collector_to_names):  # prometheus-client keeps no public map
        names = getattr(collector, "_labelnames", None)
        if names is not None:
            labels_of[collector._name] = tuple(names)
    rows = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
    for family in registry.collect():
        labels = labels_of.get(family.name) or sorted(
            {k for s in family.samples for k in s.labels} - {"le"}
        )
        if not labels and family.name.startswith("pipefill_backend_"):
            labels = ["backend"]  # per-backend gauges with no value yet export no sample
        exposed = family.name + ("_total" if family.type == "counter" else "")
        doc = family.documentation.replace("|", "\\|")
        rows.append(f"| `{exposed}` | {family.type} | {', '.join(labels)} | {doc} |")
    return "\n".join(rows) + "\n"


BLOCKS = {"config-reference": config_markdown, "metrics-reference": metrics_markdown}


def readme_blocks(text: str) -> dict[str, str]:
    """The generated blocks as they stand in README text, by marker name."""
    out = {}
    for name in BLOCKS:
        start, end = f"<!-- {name}:start -->\n", f"<!-- {name}:end -->"
        if start in text and end in text:
            out[name] = text.split(start, 1)[1].split(end, 1)[0]
    return out


def update_readme(path: str = "README.md") -> None:
    """Rewrite README's generated blocks in place: ``python -m proxy.reference``."""
    from pathlib import Path

    file = Path(path)
    text = file.read_text()
    for name, render in BLOCKS.items():
        current = readme_blocks(text).get(name)
        if current is not None:
            text = text.replace(
                f"<!-- {name}:start -->\n{current}", f"<!-- {name}:start -->\n{render()}", 1
            )
    file.write_text(text)


if __name__ == "__main__":
    import sys

    update_readme(*sys.argv[1:2])
