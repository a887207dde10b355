"""``proxy``: run the reverse proxy.

    proxy --config config/proxy.toml
    proxy --backend http://127.0.0.1:30000 --backend http://127.0.0.1:30001 --port 8080

SIGTERM/SIGINT: /health answers 503 for ``server.drain_s`` while the proxy still serves, then it
stops accepting, lets requests in flight finish for up to ``server.shutdown_grace_s`` (streams
still running then end with an SSE error event), exits. SIGHUP: re-read the configuration and
apply its backend list (added ones join, missing ones drain and leave, streams in flight are
untouched).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from typing import Any

from proxy.settings import ConfigError, Settings, load_settings

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
        server.proxy.reload_backends(new.backends)

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
    logging.basicConfig(
        level=settings.server.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
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
