"""``loadtest sim``: serve SGLang's HTTP API from simulated engines, one per port.

Several backends in one process: repeat ``--profile`` and ``--port`` (paired in order),
e.g. ``--profile pp8 --port 30000 --profile tp8 --port 30001``; with one ``--port`` and
several profiles the ports count up from it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys

from loadtest.cli import CliError
from loadtest.sim.faults import add_fault_arguments, config_from_args

DEFAULT_PORT = 30000


#: on/off flags for how the server was started, each as an SGLang deployment can differ
SERVER_FLAGS = (
    ("--disable-radix-cache",
     "no prefix cache (as SGLang's flag): every prompt is prefilled in full"),
    ("--enable-cache-report",
     "report cached prompt tokens in OpenAI usage.prompt_tokens_details (as SGLang's flag; "
     "/generate's meta_info.cached_tokens is always there)"),
    ("--no-metrics",
     "serve no /metrics (404), as SGLang started without --enable-metrics (its default)"),
    ("--max-running-unset",
     "/server_info says max_running_requests null, as SGLang does when --max-running-requests "
     "was not given (its scheduler's value is in /v1/loads)"),
    ("--inference-only",
     "serve inference, health and models only: no /metrics, /server_info or load report (404), "
     "as an OpenAI-compatible server that is not SGLang"),
)  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--profile", action="append", metavar="NAME|PATH",
        help="tp8, pp8, ep8 or a profile .toml; repeat for several backends (default pp8)",
    )  # fmt: skip
    parser.add_argument(
        "--port", action="append", type=int, metavar="N",
        help=f"port of each backend, in --profile order (default {DEFAULT_PORT}, counting up)",
    )  # fmt: skip
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument(
        "--time-scale", type=float, default=1.0, metavar="X",
        help="wall seconds per modelled second (0.1 runs ten times faster; default 1)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="seed of generated text and faults")
    parser.add_argument(
        "--trace", metavar="FILE",
        help="append one JSON line per request: arrival, first/last token times, token counts",
    )  # fmt: skip
    parser.add_argument(
        "--keepalive-timeout", type=float, default=5.0, metavar="S",
        help="close idle keep-alive connections after S seconds, like uvicorn (default 5)",
    )  # fmt: skip
    parser.add_argument("--access-log", action="store_true", help="log every request")
    for flag, text in SERVER_FLAGS:
        parser.add_argument(flag, action="store_true", help=text)
    add_fault_arguments(parser)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = _profiles_epilog()


def _profiles_epilog() -> str:
    """The shipped profiles and their one-line descriptions (skipped if they cannot load)."""
    try:
        from loadtest.sim.profiles import PROFILE_NAMES, load_profile

        rows = [(n, load_profile(n).description) for n in PROFILE_NAMES]
    except Exception:
        return ""
    width = max(len(n) for n, _ in rows)
    return "profiles:\n" + "\n".join(f"  {n:<{width}}  {d}" for n, d in rows)


def plan(args: argparse.Namespace) -> list[tuple[str, int]]:
    """(profile, port) for every backend, from the repeated flags."""
    profiles = args.profile or ["pp8"]
    ports = args.port or [DEFAULT_PORT]
    if len(ports) == 1:
        ports = [ports[0] + i for i in range(len(profiles))]
    if len(ports) != len(profiles):
        raise CliError(
            f"{len(profiles)} --profile but {len(ports)} --port: give one --port, or one per "
            "--profile",
            status=2,
        )
    if len(set(ports)) != len(ports):
        raise CliError("every backend needs its own --port", status=2)
    for port in ports:
        if not 0 < port < 65536:
            raise CliError(f"--port {port} is not a valid port", status=2)
    return list(zip(profiles, ports, strict=True))


def run(args: argparse.Namespace) -> int:
    from loadtest.sim.faults import Faults
    from loadtest.sim.profiles import ProfileError, load_profile
    from loadtest.sim.server import SimBackend, open_trace, serve

    if not args.time_scale > 0:
        raise CliError("--time-scale must be > 0", status=2)
    try:
        fault_config = config_from_args(args)
    except ValueError as exc:
        raise CliError(f"bad fault flag: {exc}", status=2) from None
    backends_plan = plan(args)
    try:
        profiles = [(load_profile(name), port) for name, port in backends_plan]
    except ProfileError as exc:
        raise CliError(str(exc)) from None
    try:
        trace = open_trace(args.trace)
    except OSError as exc:
        raise CliError(f"cannot open --trace {args.trace}: {exc.strerror}") from None
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )  # fmt: skip
    backends = [
        SimBackend(
            profile,
            port=port,
            host=args.host,
            time_scale=args.time_scale,
            seed=args.seed + i,
            radix_cache=not args.disable_radix_cache,
            enable_cache_report=args.enable_cache_report,
            enable_metrics=not args.no_metrics,
            max_running_arg=not args.max_running_unset,
            inference_only=args.inference_only,
            faults=Faults(fault_config.model_copy(), seed=args.seed + i),
            trace=trace,
        )
        for i, (profile, port) in enumerate(profiles)
    ]

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        async with serve(backends, keepalive_s=args.keepalive_timeout, access_log=args.access_log):
            for b in backends:
                print(
                    f"loadtest sim: {b.profile.name} ({b.model_name}) on http://{b.host}:{b.port}"
                    f" time-scale {b.time_scale}",
                    file=sys.stderr,
                    flush=True,
                )
            await stop.wait()
        print("loadtest sim: stopped", file=sys.stderr, flush=True)

    try:
        _run_loop(main())
    except OSError as exc:  # e.g. address already in use
        raise CliError(f"cannot serve: {exc.strerror or exc}") from None
    finally:
        if trace is not None:
            trace.close()
    return 0


def _run_loop(coro) -> None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        asyncio.run(coro)
        return
    uvloop.run(coro)
