"""The README stays true: generated references, documented commands and flags, the snippet."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest
from proxy_support import running_proxy
from sim_util import running_sim

from loadtest.cli import build_parser as loadtest_parser
from proxy import reference
from proxy.cli import build_parser as proxy_parser

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


@pytest.mark.parametrize("name", sorted(reference.BLOCKS))
def test_generated_reference_matches_the_code(name):
    blocks = reference.readme_blocks(README)
    assert name in blocks, f"README lacks the {name} markers"
    assert blocks[name] == reference.BLOCKS[name](), (
        f"README's {name} is out of date: run `python -m proxy.reference`"
    )


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]
    raise AssertionError("no sub-commands")


def _commands() -> list[list[str]]:
    """`proxy ...` and `loadtest ...` invocations in the README's sh blocks and inline code."""
    texts = _blocks("sh") + re.findall(r"`((?:proxy|loadtest) [^`]+)`", README)
    out = []
    for text in texts:
        for line in text.replace("&&", "\n").splitlines():
            line = line.split("#", 1)[0].strip()
            words = shlex.split(line) if line else []
            if words and Path(words[0]).name in ("proxy", "loadtest"):
                out.append([Path(words[0]).name, *words[1:]])
    return out


def test_documented_commands_and_flags_exist():
    commands = _commands()
    assert any(c[0] == "proxy" for c in commands) and any(c[0] == "loadtest" for c in commands)
    for words in commands:
        if words[0] == "proxy":
            parser = proxy_parser()
        else:
            assert len(words) > 1, words
            parser = _subparser(loadtest_parser(only=words[1]), words[1])
        flags = {w.split("=", 1)[0] for w in words if w.startswith("--")}
        unknown = flags - _options(parser)
        assert not unknown, f"{' '.join(words)}: unknown flags {sorted(unknown)}"


async def test_the_openai_snippet_runs_against_the_proxy():
    (snippet,) = [b for b in _blocks("python") if "OpenAI(" in b]
    async with running_sim("tp8") as (sim_url, _), running_proxy([sim_url]) as proxy:
        code = snippet.replace("http://127.0.0.1:8080", proxy.url)
        out = io.StringIO()

        def run() -> None:
            with contextlib.redirect_stdout(out):
                exec(compile(code, "README snippet", "exec"), {})

        await asyncio.to_thread(run)
    assert "[32 tokens]" in out.getvalue()
