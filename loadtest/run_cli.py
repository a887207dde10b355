"""`loadtest run`: a closed-loop concurrency sweep (or open-loop --rate levels) against a server.

    loadtest run --url http://127.0.0.1:30000 --concurrency 1,4,32

One level per value; each level warms up, measures a steady-state window, then drains.
Results: a console table, and optionally --out results.json, --csv, --plot.
Documentation: docs/loadtest.md.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any

from loadtest.cli import CliError
from loadtest.interrupt import run_stoppable
from loadtest.workload import API_PATHS, WORKLOADS, LengthDist, WorkloadConfig, load_dataset

DEFAULT_CONCURRENCY = "1,4,32"
# the workload the simulator's profiles were calibrated with (1024-token prompts, 512 out)
DEFAULT_INPUT, DEFAULT_OUTPUT = 1024, 512
DEFAULT_WARMUP, DEFAULT_DURATION = 15.0, 45.0  # the default sweep takes ~4-5 minutes
DEFAULT_DRAIN_TIMEOUT = 60.0
#: ``--quick``: a sweep of the default levels in about a minute (flags given explicitly win)
QUICK = {"warmup": 5.0, "duration": 10.0, "drain_timeout": 5.0}


def _positive_ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 1,4,32, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,4,32, got {text!r}")
    return values


def _positive_floats(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 2,5.5, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def _length(text: str) -> LengthDist:
    try:
        return LengthDist.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _nonneg(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return v


def _positive(text: str) -> float:
    v = _nonneg(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return v


def add_arguments(p: argparse.ArgumentParser) -> None:
    t = p.add_argument_group("target")
    t.add_argument("--url", default="http://127.0.0.1:30000", help="server base URL")
    t.add_argument(
        "--api",
        choices=sorted(API_PATHS),
        default="chat",
        help="chat (/v1/chat/completions), completions (/v1/completions) or "
        "generate (SGLang /generate); default chat",
    )
    t.add_argument(
        "--no-stream",
        dest="stream",
        action="store_false",
        help="ask for whole responses (TTFT then equals E2E)",
    )
    t.add_argument("--model", help="model name (default: the first id of GET /v1/models)")
    t.add_argument(
        "--header",
        action="append",
        default=[],
        metavar="K:V",
        help="extra request header, repeatable",
    )
    t.add_argument(
        "--api-key",
        default=os.environ.get("LOADTEST_API_KEY"),
        help="sent as 'Authorization: Bearer KEY' (env LOADTEST_API_KEY)",
    )
    t.add_argument(
        "--request-timeout",
        type=_positive,
        default=600.0,
        metavar="S",
        help="give up on one request after S seconds (default 600)",
    )

    lv = p.add_argument_group("levels")
    lv.add_argument(
        "--concurrency",
        "-c",
        type=_positive_ints,
        metavar="C1,C2,...",
        help=f"closed-loop levels (default {DEFAULT_CONCURRENCY})",
    )
    lv.add_argument(
        "--rate",
        type=_positive_floats,
        metavar="R1,R2,...",
        help="open-loop levels in requests/s instead of --concurrency",
    )
    lv.add_argument(
        "--arrival",
        choices=("poisson", "constant"),
        default="poisson",
        help="open-loop arrival process (default poisson)",
    )
    lv.add_argument(
        "--max-in-flight",
        type=int,
        default=10_000,
        help="open loop: cap on requests in flight (default 10000)",
    )
    lv.add_argument(
        "--duration",
        type=_positive,
        default=None,
        metavar="S",
        help="steady-state window per level in seconds (default 45)",
    )
    lv.add_argument(
        "--warmup",
        type=_nonneg,
        default=None,
        metavar="S",
        help="seconds before the window opens (default 15; 0 with --requests)",
    )
    lv.add_argument(
        "--requests",
        type=int,
        default=None,
        metavar="N",
        help="send N requests per level after the warmup instead of --duration",
    )
    lv.add_argument(
        "--drain-timeout",
        type=_nonneg,
        default=None,
        metavar="S",
        help="after the window, wait up to S seconds for running requests "
        f"(default {DEFAULT_DRAIN_TIMEOUT:g}), then cancel them (counted as cancelled, not as "
        "errors)",
    )
    lv.add_argument(
        "--quick",
        action="store_true",
        help="a one-minute sweep: --warmup {warmup:g} --duration {duration:g} "
        "--drain-timeout {drain_timeout:g} unless given (fewer samples: for a first look, "
        "not for numbers to publish)".format(**QUICK).replace("%", "%%"),
    )
    lv.add_argument(
        "--repeat",
        type=int,
        default=1,
        metavar="K",
        help="run each level K times; report medians and spread",
    )
    lv.add_argument(
        "--time-scale",
        type=_positive,
        default=None,
        metavar="X",
        help="the target is `loadtest sim --time-scale X`: durations are given "
        "and results reported in modelled seconds (wall = modelled * X); default: the "
        "target's /get_server_info sim_time_scale, else 1",
    )
    lv.add_argument(
        "--processes",
        type=int,
        default=1,
        metavar="N",
        help="spread each level's workers over N client processes",
    )

    w = p.add_argument_group("workload")
    w.add_argument(
        "--input-len",
        type=_length,
        default=LengthDist("fixed", DEFAULT_INPUT),
        metavar="DIST",
        help="prompt tokens: 512, uniform:256-768, normal:512,64 "
        "(default 1024; synthetic prompts, one token per word)",
    )
    w.add_argument(
        "--output-len",
        type=_length,
        default=None,
        metavar="DIST",
        help="max_tokens per request, same forms (default 512)",
    )
    eos = w.add_mutually_exclusive_group()
    eos.add_argument(
        "--ignore-eos",
        dest="ignore_eos",
        action="store_true",
        default=None,
        help="ask the server to ignore EOS (default for synthetic prompts)",
    )
    eos.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="let the model stop early (default with --dataset)",
    )
    w.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        metavar="N",
        help="every prompt starts with the same N words (default 0: all unique)",
    )
    w.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="unique",
        help="unique prompts (default); shared-prefix: one of --prefix-groups system prompts "
        "of --prefix-tokens words, then a unique question of --input-len; multi-turn: every "
        "client re-sends its conversation (history, the answers it got, a new question) for "
        "--turns turns, then starts another",
    )
    w.add_argument("--prefix-groups", type=int, default=None, metavar="G",
                   help="shared-prefix: how many system prompts (default 8)")  # fmt: skip
    w.add_argument("--prefix-tokens", type=int, default=None, metavar="S",
                   help="shared-prefix: words of each system prompt (default 2048)")  # fmt: skip
    w.add_argument(
        "--prefix-skew", type=float, default=None, metavar="F",
        help="shared-prefix: the first group's share of the requests, the rest uniform "
        "(default: all groups alike)",
    )  # fmt: skip
    w.add_argument("--turns", type=int, default=None, metavar="K",
                   help="multi-turn: turns per conversation (default 4)")  # fmt: skip
    w.add_argument(
        "--turn-delay", type=float, default=None, metavar="S",
        help="multi-turn: mean seconds a client thinks between an answer and its next turn "
        "(exponential draws; default 0: at once)",
    )  # fmt: skip
    w.add_argument("--dataset", metavar="FILE", help="ShareGPT JSON or JSONL prompts")
    w.add_argument("--seed", type=int, default=0, help="seed for prompts, lengths, arrivals")
    w.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="sampling temperature (default: the server's)",
    )
    w.add_argument(
        "--save-payloads", metavar="FILE", help="write every request body sent, one JSON line each"
    )

    o = p.add_argument_group("output")
    o.add_argument("--slo", help="goodput SLOs, e.g. ttft=0.5,tpot=50ms")
    o.add_argument("--out", metavar="FILE", help="write results JSON")
    o.add_argument(
        "--save-records", action="store_true", help="include every request's record in --out"
    )
    o.add_argument("--csv", metavar="FILE", help="write one CSV row per level")
    o.add_argument("--plot", metavar="FILE", help="write a PNG of the sweep (needs matplotlib)")
    o.add_argument("--quiet", "-q", action="store_true", help="no live progress")


# ---------------------------------------------------------------------------------------


def _headers(args: argparse.Namespace) -> dict[str, str]:
    headers: dict[str, str] = {}
    for h in args.header:
        key, sep, value = h.partition(":")
        if not sep or not key.strip():
            raise CliError(f"bad --header {h!r}: expected NAME:VALUE", status=2)
        headers[key.strip()] = value.strip()
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    return headers


def _validate(args: argparse.Namespace) -> None:
    if args.concurrency and args.rate:
        raise CliError("choose --concurrency or --rate, not both", status=2)
    if args.requests is not None and args.requests < 1:
        raise CliError("--requests must be >= 1", status=2)
    if args.requests is not None and args.duration is not None:
        raise CliError("choose --duration or --requests, not both", status=2)
    if args.repeat < 1:
        raise CliError("--repeat must be >= 1", status=2)
    if args.processes < 1:
        raise CliError("--processes must be >= 1", status=2)
    if args.shared_prefix < 0:
        raise CliError("--shared-prefix must be >= 0", status=2)
    shared = ("--prefix-groups", "--prefix-tokens", "--prefix-skew")
    for flag in shared:
        if getattr(args, flag[2:].replace("-", "_")) is not None and (
            args.workload != "shared-prefix"
        ):
            raise CliError(f"{flag} is for --workload shared-prefix", status=2)
    for flag in ("--turns", "--turn-delay"):
        if getattr(args, flag[2:].replace("-", "_")) is not None and args.workload != "multi-turn":
            raise CliError(f"{flag} is for --workload multi-turn", status=2)
    if args.turn_delay is not None and not 0 <= args.turn_delay < math.inf:
        raise CliError("--turn-delay must be a number of seconds >= 0", status=2)
    if args.workload == "multi-turn" and args.rate:
        raise CliError(
            "--workload multi-turn needs closed-loop clients (--concurrency): each keeps a "
            "conversation",
            status=2,
        )
    if args.max_in_flight < 1:
        raise CliError("--max-in-flight must be >= 1", status=2)
    if not args.url.startswith(("http://", "https://")):
        raise CliError(f"bad --url {args.url!r}: expected http://HOST:PORT", status=2)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise CliError("--plot needs matplotlib: pip install 'pipefill[plot]'") from None


def run(args: argparse.Namespace) -> int:
    _validate(args)
    if args.quick:
        for name, value in QUICK.items():
            if getattr(args, name) is None:
                setattr(args, name, value)
    if args.drain_timeout is None:
        args.drain_timeout = DEFAULT_DRAIN_TIMEOUT
    slo = None
    if args.slo:
        from loadtest.stats import parse_slo

        try:
            slo = parse_slo(args.slo)
        except ValueError as exc:
            raise CliError(str(exc), status=2) from None
    dataset = None
    if args.dataset:
        try:
            dataset = load_dataset(args.dataset)
        except ValueError as exc:
            raise CliError(str(exc)) from None
    config = WorkloadConfig(
        api=args.api,
        model=args.model or "default",
        stream=args.stream,
        input_len=args.input_len,
        output_len=args.output_len or LengthDist("fixed", DEFAULT_OUTPUT),
        output_len_given=args.output_len is not None,
        ignore_eos=args.ignore_eos,
        shared_prefix=args.shared_prefix,
        workload=args.workload,
        **{
            k: v
            for k in ("prefix_groups", "prefix_tokens", "prefix_skew", "turns")
            if (v := getattr(args, k)) is not None
        },
        seed=args.seed,
        dataset=dataset,
        temperature=args.temperature,
    )
    try:
        config.validate()
    except ValueError as exc:
        raise CliError(str(exc), status=2) from None
    from loadtest.runner import Sweep, SweepOptions

    options = SweepOptions(
        url=args.url,
        headers=_headers(args),
        request_timeout=args.request_timeout,
        model_given=args.model is not None,
        concurrency=args.concurrency or ([] if args.rate else _positive_ints(DEFAULT_CONCURRENCY)),
        rates=args.rate or [],
        arrival=args.arrival,
        max_in_flight=args.max_in_flight,
        turn_delay=args.turn_delay or 0.0,
        duration=args.duration
        if args.duration is not None
        else (None if args.requests is not None else DEFAULT_DURATION),
        warmup=(
            args.warmup if args.warmup is not None else (0.0 if args.requests else DEFAULT_WARMUP)
        ),
        requests=args.requests,
        drain_timeout=args.drain_timeout,
        repeat=args.repeat,
        time_scale=args.time_scale,
        processes=args.processes,
        slo=slo,
        progress=(not args.quiet) and sys.stdout.isatty(),
        save_payloads=args.save_payloads,
    )
    sweep = Sweep(options, config)
    outcome = _run_sweep(sweep)
    return _finish(args, sweep, outcome)


def _run_sweep(sweep: Any) -> Any:
    """Run the sweep on uvloop; the first Ctrl-C stops it cleanly, a second one hard."""
    outcome, _ = run_stoppable(
        sweep.run, sweep.stop, "finishing up and writing what was measured (Ctrl-C again to abort)"
    )
    return outcome


def _finish(args: argparse.Namespace, sweep: Any, outcome: Any) -> int:
    from loadtest.results import ResultsError

    result = outcome.result
    if outcome.interrupted:  # the saved file and every report of it say so too
        result.metadata["interrupted"] = True
    if result.levels:
        _print_report(result)
    for line in outcome.messages:
        print(line, file=sys.stderr)
    if outcome.interrupted:
        from loadtest.report import INTERRUPTED_BANNER

        print(f"{INTERRUPTED_BANNER} ({len(result.levels)} level(s) measured)", file=sys.stderr)
    try:
        if args.out:
            result.save(args.out, include_records=args.save_records)
            print(f"wrote {args.out}", file=sys.stderr)
        if args.csv:
            result.write_csv(args.csv)
            print(f"wrote {args.csv}", file=sys.stderr)
        if args.plot and result.levels:
            from loadtest.plot import PlotUnavailable, plot_sweep

            try:
                plot_sweep(result, args.plot)
            except PlotUnavailable as exc:
                raise CliError(str(exc)) from None
            except (OSError, ValueError) as exc:
                raise CliError(f"cannot write plot {args.plot}: {exc}") from None
            print(f"wrote {args.plot}", file=sys.stderr)
    except ResultsError as exc:
        raise CliError(str(exc)) from None
    if outcome.error:
        raise CliError(outcome.error)
    return 130 if outcome.interrupted else 0


def _print_report(result: Any) -> None:
    from loadtest.report import make_console, render_run

    render_run(result, make_console())
