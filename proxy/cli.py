"""``proxy``: run the reverse proxy.

    proxy --config config/proxy.toml
    proxy --backend http://127.0.0.1:30000 --backend http://127.0.0.1:30001 --port 8080

SIGTERM/SIGINT: /health answers 503 for ``server.drain_s`` while the proxy still serves, then it
stops accepting, lets requests in flight finish for up to ``server.shutdown_grace_s`` (streams
still running then end with an SSE error event), exits. SIGHUP: re-read the configuration and
apply its backend list (added ones join, missing ones drain and leave, streams in flight are
untouched) and the settings that can change while running (keys, log level, access log); any
other change is logged as needing a restart. ``--check-config`` validates and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from typing import Any

from proxy import logs
from proxy.settings import ConfigError, Settings, load_settings
from proxy.sources import ENV_PREFIX

log = logging.getLogger("pipefill")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="proxy", description="pipefill reverse proxy for SGLang")
    p.add_argument("--config", metavar="FILE", help="TOML configuration file")
    p.add_argument("--host", help="listen address (server.host)")
    p.add_argument("--port", type=int, help="listen port (server.port)")
    p.add_argument(
        "--backend",
        action="append",
        metavar="URL",
        help="backend URL; repeatable; replaces the file's [[backends]]",
    )
    p.add_argument("--policy", help="routing policy (routing.policy)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    p.add_argument(
        "--log-format",
        choices=["text", "json"],
        help="log lines as text, or one JSON object per line (server.log_format)",
    )
    p.add_argument(
        "--access-log",
        action="store_true",
        default=None,
        help="log one line per request (server.access_log)",
    )
    p.add_argument(
        "--check-config",
        action="store_true",
        help="validate the configuration (file, PIPEFILL_* environment, flags), say what it "
        "sets up, and exit: 0 if valid, 2 if not",
    )
    p.add_argument(
        "--print-config-reference",
        action="store_true",
        help="print every setting with its environment variable (Markdown) and exit",
    )
    p.add_argument(
        "--print-metrics-reference",
        action="store_true",
        help="print every metric /metrics exports (Markdown) and exit",
    )
    return p


def overrides_from(args: argparse.Namespace) -> dict[str, Any]:
    server: dict[str, Any] = {}
    if args.host is not None:
        server["host"] = args.host
    if args.port is not None:
        server["port"] = args.port
    if args.log_level is not None:
        server["log_level"] = args.log_level
    if args.log_format is not None:
        server["log_format"] = args.log_format
    if args.access_log is not None:
        server["access_log"] = args.access_log
    out: dict[str, Any] = {}
    if server:
        out["server"] = server
    if args.backend:
        out["backends"] = [{"url": u} for u in args.backend]
    if args.policy:
        out["routing"] = {"policy": args.policy}
    return out


async def serve(settings: Settings, config: str | None, overrides: dict[str, Any]) -> None:
    from proxy.app import ProxyServer

    server = ProxyServer(settings)
    await server.start()
    names = ", ".join(f"{b.name}={b.url}" for b in settings.backends) or "none"
    log.info("pipefill proxy listening on %s (backends: %s)", server.url, names)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def reload() -> None:
        try:
            new = load_settings(config, **overrides)
        except ConfigError as e:
            log.error("SIGHUP: configuration not reloaded: %s", e)
            return
        server.proxy.reload(new)

    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    loop.add_signal_handler(signal.SIGHUP, reload)
    await stop.wait()
    grace, drain = settings.server.shutdown_grace_s, settings.server.drain_s
    log.info(
        "shutting down: /health says 503 for %.0f s while serving, then up to %.0f s for "
        "requests in flight",
        drain,
        grace,
    )
    await server.stop(grace, pre_stop=drain)
    log.info("stopped")


def describe(settings: Settings, config: str | None) -> str:
    """``--check-config``'s answer: what this configuration sets up, in a few lines."""
    srv = settings.server
    env = sorted(k for k in os.environ if k.upper().startswith(ENV_PREFIX))
    lines = [
        f"configuration OK: {config or 'no file'}"
        + (f" + environment ({', '.join(env)})" if env else ""),
        f"  listen {srv.host}:{srv.port}, policy {settings.routing.policy}, "
        f"limits {settings.limits.algorithm}, client keys {len(srv.api_keys)}, "
        f"admin key {'set' if srv.admin_key else 'unset'}",
        f"  SIGTERM: /health 503 for {srv.drain_s:g} s, then up to {srv.shutdown_grace_s:g} s "
        f"for requests in flight (exit within {srv.drain_s + srv.shutdown_grace_s:g} s)",
    ]
    if not settings.backends:
        lines.append("  no backends: every generation request will get 503 no_healthy_backend")
    for b in settings.backends:
        hint = f" ({b.parallelism}{b.pp_size or ''})" if b.parallelism else ""
        lines.append(f"  backend {b.name}{hint}: {b.url}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.print_config_reference or args.print_metrics_reference:
        from proxy import reference

        text = reference.config_markdown() if args.print_config_reference else ""
        print(text + (reference.metrics_markdown() if args.print_metrics_reference else ""), end="")
        return 0
    overrides = overrides_from(args)
    try:
        settings = load_settings(args.config, **overrides)
    except ConfigError as e:
        print(f"proxy: {e}", file=sys.stderr)
        return 2
    if args.check_config:
        print(describe(settings, args.config))
        return 0
    logs.configure(settings.server.log_level, settings.server.log_format)
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover
        runner = asyncio.run
    try:
        runner(serve(settings, args.config, overrides))
    except OSError as e:  # e.g. address in use
        print(
            f"proxy: cannot listen on {settings.server.host}:{settings.server.port}: {e}",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
