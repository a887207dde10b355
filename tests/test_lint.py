"""The tree stays `ruff` clean, and the README's test command is the one CI runs."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ruff(*args: str) -> subprocess.CompletedProcess:
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    if not Path(ruff).exists():
        pytest.skip("ruff not installed")
    return subprocess.run([ruff, *args, str(ROOT)], capture_output=True, text=True)


def test_ruff_is_clean():
    result = _ruff("check")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_is_clean():
    """Python files and the Python blocks in the docs are as `ruff format` writes them."""
    result = _ruff("format", "--check")
    assert result.returncode == 0, result.stdout + result.stderr


def test_readme_test_command_is_what_ci_runs():
    ci_line = (ROOT / ".ci/run").read_text().strip().splitlines()[-1]
    assert ci_line in (ROOT / "README.md").read_text()
