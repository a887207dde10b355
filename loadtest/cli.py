"""The `loadtest` command: one sub-command per job, each living in its own module.

A sub-command module exposes `add_arguments(parser)` and `run(args) -> int`; it is
imported only when its sub-command is chosen, so `loadtest sim` starts fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("loadtest.run_cli", "run a closed-loop (or open-loop --rate) sweep against a server"),
    "sim": ("loadtest.sim.cli", "serve SGLang's HTTP API from a simulated engine"),
    "report": ("loadtest.report_cli", "re-render a saved run (results.json)"),
    "compare": ("loadtest.report_cli", "compare two saved runs metric by metric"),
    "merge": ("loadtest.report_cli", "merge runs made at the same time on several machines"),
    "demo": ("loadtest.demo", "three simulators and the proxy: direct vs proxied sweep"),
}


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 2 (bad usage) or 1."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loadtest", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if only is None or only == name:
            module = importlib.import_module(module_name)
            module.add_arguments(p) if name not in ("report", "compare", "merge") else getattr(
                module, f"add_{name}_arguments"
            )(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    chosen = next((a for a in argv if not a.startswith("-")), None)
    only = chosen if chosen in COMMANDS else None
    try:
        parser = build_parser(only)
    except ModuleNotFoundError as exc:  # a sub-command not built yet
        print(f"loadtest: error: {exc}", file=sys.stderr)
        return 1
    args = parser.parse_args(argv)
    module = importlib.import_module(COMMANDS[args.command][0])
    runner = (
        module.run
        if args.command not in ("report", "compare", "merge")
        else (getattr(module, f"run_{args.command}"))
    )
    try:
        return int(runner(args) or 0)
    except CliError as exc:
        print(f"loadtest {args.command}: error: {exc}", file=sys.stderr)
        return exc.status
    except KeyboardInterrupt:
        print(f"loadtest {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    # Run through the package's module so sub-commands raise the same CliError class.
    from loadtest.cli import main as package_main

    sys.exit(package_main())
