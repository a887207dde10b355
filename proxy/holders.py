"""Which backend holds each admitted request that names itself with SGLang's ``rid``, so that
``/abort_request`` goes to that backend alone, or cancels the request while it still waits in
the proxy's queue (no backend has seen it yet).

SGLang aborts by ``rid``: the body's ``rid`` field (``/generate``, ``/v1/chat/completions``,
``/v1/completions``); a batch's string ``rid`` is expanded to ``{rid}_{i}`` per prompt, and a
list names each. Only requests that carry a ``rid`` are tracked (a client that gave none cannot
name it in an abort); an entry lives while its request is handled.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, Protocol


class Leased(Protocol):
    """What admission hands out: the backend a request was bound to."""

    @property
    def backend(self) -> Any: ...


class Aborted(Exception):
    """A request aborted (``/abort_request``) while it waited in the proxy's queue."""

    reason = "request_aborted"


def rids(obj: dict[str, Any]) -> list[str]:
    """The rids SGLang will know the request by (empty when it names none)."""
    rid = obj.get("rid")
    if isinstance(rid, str) and rid:
        text = obj.get("text")
        ids = obj.get("input_ids")
        batch = (isinstance(text, list) and text) or (
            isinstance(ids, list) and ids and isinstance(ids[0], list)
        )
        size = len(text if isinstance(text, list) else ids) if batch else 0
        return [rid, *(f"{rid}_{i}" for i in range(size))]
    if isinstance(rid, list):
        return [r for r in rid if isinstance(r, str) and r]
    return []


class Held:
    """One tracked request: the backend holding it (None while it waits in the queue)."""

    __slots__ = ("aborted", "backend", "rids", "waiting")

    def __init__(self, names: list[str]) -> None:
        self.rids = names
        self.backend: str | None = None
        self.waiting: asyncio.Future | None = None
        self.aborted = False


class Holders:
    def __init__(self) -> None:
        self._by_rid: dict[str, Held] = {}

    def __len__(self) -> int:
        return len(self._by_rid)

    def track(self, names: list[str]) -> Held:
        held = Held(names)
        for r in names:
            self._by_rid[r] = held
        return held

    def forget(self, held: Held) -> None:
        for r in held.rids:
            if self._by_rid.get(r) is held:
                del self._by_rid[r]

    def find(self, rid: str) -> Held | None:
        return self._by_rid.get(rid)

    async def acquire(self, held: Held, acquiring: Awaitable[Leased]) -> Any:
        """Wait for a lease as ``acquiring`` does, cancellable by :meth:`abort_queued`
        (then :class:`Aborted`); note the backend it was bound to."""
        fut = asyncio.ensure_future(acquiring)
        held.backend = None
        held.waiting = fut
        try:
            lease = await fut
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if held.aborted and task is not None and not task.cancelling():
                raise Aborted() from None
            raise
        finally:
            held.waiting = None
        held.backend = lease.backend.name
        return lease

    def abort_queued(self, held: Held) -> bool:
        """Take a request out of the queue (its client is answered :class:`Aborted`); False
        when it is not waiting there."""
        fut = held.waiting
        if fut is None or fut.done():
            return False
        held.aborted = True
        fut.cancel()
        return True

    def abort_all_queued(self) -> int:
        """``abort_all``: every tracked request still waiting in the queue; how many."""
        return sum(self.abort_queued(h) for h in set(self._by_rid.values()))
