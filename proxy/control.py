"""The limits' control loop: cut each backend's observations into windows, feed them to its
limit, apply what it decides.

Admission calls :meth:`LimitControl.tick` after every release and from its background task,
and :meth:`LimitControl.demand` when a request joins its queue; the virtual-time harness
(tests/limit_sim.py) calls them the same way. One backend's step:

1. Between windows: if it has its limit in flight while requests for it wait in the proxy,
   the limit hears of the demand at once (``limit.demand``; a cold start takes what waits).
   Not where another backend could take those requests and this one keeps more than a
   settled window leaves waiting for a first token since a window ago or longer: a wait that
   long is a queue (or a prefill slower than a window), a request sent into it can no longer
   go to whichever backend frees first, and the windows after judge it. A cold start's burst
   has waited no time yet, and with no other backend holding requests back gains nothing.
   Otherwise, is its open window complete? A window lasts ``window_s``; it also ends at once
   when the server's own ``max_running_requests`` first arrives (or changes), so that a cold
   start need not wait a window for it. The window after a change of the
   limit *settles*: it is not judged, and it ends as soon as the requests the change admitted
   have had their prefill (at most ``SETTLED_AWAITING`` of the limit, or two requests, still
   without a first token), or once the backend has answered none for a whole window and for
   longer than the wave took to its last first token (what still waits then waits for room,
   not prefill), or after ``max_window_s`` — a raise is not judged inside its own prefill
   wave, and a backend that keeps requests waiting shows it in the windows after.
   Demand arriving under the limit admits a wave just as a raise does (a cold start's
   clients all at once, after the server's word set the limit with nothing in flight): a
   window in which what is in flight rose by more than a settled window leaves waiting is
   followed by a settling window too.
2. Close it (:meth:`proxy.stats.BackendStats.take_window`) and give it to ``limit.update``.
3. If the limit changed: tell the stats (time at the limit is measured against it), and if it
   fell below what is in flight, recall requests the backend has not started answering (newest
   first): they go back to the proxy's queue, to whichever backend frees first. Only if another
   routable backend could take them: the only one would get them back, and a request recalled
   from it loses its place in its queue (and any prefill done) for nothing.
"""

from __future__ import annotations

import logging
import weakref

from proxy.limits import Decision, Demand
from proxy.routed import Routed
from proxy.stats import BackendStats

log = logging.getLogger("proxy.limits")

#: a settling window ends once at most this share of the limit still waits for a first token
SETTLED_AWAITING = 0.1


class LimitControl:
    """Windows and decisions for every backend (state: which backends are settling, and what
    each had in flight when its last window closed)."""

    def __init__(self) -> None:
        #: backends whose open window settles, and since when (the change, or the arrival)
        self._settling: weakref.WeakKeyDictionary[BackendStats, float]
        self._settling = weakref.WeakKeyDictionary()
        #: the server's max_running_requests each backend's limit has been given
        self._told: weakref.WeakKeyDictionary[BackendStats, int | None] = (
            weakref.WeakKeyDictionary()
        )
        #: requests each backend had in flight when its last window closed
        self._closed_at: weakref.WeakKeyDictionary[BackendStats, int] = weakref.WeakKeyDictionary()

    def tick(self, backends: list[Routed], now: float) -> list[tuple[Routed, Decision]]:
        """Feed every backend whose window is complete; returns the decisions made."""
        out = []
        routable = sum(1 for b in backends if b.routable)
        for b in backends:
            d = self._step(b, now, elsewhere=_elsewhere(b, routable))
            if d is not None:
                out.append((b, d))
        return out

    def demand(self, backends: list[Routed], now: float) -> list[tuple[Routed, Decision]]:
        """The proxy's queue just grew: every backend at its limit with requests waiting for it
        hears of the demand at once (step 1's first half, without waiting for a tick). Only
        raises come of it, so nothing is recalled."""
        out = []
        routable = sum(1 for b in backends if b.routable)
        for b in backends:
            word = b.stats.scrape.max_running_requests
            d = self._demand(b, now, word, elsewhere=_elsewhere(b, routable))
            if d is not None:
                out.append((b, d))
        return out

    def _step(self, b: Routed, now: float, elsewhere: bool) -> Decision | None:
        st, lim = b.stats, b.limit
        settling = self._settling.get(st)
        word = st.scrape.max_running_requests
        news = word is not None and self._told.get(st) != word
        if not news and not self._complete(b, now, settling):
            return self._demand(b, now, word, elsewhere)
        self._told[st] = word
        w = st.take_window(now, elsewhere=elsewhere)
        wave = b.in_flight - self._closed_at.get(st, 0) > _settled(b)
        self._closed_at[st] = b.in_flight
        if settling is not None and not w.restarted:
            del self._settling[st]
            return None
        before = lim.limit
        try:
            d = lim.update(w)
        except Exception:  # a limit's bug must not fail requests: keep the old limit
            log.exception("limit update failed for backend %s", b.name)
            return None
        if lim.limit == before:
            if wave:  # demand arrived at once: its requests have their prefill before a verdict
                self._settling[st] = now
            return d
        self._changed(b, d, before, now, elsewhere)
        return d

    def _demand(self, b: Routed, now: float, word: int | None, elsewhere: bool) -> Decision | None:
        """Between windows: the backend has its limit in flight and requests wait for it (and,
        where another backend could take them, it keeps none waiting for a window: step 1)."""
        st, lim = b.stats, b.limit
        before = lim.limit
        if st.waiters <= 0 or b.in_flight < before:
            return None
        settled = _settled(b)
        if elsewhere and st.awaiting_since(now - lim.settings.window_s, settled) > settled:
            return None  # it keeps requests waiting: hold these for whichever backend frees
        try:
            d = lim.demand(Demand(now, b.in_flight, st.waiters, word, elsewhere))
        except Exception:  # as in a window's update: keep the old limit
            log.exception("limit demand failed for backend %s", b.name)
            return None
        if lim.limit != before:
            self._changed(b, d, before, now, elsewhere)
        return d

    def _changed(
        self, b: Routed, d: Decision | None, before: int, now: float, elsewhere: bool
    ) -> None:
        """Apply a new limit: the window now open settles, and requests above a lower limit
        that the backend has not answered go back to the proxy's queue."""
        st, after = b.stats, b.limit.limit
        self._settling[st] = now
        st.observe_in_flight(b.in_flight, after, now)
        log.info("backend %s limit %s", b.name, d if d is not None else f"{before}->{after}")
        excess = b.in_flight - st.recalling - after
        if excess > 0 and elsewhere:
            st.recall_unanswered(excess)

    @staticmethod
    def _complete(b: Routed, now: float, settling: float | None) -> bool:
        s, st = b.limit.settings, b.stats
        age = now - st.window_started
        if age >= s.max_window_s:
            return True
        if settling is None:
            return age >= s.window_s
        if st.awaiting <= _settled(b):
            return True
        # The wave is over though some still wait: since its last first token the backend has
        # answered none for a whole window, and for longer than the wave took to get there.
        # What waits now waits for room, not for prefill, and the windows after judge it.
        last = st.answered_at
        return (
            last is not None and last >= settling and now - last >= max(s.window_s, last - settling)
        )


def _elsewhere(b: Routed, routable: int) -> bool:
    """Could another of the ``routable`` backends take ``b``'s requests?"""
    return routable > (1 if b.routable else 0)


def _settled(b: Routed) -> float:
    """Requests still without a first token that a settled window may leave."""
    return max(2.0, SETTLED_AWAITING * b.limit.limit)
