"""Where each configuration value came from: the TOML file, a ``PIPEFILL_*`` variable or a flag.

The three layers are read here into plain dicts, merged (flags > environment > file; nested
tables merge key by key, lists replace), and validated once by :class:`proxy.settings.Settings`.
Keeping the layers apart until then is what lets an error name its source: the variable
``PIPEFILL_SERVER__PORT``, the flag ``--port`` or the file, with the exact key. Environment
names are checked against the settings model, so a typo (``PIPEFILL_SERVR__PORT``) is an error
rather than a setting silently ignored.
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson
from pydantic import BaseModel

ENV_PREFIX = "PIPEFILL_"
ENV_DELIMITER = "__"

Path_ = tuple[str | int, ...]


class SourceError(ValueError):
    """A value that could not be read from its source (before any validation)."""


@dataclass
class Layer:
    """One source's values (``data``, nested like the TOML file) and how to name it."""

    name: str  # "config/proxy.toml", "environment", "command line"
    data: dict[str, Any] = field(default_factory=dict)
    #: per key path, what the user wrote it as (``PIPEFILL_SERVER__PORT``, ``--port``)
    spelled: dict[Path_, str] = field(default_factory=dict)

    def provides(self, loc: Path_) -> Path_ | None:
        """The prefix of ``loc`` this layer set (a leaf value, or the whole path), or None."""
        node: Any = self.data
        for i, part in enumerate(loc):
            if not isinstance(node, dict):
                return loc[:i]
            if part not in node:
                return None
            node = node[part]
        return loc

    def describe(self, loc: Path_) -> str | None:
        """How an error at ``loc`` names this source, if the value came from it."""
        got = self.provides(loc)
        if got is None:
            return None
        for n in range(len(got), 0, -1):
            spelled = self.spelled.get(got[:n])
            if spelled is not None:
                return spelled
        return self.name


def _annotation_is_complex(annotation: Any) -> bool:
    """Whether a field's value is given as JSON in the environment (lists, tables)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_annotation_is_complex(a) for a in typing.get_args(annotation))
    if origin in (list, dict, tuple, set):
        return True
    return isinstance(annotation, type) and issubclass(annotation, BaseModel | list | dict)


def _json_hint(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if origin in (typing.Union, types.UnionType) and len(args) == 1:
        return _json_hint(args[0])
    if origin is list:
        (item,) = typing.get_args(annotation) or (Any,)
        if isinstance(item, type) and issubclass(item, BaseModel):
            return 'a JSON list of tables, e.g. \'[{"url": "http://127.0.0.1:30000"}]\''
        if item is int:
            return "a JSON list, e.g. '[500, 502]'"
        return 'a JSON list, e.g. \'["k1", "k2"]\''
    return "a JSON object, e.g. '{\"key\": 1}'"


def env_names(settings_model: type[BaseModel]) -> dict[str, tuple[Path_, Any]]:
    """Every variable the settings model reads: name -> (key path, field annotation)."""
    out: dict[str, tuple[Path_, Any]] = {}
    for section, f in settings_model.model_fields.items():
        model = f.annotation
        out[f"{ENV_PREFIX}{section.upper()}"] = ((section,), model)
        if isinstance(model, type) and issubclass(model, BaseModel):
            for key, sub in model.model_fields.items():
                name = f"{ENV_PREFIX}{section.upper()}{ENV_DELIMITER}{key.upper()}"
                out[name] = ((section, key), sub.annotation)
    return out


def env_layer(environ: Mapping[str, str], settings_model: type[BaseModel]) -> Layer:
    """The ``PIPEFILL_*`` variables of ``environ`` as a layer; unknown names and lists or tables
    that are not valid JSON raise SourceError naming the variable and what was expected."""
    known = env_names(settings_model)
    layer = Layer("environment")
    for raw_name in sorted(environ):
        name = raw_name.upper()
        if not name.startswith(ENV_PREFIX):
            continue
        if name not in known:
            close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.75)
            hint = (
                f"; did you mean {close[0]}?" if close else " (see proxy --print-config-reference)"
            )
            raise SourceError(f"environment variable {raw_name}: no such setting{hint}")
        path, annotation = known[name]
        value: Any = environ[raw_name]
        if _annotation_is_complex(annotation):
            try:
                value = orjson.loads(value)
            except orjson.JSONDecodeError:
                raise SourceError(
                    f"environment variable {raw_name} ({'.'.join(map(str, path))}): expected "
                    f"{_json_hint(annotation)}, got {value!r}"
                ) from None
        node = layer.data
        for part in path[:-1]:
            node = node.setdefault(part, {})  # type: ignore[assignment]
        node[path[-1]] = value  # type: ignore[index]
        layer.spelled[path] = f"environment variable {raw_name}"
    return layer


def merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """``top`` over ``base``: nested tables merge key by key, anything else is replaced."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def locate(layers: list[Layer], loc: Path_) -> str | None:
    """The source an error at ``loc`` comes from: the highest layer that set it."""
    for layer in layers:
        where = layer.describe(loc)
        if where is not None:
            return where
    return None
