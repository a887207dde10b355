"""Stopping the proxy's background loops (health, scrape, control, discovery, lag)."""

from __future__ import annotations

import asyncio
import contextlib


async def stop_task(task: asyncio.Task | None) -> None:
    """Cancel ``task`` and wait until it has ended; a task that already ended is left as is."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
