"""The configuration reference, generated from the settings model so it cannot drift.

``proxy --print-config-reference`` prints it as Markdown; README.md carries a copy between
``<!-- config-reference:start -->`` and ``<!-- config-reference:end -->`` that a test compares.
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


def render() -> str:
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
