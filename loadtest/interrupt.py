"""Run a command's coroutine on uvloop with a two-stage stop, shared by `run` and `demo`.

The first Ctrl-C (or another listed signal) calls ``stop()`` so the command ends its current
level and still reports what it measured; a second one raises KeyboardInterrupt at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import Callable, Coroutine
from typing import Any


def run_stoppable(
    main: Callable[[], Coroutine[Any, Any, Any]],
    stop: Callable[[], None],
    message: str,
    signals: tuple[signal.Signals, ...] = (signal.SIGINT,),
) -> tuple[Any, bool]:
    """Run ``main()`` to completion; returns its result and whether a stop was asked for."""
    try:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        runner = asyncio.Runner()
    presses = 0

    def on_signal() -> None:
        nonlocal presses
        presses += 1
        if presses > 1:
            raise KeyboardInterrupt
        print(f"\nstopping: {message}", file=sys.stderr)
        stop()

    with runner:
        loop = runner.get_loop()
        for sig in signals:
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, on_signal)
        return runner.run(main()), presses > 0
