"""The proxy's queue: admission with late binding, priorities, bounds and deadlines.

``lease = await admission.acquire(priority, exclude=..., deadline=...)`` returns as soon as some
routable backend is below its limit; the backend is chosen at that moment (late binding) by the
routing policy, and its ``in_flight`` is incremented in the same synchronous step, so a burst
cannot pile onto one backend. Requests that find every backend at its limit wait here, FIFO within
their class (``interactive`` before ``batch``), bounded in number and in time:

- queue full -> :class:`QueueFull` (``retry_after`` seconds; the app answers 429 + Retry-After),
- the request bodies held by waiting requests would exceed ``max_queued_bytes`` with this one
  (``acquire(size=len(body))``) -> :class:`QueueBytesFull` (a :class:`QueueFull`: 429); a waiter's
  bytes are released when it leaves the queue, whichever way,
- waited longer than the deadline -> :class:`QueueTimeout` (503),
- no routable backend (or all excluded) -> :class:`NoHealthyBackend` (503),
- the client went away (the awaiting task is cancelled) -> the waiter leaves the queue at once.

A request of N sequences (a batch, ``n`` > 1: proxy/sequences.py) takes N slots
(``acquire(seqs=N)``): it binds only to a backend with N free slots, or to an idle one (a batch
larger than a backend's whole limit takes all of it, never more). While it waits at the head of
its class nothing behind it in that class or a lower one is handed a slot, so single requests
cannot starve it; the slots free up for it as requests end.

With prefix affinity (``prefix``, proxy/prefix.py) a request carries its prompt's block hashes
(``acquire(prompt=...)``): the bind asks prefix routing instead of the policy, and the index learns
where the prompt went. A request whose prefix's home (where its claims alone would send it) is
full may wait for it rather than take a free slot elsewhere, while that is expected to cost less
than the miss (``_holds_for_home``). And a freed slot may go past the head of a class: the
backend the head would be bound to, unless it is the head's home, takes of the first
``lookahead`` waiters of that class one whose home it is, else the one whose prompt it holds
most of (by the index), if that one holds more than the head's. Fairness: FIFO within a
class otherwise; a waiter later requests went before ``lookahead`` times per backend is not
passed over again and no longer holds out for its home (so no one waits more than that many
requests longer than FIFO would make it, however deep the queue and long the wait;
``lookahead_age_s``, if set, also bounds it in time); a batch never goes before an interactive
request; a head of many sequences is not passed.

Every rejection is counted by reason. ``lease.release()`` is idempotent; it frees the slot and
hands it to the next waiter. ``admission.wake()`` re-runs dispatch after backends, health or
limits changed. After every release, and from a background task (``start()``) when traffic is
idle, admission runs the limits' control loop (proxy/control.py) before it hands slots out.

Backends are duck-typed: ``name``, ``routable``, ``in_flight`` (int, written here), ``limit``
(proxy/limits), ``stats`` (proxy/stats.BackendStats), ``weight``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from itertools import islice
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from proxy.control import LimitControl
from proxy.policies import Policy
from proxy.prefix import PrefixRouting, Prompt
from proxy.routed import Routed
from proxy.tasks import stop_task

log = logging.getLogger("proxy.admission")

Priority = Literal["interactive", "batch"]
PRIORITIES: tuple[Priority, ...] = ("interactive", "batch")


class QueueSettings(BaseModel):
    """``[queue]``."""

    model_config = ConfigDict(extra="forbid")

    max_length: int = Field(1024, ge=0, description="requests waiting at most (then 429)")
    deadline_s: float = Field(30.0, gt=0, description="longest wait in the queue (then 503)")
    max_queued_bytes: int = Field(
        256 * 1024 * 1024,
        ge=0,
        description="request body bytes held by waiting requests at most (then 429; 0 = no cap)",
    )
    priority_header: str = Field(
        "X-Priority", description="request header: 'interactive' (default) or 'batch'"
    )
    batch_api_keys: list[str] = Field(
        default_factory=list, description="client API keys whose requests are 'batch'"
    )
    control_interval_s: float = Field(
        0.25, gt=0, description="how often limits are fed and waiters re-checked when idle"
    )


class AdmissionError(Exception):
    reason = "rejected"


class QueueFull(AdmissionError):
    reason = "queue_full"

    def __init__(self, retry_after: int) -> None:
        super().__init__(f"the proxy's queue is full; retry after {retry_after} s")
        self.retry_after = retry_after


class QueueBytesFull(QueueFull):
    reason = "queue_bytes_full"

    def __init__(self, retry_after: int) -> None:
        super().__init__(retry_after)
        self.args = (
            f"the proxy's queue holds too many request bytes; retry after {retry_after} s",
        )


class QueueTimeout(AdmissionError):
    reason = "queue_timeout"

    def __init__(self, waited_s: float) -> None:
        super().__init__(f"no backend became free within {waited_s:.1f} s")
        self.waited_s = waited_s


class NoHealthyBackend(AdmissionError):
    reason = "no_healthy_backend"

    def __init__(self, message: str = "no healthy backend") -> None:
        super().__init__(message)


class Lease:
    """One admitted request's ``slots`` on ``backend``. ``release()`` is idempotent."""

    __slots__ = (
        "_admission",
        "_released",
        "backend",
        "predicted",
        "priority",
        "slots",
        "waited_s",
    )

    def __init__(
        self,
        admission: Admission,
        backend: Routed,
        priority: Priority,
        waited_s: float,
        slots: int = 1,
        predicted: float | None = None,
    ) -> None:
        self._admission = admission
        self.backend = backend
        self.priority = priority
        self.waited_s = waited_s
        self.slots = slots
        #: the fraction of the prompt prefix routing expected the backend to hold (None: the
        #: request was not routed by its prompt)
        self.predicted = predicted
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._admission._release(self.backend, self.slots)

    def reported(self, prompt_tokens: int | None, cached_tokens: int) -> None:
        """The backend's answer said ``cached_tokens`` of its ``prompt_tokens`` were cached."""
        prefix = self._admission.prefix
        if prefix is not None and self.predicted is not None:
            prefix.report(self.backend.name, self.predicted, prompt_tokens, cached_tokens)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class _Waiter:
    __slots__ = (
        "enqueued",
        "exclude",
        "fut",
        "passed",
        "priority",
        "prompt",
        "seqs",
        "size",
        "timer",
    )

    def __init__(
        self,
        fut: asyncio.Future,
        priority: Priority,
        exclude: frozenset[str],
        now: float,
        size: int = 0,
        seqs: int = 1,
        prompt: Prompt | None = None,
    ) -> None:
        self.fut = fut
        self.priority = priority
        self.exclude = exclude
        self.enqueued = now
        self.size = size
        self.seqs = seqs
        self.prompt = prompt
        self.timer: asyncio.TimerHandle | None = None
        self.passed = 0  # times later requests went before it (prefix affinity's lookahead)


class Admission:
    """The limiter in front of every backend: bounded priority queue + late binding."""

    def __init__(
        self,
        pool: Iterable[Routed],
        policy: Policy,
        *,
        max_queue: int = 1024,
        queue_deadline_s: float = 30.0,
        max_queued_bytes: int = 0,
        probe_in_flight: int = 1,
        control_interval_s: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
        prefix: PrefixRouting | None = None,
    ) -> None:
        self.pool = pool
        self.policy = policy
        self.prefix = prefix
        self.max_queue = max_queue
        self.max_queued_bytes = max_queued_bytes  # 0: no cap
        self.queued_bytes = 0  # request body bytes held by waiters
        self.queue_deadline_s = queue_deadline_s
        self.probe_in_flight = probe_in_flight
        self.control_interval_s = control_interval_s
        self._clock = clock
        self.control = LimitControl()
        self._queues: dict[Priority, dict[int, _Waiter]] = {p: {} for p in PRIORITIES}
        self._seq = 0
        self._task: asyncio.Task | None = None
        # observability
        self.rejections: dict[str, int] = {
            "queue_full": 0,
            "queue_bytes_full": 0,
            "queue_timeout": 0,
            "no_healthy_backend": 0,
            "client_gone": 0,
        }
        self.admitted: dict[Priority, int] = {p: 0 for p in PRIORITIES}
        self.queued_total: dict[Priority, int] = {p: 0 for p in PRIORITIES}
        self.wait_sum_s: dict[Priority, float] = {p: 0.0 for p in PRIORITIES}
        self._recent_waits: dict[Priority, deque[float]] = {
            p: deque(maxlen=2048) for p in PRIORITIES
        }
        #: optional hook ``(priority, waited_s, outcome)`` for metrics; outcome is "admitted"
        #: or a rejection reason. Called for requests that waited in the queue.
        self.on_wait: Callable[[str, float, str], None] | None = None

    @classmethod
    def from_settings(
        cls,
        pool: Iterable[Routed],
        policy: Policy,
        queue: QueueSettings,
        *,
        probe_in_flight: int = 1,
        prefix: PrefixRouting | None = None,
    ) -> Admission:
        return cls(
            pool,
            policy,
            prefix=prefix,
            max_queue=queue.max_length,
            queue_deadline_s=queue.deadline_s,
            max_queued_bytes=queue.max_queued_bytes,
            probe_in_flight=probe_in_flight,
            control_interval_s=queue.control_interval_s,
        )

    # ---- the request path --------------------------------------------------------------

    async def acquire(
        self,
        priority: Priority = "interactive",
        exclude: Iterable[str] = frozenset(),
        deadline: float | None = None,
        *,
        front: bool = False,
        size: int = 0,
        seqs: int = 1,
        prompt: Prompt | None = None,
    ) -> Lease:
        """Wait for a slot and bind a backend. ``deadline``: longest wait in seconds (default
        the queue's ``deadline_s``). ``exclude``: backend names not to use (retries).
        ``front``: a request recalled from a backend's queue: it waits first in its class and
        is never refused for a full queue (it was admitted once already); its caller passes
        what is left of its deadline. ``size``: the request body's bytes, held while it waits
        (a recalled request's count but never refuse it). ``seqs``: the sequences it runs, the
        slots it takes (see the module docstring). ``prompt``: its block hashes, for prefix
        routing (proxy/prefix.py)."""
        if priority not in self._queues:
            priority = "interactive"
        exclude = frozenset(exclude)
        now = self._clock()
        backends = self._backends()
        self.control.tick(backends, now)
        if not any(self._usable(b, exclude) for b in backends):
            self._reject("no_healthy_backend")
            raise NoHealthyBackend()
        seqs = max(int(seqs), 1)
        if self.prefix is None:
            prompt = None
        if (front or not self._ahead(priority)) and self._holds_for_home(
            backends, exclude, prompt, seqs, 0.0
        ) is None:
            lease = self._bind(backends, exclude, priority, 0.0, seqs, prompt)
            if lease is not None:
                return lease
        if self.depth >= self.max_queue and not front:
            self._reject("queue_full")
            raise QueueFull(self.retry_after())
        if self.max_queued_bytes and not front and self.queued_bytes + size > self.max_queued_bytes:
            self._reject("queue_bytes_full")
            raise QueueBytesFull(self.retry_after())
        return await self._wait(priority, exclude, now, deadline, front, size, seqs, prompt)

    async def _wait(
        self,
        priority: Priority,
        exclude: frozenset[str],
        now: float,
        deadline: float | None,
        front: bool = False,
        size: int = 0,
        seqs: int = 1,
        prompt: Prompt | None = None,
    ) -> Lease:
        loop = asyncio.get_running_loop()
        waiter = _Waiter(loop.create_future(), priority, exclude, now, size, seqs, prompt)
        self.queued_bytes += size
        self._seq += 1
        key = self._seq
        if front:
            self._queues[priority] = {key: waiter, **self._queues[priority]}
        else:
            self._queues[priority][key] = waiter
        self.queued_total[priority] += 1
        timeout = self.queue_deadline_s if deadline is None else max(deadline, 0.0)
        waiter.timer = loop.call_later(timeout, self._expire, priority, key)
        # A slot may be free: the waiters ahead hold out for their prefix's home, or this one
        # does. Hand out now, as a release would, rather than at the next release or tick;
        # and a limit that takes what waits (a cold start) hears of this one at once.
        backends = self._backends()
        self._dispatch(backends, now)
        if self.control.demand(backends, now):
            self._dispatch(backends, now)
        try:
            return await waiter.fut
        except asyncio.CancelledError:
            fut = waiter.fut
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                fut.result().release()  # bound just as the client left: give the slot back
            self._reject("client_gone", priority, self._clock() - waiter.enqueued)
            raise
        finally:
            waiter.timer.cancel()
            self.queued_bytes -= size  # however it left: admitted, timed out, refused, gone
            self._queues[priority].pop(key, None)
            self._note_waiters()

    def wake(self) -> None:
        """Backends, health or limits changed: hand free slots to waiters, fail the hopeless."""
        self._dispatch(self._backends(), self._clock())

    # ---- background control --------------------------------------------------------------

    def start(self) -> asyncio.Task:
        """Feed limits and re-dispatch periodically (idle backends still get their windows)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._control_loop())
        return self._task

    async def close(self) -> None:
        task, self._task = self._task, None
        await stop_task(task)

    async def _control_loop(self) -> None:
        while True:
            await asyncio.sleep(self.control_interval_s)
            try:
                backends = self._backends()
                now = self._clock()
                self.control.tick(backends, now)
                self._dispatch(backends, now)
            except Exception:  # never let the control loop die; the next tick retries
                continue

    # ---- read side ----------------------------------------------------------------------

    @property
    def depth(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def depth_by_class(self) -> dict[str, int]:
        return {p: len(q) for p, q in self._queues.items()}

    def oldest_wait_s(self, priority: Priority) -> float:
        q = self._queues[priority]
        if not q:
            return 0.0
        return self._clock() - next(iter(q.values())).enqueued

    def retry_after(self) -> int:
        """Seconds until the queue has drained at the backends' measured completion rate."""
        rate = 0.0
        for b in self._backends():
            if b.routable:
                rate += b.stats.completions_per_s
        if rate <= 0:
            return 1
        return int(min(60, max(1, math.ceil(self.depth / rate))))

    def snapshot(self) -> dict:
        out: dict[str, Any] = {
            "depth": self.depth,
            "max_length": self.max_queue,
            "queued_bytes": self.queued_bytes,
            "max_queued_bytes": self.max_queued_bytes,
            "deadline_s": self.queue_deadline_s,
            "rejections": dict(self.rejections),
            "classes": {},
        }
        for p in PRIORITIES:
            waits = sorted(self._recent_waits[p])
            out["classes"][p] = {
                "depth": len(self._queues[p]),
                "oldest_wait_s": self.oldest_wait_s(p),
                "admitted": self.admitted[p],
                "queued": self.queued_total[p],
                "wait_s_sum": self.wait_sum_s[p],
                "wait_s_p50": _pct(waits, 0.5),
                "wait_s_p99": _pct(waits, 0.99),
            }
        return out

    # ---- internals ----------------------------------------------------------------------

    def _backends(self) -> list[Routed]:
        return list(self.pool)

    @staticmethod
    def _usable(b: Routed, exclude: frozenset[str]) -> bool:
        return bool(b.routable) and b.name not in exclude

    def _cap(self, b: Routed) -> int:
        cap = int(b.limit.limit)
        if not b.stats.trusted:
            cap = min(cap, self.probe_in_flight)
        return cap

    def _ahead(self, priority: Priority) -> bool:
        """Is anyone of this class or a higher one already waiting?"""
        for p in PRIORITIES:
            if self._queues[p]:
                return True
            if p == priority:
                return False
        return False

    def _fits(self, b: Routed, seqs: int) -> bool:
        """Room for ``seqs`` slots: that many free, or (a batch larger than the limit) idle."""
        cap = self._cap(b)
        return b.in_flight + seqs <= cap or (b.in_flight == 0 and cap > 0)

    def _bind(
        self,
        backends: list[Routed],
        exclude: frozenset[str],
        priority: Priority,
        waited: float,
        seqs: int = 1,
        prompt: Prompt | None = None,
    ) -> Lease | None:
        cands = self._free(backends, exclude, seqs)
        if not cands:
            return None
        predicted = None
        if prompt is not None and self.prefix is not None:
            b, blocks = self.prefix.pick(cands, prompt, backends)
            predicted = self.prefix.learn(b, prompt, blocks, backends)
        else:
            b = self.policy.pick(cands) if len(cands) > 1 else cands[0]
        slots = min(seqs, max(self._cap(b), 1))  # never more than the whole limit
        # No await between the pick and this increment.
        b.in_flight += slots
        b.stats.observe_in_flight(b.in_flight, b.limit.limit)
        self.admitted[priority] += 1
        return Lease(self, b, priority, waited, slots, predicted)

    def _free(self, backends: list[Routed], exclude: frozenset[str], seqs: int) -> list[Routed]:
        """The candidates: usable, not excluded, with room for ``seqs`` slots."""
        if seqs == 1:
            return [b for b in backends if self._usable(b, exclude) and b.in_flight < self._cap(b)]
        return [b for b in backends if self._usable(b, exclude) and self._fits(b, seqs)]

    def _release(self, b: Routed, slots: int = 1) -> None:
        b.in_flight = max(0, b.in_flight - slots)
        b.stats.observe_in_flight(b.in_flight, b.limit.limit)
        backends = self._backends()
        now = self._clock()
        self.control.tick(backends, now)
        self._dispatch(backends, now)

    def _dispatch(self, backends: list[Routed], now: float) -> None:
        if not self.depth:
            return
        try:
            self._hand_out(backends, now)
        finally:
            self._note_waiters(backends)

    def _holds_for_home(
        self,
        backends: list[Routed],
        exclude: frozenset[str],
        prompt: Prompt | None,
        seqs: int,
        waited: float,
        holding: dict[str, int] | None = None,
        passed: int = 0,
    ) -> Routed | None:
        """The full backend this request waits for instead of taking a free slot elsewhere:
        its prefix's home (proxy/prefix.py), within its load bound, when the wait for a slot
        there is expected to cost less than the miss elsewhere (``PrefixRouting.worth_waiting``;
        ``holding``: how many wait for each home already, unknown for an arrival: then every
        waiter counts). Not once later requests went before it ``lookahead`` times per backend
        (``PrefixRouting.may_pass``; ``passed``), never more than ``lookahead`` holders for one
        home: a hot prefix still spreads."""
        prefix = self.prefix
        if (
            prefix is None
            or prompt is None
            or seqs > 1
            or prefix.lookahead <= 1
            or not prefix.may_pass(passed, waited, len(backends))
            or (holding is None and self.depth >= prefix.lookahead)
        ):
            return None
        home = prefix.home(prompt, backends)
        if (
            home is None
            or not self._usable(home, exclude)
            or home.in_flight < self._cap(home)
            or not prefix.within_bound(home, backends)
        ):
            return None
        holders = self.depth if holding is None else holding.get(home.name, 0)
        if holders >= prefix.lookahead:
            return None
        free = self._free(backends, exclude, 1)
        return home if prefix.worth_waiting(prompt, home, free, holders) else None

    def _hand_out(self, backends: list[Routed], now: float) -> None:
        holding: dict[str, int] = {}  # waiters left waiting for their prefix's home, by home
        held: list[_Waiter] = []  # ...and those waiters: each bind behind them passes them
        for p in PRIORITIES:
            q = self._queues[p]
            for key in list(q):
                w = q.get(key)
                if w is None:
                    continue
                if w.fut.done():
                    q.pop(key, None)
                    continue
                if not any(self._usable(b, w.exclude) for b in backends):
                    q.pop(key, None)
                    self._reject("no_healthy_backend", p, now - w.enqueued)
                    w.fut.set_exception(NoHealthyBackend())
                    continue
                if not any(
                    self._usable(b, frozenset()) and b.in_flight < self._cap(b) for b in backends
                ):
                    return  # no free slot anywhere: nothing more to hand out
                while self._pulled_past(backends, q, key, w, p, now):
                    if not any(
                        self._usable(b, frozenset()) and b.in_flight < self._cap(b)
                        for b in backends
                    ):
                        return  # a later waiter took the last free slot; w stays first
                waited = now - w.enqueued
                home = self._holds_for_home(
                    backends, w.exclude, w.prompt, w.seqs, waited, holding, w.passed
                )
                if home is not None:
                    holding[home.name] = holding.get(home.name, 0) + 1
                    held.append(w)
                    continue  # it waits for its home to free a slot; a later waiter may go
                lease = self._bind(backends, w.exclude, p, waited, w.seqs, w.prompt)
                if lease is None:
                    if w.seqs > 1:
                        return  # a batch at the head waits for its slots: nobody jumps it
                    continue  # this waiter's allowed backends are full; a later one may fit
                q.pop(key, None)
                self._observe_wait(p, waited, "admitted")
                w.fut.set_result(lease)
                for h in held:
                    h.passed += 1

    def _pulled_past(
        self,
        backends: list[Routed],
        q: dict[int, _Waiter],
        key: int,
        w: _Waiter,
        p: Priority,
        now: float,
    ) -> bool:
        """The backend ``w`` would be bound to, when it is not ``w``'s prefix's home, takes
        instead the waiter among the first ``lookahead`` of its class whose home it is (else
        the one whose prompt it holds more of than ``w``'s): the backend pulls the work its
        cache fits, so a queue does not scatter a prefix over whichever backend frees first.
        False when none does, or ``w`` may not be passed (``PrefixRouting.may_pass``, no
        prompt, or many sequences). Each waiter the one taken goes before counts it."""
        prefix = self.prefix
        if (
            prefix is None
            or prefix.lookahead <= 1
            or w.prompt is None
            or w.seqs > 1
            or not prefix.may_pass(w.passed, now - w.enqueued, len(backends))
        ):
            return False
        cands = self._free(backends, w.exclude, 1)
        if not cands:
            return False
        b, blocks = prefix.pick(cands, w.prompt, backends)
        if b in prefix.holders(w.prompt, backends):
            return False  # w goes where its prefix lives
        best = (False, blocks)
        chosen: tuple[int, _Waiter] | None = None
        for k2, w2 in islice(q.items(), prefix.lookahead):
            if (
                k2 == key
                or w2.prompt is None
                or w2.seqs > 1
                or w2.fut.done()
                or b.name in w2.exclude
            ):
                continue
            # a waiter whose prefix lives on b first, then the one b holds most of
            score = (
                b in prefix.holders(w2.prompt, backends),
                prefix.index.matched(w2.prompt, b.name),
            )
            if score > best:
                best, chosen = score, (k2, w2)
        if chosen is None:
            return False
        k2, w2 = chosen
        waited = now - w2.enqueued
        lease = self._bind([b], w2.exclude, p, waited, 1, w2.prompt)
        if lease is None:
            return False
        for k3, w3 in q.items():  # everyone ahead of it was passed over
            if k3 == k2:
                break
            w3.passed += 1
        q.pop(k2, None)
        self._observe_wait(p, waited, "admitted")
        w2.fut.set_result(lease)
        return True

    def _expire(self, priority: Priority, key: int) -> None:
        w = self._queues[priority].pop(key, None)
        if w is None or w.fut.done():
            return
        waited = self._clock() - w.enqueued
        self._reject("queue_timeout", priority, waited)
        w.fut.set_exception(QueueTimeout(waited))
        self._note_waiters()

    def _note_waiters(self, backends: list[Routed] | None = None) -> None:
        """Tell every backend's stats how many requests wait here: a backend at its limit while
        they do is under *pressure* (demand above its limit), which its limit reads. Each is
        told its share of the queue, split by limits, so that a limit climbing under a backlog
        can size its step to what waits for it (the shares add up to the queue)."""
        depth = self.depth
        backends = self._backends() if backends is None else backends
        total = sum(b.limit.limit for b in backends if b.routable)
        for b in backends:
            b.stats.observe_waiters(
                depth if not total else math.ceil(depth * b.limit.limit / total)
            )

    def _reject(
        self, reason: str, priority: str | None = None, waited: float | None = None
    ) -> None:
        self.rejections[reason] = self.rejections.get(reason, 0) + 1
        if priority is not None and waited is not None and self.on_wait is not None:
            self.on_wait(priority, waited, reason)

    def _observe_wait(self, priority: Priority, waited: float, outcome: str) -> None:
        self.wait_sum_s[priority] += waited
        self._recent_waits[priority].append(waited)
        if self.on_wait is not None:
            self.on_wait(priority, waited, outcome)


def _pct(sorted_xs: list[float], q: float) -> float | None:
    if not sorted_xs:
        return None
    return sorted_xs[min(len(sorted_xs) - 1, int(q * len(sorted_xs)))]
