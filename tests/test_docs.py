"""The docs stay true: links resolve, documented keys and defaults, metric names, types and
labels, rejection reasons, simulator fault fields and loadtest defaults match the code.

README.md's references are generated (tests/test_readme.py); docs/ is hand-written, so these
checks read its tables and compare them with the models and the metrics registry.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from loadtest import demo, run_cli
from loadtest.sim.faults import FaultConfig
from proxy import reference
from proxy.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", *DOCS]


def _read(path: Path) -> str:
    return path.read_text()


# ---- links --------------------------------------------------------------------------------


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_point_into_the_repository(page):
    for target in re.findall(r"\]\(([^)\s]+)\)", _read(page)):
        path = target.split("#", 1)[0]
        if not path or re.match(r"[a-z]+:", path):
            continue
        resolved = (page.parent / path).resolve()
        assert resolved.is_relative_to(ROOT), f"{page.name}: {target} leaves the repository"
        assert resolved.exists(), f"{page.name}: {target} does not exist"


# ---- settings: keys and defaults in docs/proxy.md ------------------------------------------

_UNITS = {"KiB": 1024, "MiB": 1024 * 1024}


def _documented_default(text: str) -> object:
    """The value a "(default ...)" entry starts with, in the code's terms."""
    first = re.split(r"[:;,]| (?!MiB|KiB)", text.strip(), maxsplit=1)[0].strip()
    if first == "unset":
        return None
    if first == "required":
        return PydanticUndefined
    if first in ("true", "false"):
        return first == "true"
    if first == "[]":
        return []
    if first.startswith("["):
        return [int(x) for x in re.findall(r"\d+", text.split("]", 1)[0])]
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(?: (KiB|MiB))?", first)
    if m:
        number = float(m[1]) * _UNITS.get(m[2] or "", 1)
        return number
    return first


def _code_default(model: type[BaseModel], key: str) -> object:
    field = model.model_fields[key]
    if field.default_factory is not None:
        return field.default_factory()  # type: ignore[call-arg]
    return field.default


def _config_rows() -> dict[str, str]:
    """docs/proxy.md's configuration table: section -> its keys cell."""
    out = {}
    for line in _read(ROOT / "docs/proxy.md").splitlines():
        m = re.match(r"\| `\[(\w+)\]` \| (.*) \|$", line)
        if m:
            out[m[1]] = m[2]
    return out


def test_proxy_md_lists_every_key_of_the_sections_it_details_with_the_codes_default():
    rows = _config_rows()
    assert {"server", "timeouts", "retries", "upstream", "health"} <= set(rows)
    for section, cell in rows.items():
        model = Settings.model_fields[section].annotation
        entries = dict(re.findall(r"`(\w+)` \(((?:[^()]|\([^()]*\))*)\)", cell))
        assert set(entries) == set(model.model_fields), (
            f"[{section}] documented {sorted(entries)} vs code {sorted(model.model_fields)}"
        )
        for key, text in entries.items():
            documented, actual = _documented_default(text), _code_default(model, key)
            if isinstance(documented, float) and not isinstance(actual, bool):
                assert documented == actual, f"{section}.{key}: docs {text!r}, code {actual!r}"
            elif documented is not PydanticUndefined or actual is not PydanticUndefined:
                assert documented == actual, f"{section}.{key}: docs {text!r}, code {actual!r}"


def test_backends_row_names_every_backend_key():
    cell = next(
        line
        for line in _read(ROOT / "docs/proxy.md").splitlines()
        if line.startswith("| `[[backends]]`")
    )
    from proxy.settings import BackendSettings

    assert set(re.findall(r"`(\w+)` \(", cell)) == set(BackendSettings.model_fields)


# ---- metrics: names, types, labels ---------------------------------------------------------


def _registry() -> dict[str, tuple[str, tuple[str, ...]]]:
    """Exposed name -> (type, labels), from the generated reference."""
    out = {}
    for line in reference.metrics_markdown().splitlines()[2:]:
        name, kind, labels = (c.strip() for c in line.strip("|").split("|")[:3])
        out[name.strip("`")] = (kind, tuple(x for x in labels.split(", ") if x))
    return out


def _expand(cell: str) -> list[str]:
    """`pipefill_a_x` / `_y` -> pipefill_a_x, pipefill_a_y (a shared prefix up to the last _)."""
    names = re.findall(r"`(_?[a-z_]+)`", cell)
    out: list[str] = []
    for n in names:
        if n.startswith("_") and out:
            stem = out[0]
            for cut in range(len(stem), 0, -1):
                candidate = stem[:cut] + n
                if stem[cut:].count("_") <= n.count("_") and candidate in _registry():
                    out.append(candidate)
                    break
            else:
                out.append(n)
        else:
            out.append(n)
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_metric_tables_match_the_registry(page):
    registry = _registry()
    for line in _read(page).splitlines():
        if not line.startswith("| `pipefill_"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        kind, labels = cells[1], tuple(x for x in cells[2].split(", ") if x)
        for name in _expand(cells[0]):
            assert name in registry, f"{page.name}: {name} is not exported"
            assert registry[name] == (kind, labels), f"{page.name}: {name} {kind} {labels}"


def test_every_metric_name_mentioned_anywhere_exists():
    registry = _registry()
    known = set(registry)
    for name, (kind, _) in registry.items():
        if kind == "histogram":
            known |= {f"{name}_bucket", f"{name}_count", f"{name}_sum"}
    files = [*PAGES, *(ROOT / "config").rglob("*.yml"), *(ROOT / "config").rglob("*.json")]
    for f in files:
        for name in set(re.findall(r"\bpipefill_[a-z_]*[a-z]", _read(f))):
            assert name in known, f"{f.relative_to(ROOT)} mentions {name}, not exported"


def _emitted_rejection_codes() -> set[str]:
    """Every reason pipefill_rejections_total is labelled with, read from proxy/app.py."""
    tree = ast.parse(_read(ROOT / "proxy/app.py"))
    codes = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        if node.func.attr == "_reject" and len(node.args) >= 3:
            arg = node.args[2]
        elif (
            node.func.attr == "labels"
            and isinstance(node.func.value, ast.Attribute)
            and node.func.value.attr == "rejections"
        ):
            arg = node.args[0]
        else:
            continue
        if isinstance(arg, ast.Constant):  # else: _reject's own parameter, passed on
            codes.add(arg.value)
    return codes


def test_documented_rejection_reasons_are_the_ones_emitted():
    row = next(
        line
        for line in _read(ROOT / "docs/proxy.md").splitlines()
        if line.startswith("| `pipefill_rejections_total`")
    )
    documented = set(re.findall(r"`([a-z_]+)`", row.split("|")[4]))
    assert documented == _emitted_rejection_codes()
    help_text = _registry_help("pipefill_rejections_total")
    for word in re.findall(r"\b[a-z]+_[a-z_]+\b", help_text):
        assert word in _emitted_rejection_codes(), f"the metric's help names {word}"


def _registry_help(name: str) -> str:
    for line in reference.metrics_markdown().splitlines():
        if line.startswith(f"| `{name}`"):
            return line.rsplit("|", 2)[-2]
    raise AssertionError(name)


# ---- the simulator's faults, loadtest's defaults --------------------------------------------


def test_simulator_fault_fields_are_the_api_fields():
    text = _read(ROOT / "docs/simulator.md")
    section = text.split("## Faults", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `--")]
    assert rows
    fields = set(FaultConfig.model_fields)
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        for name in re.findall(r"`(\w+)`", cells[1] + " " + cells[2]):
            if "_" in name:
                assert name in fields, f"docs/simulator.md names {name}: the API has {fields}"


def test_the_demo_page_states_the_workloads_it_runs_and_loadtest_runs():
    text = " ".join(_read(ROOT / "docs/demo.md").split())
    plan = demo.DemoPlan
    assert f"{plan.input_len}-token prompts, {plan.output_len}-token answers" in text
    default_in, default_out = run_cli.DEFAULT_INPUT, run_cli.DEFAULT_OUTPUT
    assert f"`loadtest run`'s default of {default_in}-token prompts and {default_out}" in text


def test_the_documented_quick_recipe_is_the_flag():
    text = " ".join(_read(ROOT / "docs/loadtest.md").split())
    recipe = " ".join(f"--{k.replace('_', '-')} {v:g}" for k, v in run_cli.QUICK.items())
    assert f"`--quick` is the one-minute recipe: `{recipe}`" in text
