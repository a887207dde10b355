"""Prefix-cache-aware routing: send a prompt where its prefix is already cached.

SGLang (RadixAttention) keeps the KV cache of every prompt prefix it computed until it needs the
room, so a request whose prefix a backend holds skips that much prefill. What this optimises:
each request's **expected completion**, the latency policy's estimate, where the prefix a
backend is expected to hold discounts its TTFT (the fraction of the prompt it holds is prefill it
skips), under a **bounded load**: a backend more loaded than ``load_factor`` times its share of
what the fleet has in flight loses its claim, so a hot prefix spreads before one backend queues
it (loosely: each backend's limit already keeps it from queueing, and moving a prefix costs a
miss). Nothing here knows a backend's shape; the estimate reads only measured TTFT, ITL and load.

The request path, as named steps:

1. ``prompt_of(body)``: the request's routing text (chat messages in order, role and content; or
   ``prompt`` / ``text`` / ``input_ids`` / ``input``), cut into ``block_chars`` blocks, each
   hashed *chained* (block i's hash covers blocks 0..i). No tokenizer: the blocks are bytes of
   text, so a prefix match is a lookup of successive hashes. Hashed once per request.
2. ``PrefixRouting.pick(candidates, prompt, backends)``: which backend with a free slot takes it
   (below), and how many of its blocks the index says that backend holds.
3. ``PrefixRouting.learn(backend, prompt, blocks, backends)``: at the bind, the backend now
   holds this prompt; it is the prompt's *home* if none of the routable backends held it, or
   it was the home already (a request bound elsewhere leaves a copy, not a new home).
4. ``PrefixRouting.report(backend, predicted, prompt_tokens, cached_tokens)``: what the backend
   said it had cached (``usage.prompt_tokens_details.cached_tokens``, ``meta_info.cached_tokens``)
   corrects how far the index's claims on it are trusted.

The choice among candidates:

- each candidate's *claim* is the fraction of the prompt it is expected to hold (matched blocks /
  prompt, times its trust), zero when it is beyond its load bound;
- its cost is the latency policy's expected completion with TTFT discounted by the claim, less
  that discount once more for every request the backend runs: a prefill it skips would have
  stalled each of them (SGLang batches prefill with decode);
- among the candidates within ``NEAR_BEST`` of the cheapest cost, the longest match wins (the
  matches within ``NEAR_BEST`` of it count as equal, and the prefix's **home** wins among
  them: the backend it was placed on, which its traffic keeps warm in an LRU cache; the copies
  left where its overflow went take what the home has no room for, and age out when unused);
  the load bound is what
  keeps a hot prefix from piling up (consistent hashing with bounded loads). Trust discounts a
  claim against backends that hold nothing, never re-ranks the backends that hold it: a trust
  that moves with every report would move prefixes from backend to backend, and each move
  evicts;
- with no claim there (a cold prefix, or a unique prompt), the least busy among them (the
  share of its limit in flight; within their load bound): with no cache to weigh, only load
  tells them apart, and new groups land evenly. Rendezvous hashing of the leading block breaks
  exact ties, so at an idle fleet, whatever the limits, the groups spread by their hash (not
  all onto the backend whose limit grew first), and replicas of the proxy that share nothing
  send a new prefix group to the same backend, given the same backend names.

The index (:class:`PrefixIndex`) is one bounded LRU map, chained block hash -> the backends that
were sent it (a bit mask), learnt from what the proxy routed, capped in bytes. Leading blocks are
touched last, so an old prompt loses its tail first.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import orjson

from proxy.routed import Routed, busy_share

_T = TypeVar("_T")

#: costs within this fraction of the cheapest candidate's count as equally good: affinity, then
#: load, decides among them (the estimate is not finer than that)
NEAR_BEST = 0.10
#: weight of one report in a backend's trust (an EWMA of reported / predicted cached fraction)
TRUST_ALPHA = 0.2
#: bytes one index entry takes at most (its hash, bit mask, LRU links, its share of the hash
#: table just after it grew: 160-225 measured; and its share of the home map), checked in
#: tests/test_prefix.py
ENTRY_BYTES = 240
#: the home map ((leading block, backend) -> when last sent there as its home) holds this many
#: times fewer entries than the block map: a prompt has many blocks and one leading block
HOME_SHARE = 16
#: default ``lookahead`` (``[routing] prefix_lookahead``): waiters holding out for one home at
#: most, and the depth a freed slot looks into the queue. ``worth_waiting`` decides whether to
#: hold; this only bounds it, so it is about a backend's limit, not a few: a home's load swings
#: above its limit by more than a few when requests pick their prefix at random, and each
#: waiter turned away then is a miss that also evicts another prefix where it lands
LOOKAHEAD = 32


@dataclass(frozen=True, slots=True)
class Prompt:
    """A request's routing text as chained block hashes (one per whole block)."""

    hashes: tuple[int, ...]
    chars: int  # the routing text's length in bytes (UTF-8)
    block: int  # block size in bytes

    def fraction(self, blocks: int) -> float:
        """The share of the prompt that ``blocks`` leading blocks are."""
        return min(1.0, blocks * self.block / self.chars) if self.chars else 0.0


def routing_text(obj: dict[str, Any]) -> bytes:
    """What a backend's prefix cache would hold first of this request, as bytes: a chat's
    messages in order (role, then content), Anthropic's ``system`` before them; else the
    ``prompt`` / ``text`` / ``input_ids`` / ``input`` field. Empty when there is none."""
    messages = obj.get("messages")
    if isinstance(messages, list):
        parts = []
        system = obj.get("system")
        if system is not None:
            parts.append(b"system\n" + _text(system) + b"\n")
        for m in messages:
            if isinstance(m, dict):
                parts.append(_text(m.get("role")) + b"\n" + _text(m.get("content")) + b"\n")
        return b"".join(parts)
    for key in ("prompt", "text", "input_ids", "input"):
        value = obj.get(key)
        if value is not None:
            return _text(value)
    return b""


def _text(value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode("utf-8", "surrogatepass")
    if value is None:
        return b""
    try:
        return orjson.dumps(value)  # content parts, token ids: a prefix stays a prefix
    except (orjson.JSONEncodeError, TypeError):
        return b""


def prompt_of(obj: dict[str, Any] | None, block: int) -> Prompt | None:
    """The request's chained block hashes; None without a whole block of routing text."""
    if obj is None:
        return None
    text = routing_text(obj)
    n = len(text) // block
    if not n:
        return None
    h = hashlib.blake2b(digest_size=8)
    hashes = []
    for i in range(0, n * block, block):
        h.update(text[i : i + block])
        hashes.append(int.from_bytes(h.copy().digest(), "little"))
    return Prompt(tuple(hashes), len(text), block)


def rendezvous(lead: int, candidates: Sequence[Routed]) -> Routed:
    """Highest random weight of (leading block, backend name), scaled by weight: the same
    answer in every process for the same names, and a removed backend moves only its share."""
    key = lead.to_bytes(8, "little")
    best, best_score = candidates[0], -1.0
    for b in candidates:
        d = hashlib.blake2b(key + b.name.encode(), digest_size=8).digest()
        u = (int.from_bytes(d, "little") + 1) / (2.0**64 + 2)  # in (0, 1)
        score = max(float(b.weight or 1.0), 1e-6) / -math.log(u)
        if score > best_score:
            best, best_score = b, score
    return best


@dataclass(slots=True)
class BackendPrefix:
    """What the index knows of one backend: its claims' trust and the predicted hit counts."""

    bit: int
    trust: float = 1.0
    prompt_chars: int = 0  # routing text of requests bound to it
    matched_chars: int = 0  # of those, what the index predicted it held
    reports: int = 0
    stale: int = 0  # reports of under half what was predicted

    def snapshot(self) -> dict[str, Any]:
        rate = self.matched_chars / self.prompt_chars if self.prompt_chars else None
        return {
            "prompt_chars": self.prompt_chars,
            "matched_chars": self.matched_chars,
            "predicted_hit_rate": rate,
            "trust": self.trust,
            "reports": self.reports,
            "stale_reports": self.stale,
        }


class PrefixIndex:
    """Chained block hash -> bit mask of the backends sent a prompt with that prefix; LRU,
    at most ``max_bytes`` (``ENTRY_BYTES`` an entry)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.max_entries = max(max_bytes // ENTRY_BYTES, 1)
        self._map: OrderedDict[int, int] = OrderedDict()
        #: (leading block, backend) -> the sequence number of the last prompt with that leading
        #: block sent to that backend as its home (LRU, ``max_entries // HOME_SHARE``)
        self._homed: OrderedDict[int, int] = OrderedDict()
        self._seq = 0
        self.backends: dict[str, BackendPrefix] = {}
        self.evicted = 0
        self.away = 0  # prompts sent to a backend other than their home (a copy there)

    def _backend(self, name: str) -> BackendPrefix:
        bp = self.backends.get(name)
        if bp is None:
            bp = self.backends[name] = BackendPrefix(bit=1 << len(self.backends))
        return bp

    # ---- read ----------------------------------------------------------------------------

    def matches(self, prompt: Prompt, names: Iterable[str]) -> dict[str, int]:
        """Leading blocks of ``prompt`` each named backend was sent (only those with any)."""
        want = [(n, bp.bit) for n in names if (bp := self.backends.get(n)) is not None]
        if not want:
            return {}
        mask = 0
        for _, bit in want:
            mask |= bit
        out: dict[str, int] = {}
        get = self._map.get
        for i, h in enumerate(prompt.hashes):
            m = get(h)
            if m is None:
                break
            if m & mask:
                for name, bit in want:
                    if m & bit:
                        out[name] = i + 1
        return out

    def matched(self, prompt: Prompt, name: str) -> int:
        return self.matches(prompt, (name,)).get(name, 0)

    def homed_at(self, prompt: Prompt, name: str) -> int:
        """When (a sequence number, 0: never, or forgotten) a prompt with ``prompt``'s leading
        block was last sent to ``name`` as its home."""
        bp = self.backends.get(name)
        return 0 if bp is None else self._homed.get(_home_key(prompt, bp), 0)

    def trust(self, name: str) -> float:
        bp = self.backends.get(name)
        return 1.0 if bp is None else bp.trust

    @property
    def entries(self) -> int:
        return len(self._map)

    @property
    def max_homed(self) -> int:
        """Entries of the home map at most (its bytes are counted in ``ENTRY_BYTES``)."""
        return max(self.max_entries // HOME_SHARE, 1)

    @property
    def bytes(self) -> int:
        return len(self._map) * ENTRY_BYTES

    # ---- write ---------------------------------------------------------------------------

    def learn(
        self, name: str, prompt: Prompt, matched_blocks: int = 0, *, home: bool = True
    ) -> None:
        """``name`` was sent ``prompt`` (it holds it once prefilled); ``matched_blocks``: what
        the index predicted it held, for the predicted hit rate; ``home``: as the prompt's home
        (else it holds a copy, and the home stays where it was)."""
        bp = self._backend(name)
        bp.prompt_chars += prompt.chars
        bp.matched_chars += min(matched_blocks * prompt.block, prompt.chars)
        bit = bp.bit
        d = self._map
        for h in reversed(prompt.hashes):  # leading blocks last: evicted last
            d[h] = d.get(h, 0) | bit
            d.move_to_end(h)
        extra = len(d) - self.max_entries
        for _ in range(extra):
            d.popitem(last=False)
        if extra > 0:
            self.evicted += extra
        if not home:
            self.away += 1
            return
        self._seq += 1
        homed = self._homed
        key = _home_key(prompt, bp)
        homed[key] = self._seq
        homed.move_to_end(key)
        if len(homed) > self.max_homed:
            homed.popitem(last=False)

    def report(
        self, name: str, predicted: float, prompt_tokens: int | None, cached_tokens: int
    ) -> None:
        """The backend said it had ``cached_tokens`` of ``prompt_tokens`` cached where the index
        predicted the fraction ``predicted``. Far fewer means its older claims outlived its
        cache (evicted, flushed, restarted, or no prefix cache at all): its trust falls, and
        so does the weight of every claim on it; matching reports restore it."""
        if predicted <= 0 or not prompt_tokens:
            return
        bp = self._backend(name)
        sample = min(1.0, cached_tokens / prompt_tokens / predicted)
        bp.reports += 1
        if sample < 0.5:
            bp.stale += 1
        bp.trust += TRUST_ALPHA * (sample - bp.trust)

    def snapshot(self) -> dict[str, Any]:
        return {
            "entries": self.entries,
            "bytes": self.bytes,
            "max_bytes": self.max_bytes,
            "evicted": self.evicted,
            "away_from_home": self.away,
            "home_entries": len(self._homed),
            "home_max": self.max_homed,
            "backends": {n: bp.snapshot() for n, bp in self.backends.items()},
        }


def _home_key(prompt: Prompt, bp: BackendPrefix) -> int:
    return (prompt.hashes[0] << 16) | (bp.bit.bit_length() - 1)


class Estimate(Protocol):
    """The latency policy's expected completion (proxy/policies.Latency)."""

    def mean_output(self, candidates: Sequence[Routed]) -> float: ...

    def expected_completion(self, b: Routed, out_tokens: float, cached: float = 0.0) -> float: ...


@dataclass(frozen=True, slots=True)
class _Fleet:
    """What the routable fleet has in flight, and the sum of its limits."""

    in_flight: int
    limit: int

    @classmethod
    def of(cls, backends: Sequence[Routed]) -> _Fleet:
        in_flight = limit = 0
        for x in backends:
            if x.routable:
                in_flight += x.in_flight
                limit += x.limit.limit
        return cls(in_flight, limit)


@dataclass(frozen=True, slots=True)
class _Scored:
    cost: float
    claim: float
    backend: Routed
    blocks: int


class PrefixRouting:
    """The choice among backends with a free slot for a request with a prompt (see the module
    docstring), and the queue's lookahead parameters admission reads."""

    def __init__(
        self,
        index: PrefixIndex,
        estimate: Estimate,
        *,
        block_chars: int = 128,
        load_factor: float = 2.0,
        lookahead: int = LOOKAHEAD,
        lookahead_age_s: float | None = None,
    ) -> None:
        self.index = index
        self.estimate = estimate
        self.block_chars = block_chars
        self.load_factor = load_factor
        self.lookahead = lookahead
        self.lookahead_age_s = lookahead_age_s

    def prompt(self, obj: dict[str, Any] | None) -> Prompt | None:
        return prompt_of(obj, self.block_chars)

    def may_pass(self, passed: int, waited: float, fleet: int) -> bool:
        """Whether a waiter that later requests went before ``passed`` times (and that waited
        ``waited`` s) may be passed over again, or hold out for its prefix's home, in a fleet of
        ``fleet`` backends. Up to ``lookahead`` waiters hold out for one home, each for a slot
        there, and about one bind in ``fleet`` frees a given backend: so ``lookahead`` times
        ``fleet`` passes, about what it takes for the home to free a slot for each of them.
        No one waits more than that many requests longer than FIFO would make it, at any queue
        depth and time scale (and, if ``lookahead_age_s`` is set, never once it waited that
        long)."""
        if passed >= self.lookahead * max(fleet, 1):
            return False
        return self.lookahead_age_s is None or waited < self.lookahead_age_s

    def within_bound(self, b: Routed, backends: Sequence[Routed]) -> bool:
        """One more request keeps ``b`` within ``load_factor`` x its share (by limit) of what
        the routable fleet would have in flight (consistent hashing with bounded loads)."""
        return self._within(b, _Fleet.of(backends))

    def _within(self, b: Routed, fleet: _Fleet) -> bool:
        if fleet.limit <= 0:
            return True
        bound = math.ceil(self.load_factor * (fleet.in_flight + 1) * b.limit.limit / fleet.limit)
        return b.in_flight + 1 <= bound

    def pick(
        self, candidates: Sequence[Routed], prompt: Prompt, backends: Sequence[Routed]
    ) -> tuple[Routed, int]:
        """The backend for ``prompt`` and the blocks the index says it holds."""
        matched = self.index.matches(prompt, (b.name for b in candidates))
        if len(candidates) == 1:
            b = candidates[0]
            return b, matched.get(b.name, 0)
        out = self.estimate.mean_output(candidates)
        fleet = _Fleet.of(backends)
        scored = []
        for b in candidates:
            blocks = matched.get(b.name, 0)
            claim = 0.0
            if blocks and self._within(b, fleet):
                claim = prompt.fraction(blocks) * self.index.trust(b.name)
            cost = self.estimate.expected_completion(b, out, claim)
            if claim > 0 and measured(cost):
                # the prefill it skips would also have stalled every request b runs
                cost = max(cost - self._prefill(b, out, claim) * b.in_flight, 0.0)
            scored.append(_Scored(cost, claim, b, blocks))
        near = near_best(scored, [s.cost for s in scored])
        claimed = [s for s in near if s.claim > 0]
        if claimed:
            b = self._home_of(prompt, _longest_holders([(s.backend, s.blocks) for s in claimed]))
            return b, matched.get(b.name, 0)
        pool = [s.backend for s in near if self._within(s.backend, fleet)]
        pool = pool or [s.backend for s in near]
        least = min(busy_share(b) for b in pool)
        b = rendezvous(prompt.hashes[0], [b for b in pool if busy_share(b) == least])
        return b, matched.get(b.name, 0)

    def home(self, prompt: Prompt, backends: Sequence[Routed]) -> Routed | None:
        """Where ``prompt`` would go if every routable backend had a free slot, by its claims
        alone (the longest; among equals, its home); None when none claims it. The queue
        reads it to let a freed slot pull the waiters whose prefix lives there."""
        holders = self.holders(prompt, backends)
        return self._home_of(prompt, holders) if holders else None

    def holders(self, prompt: Prompt, backends: Sequence[Routed]) -> list[Routed]:
        """The routable backends holding the longest match of ``prompt`` (within NEAR_BEST of
        it): a hot prefix that spread is held equally by each of them."""
        matched = self.index.matches(prompt, [b.name for b in backends if b.routable])
        return _longest_holders([(b, matched[b.name]) for b in backends if b.name in matched])

    def _home_of(self, prompt: Prompt, equal: Sequence[Routed]) -> Routed:
        """Of backends holding ``prompt`` equally (``_longest_holders``), its home: the one it
        was last sent to as its home (see :meth:`learn`). The home's cache is the one the
        prefix's traffic keeps warm, so it is the likeliest to hold it still; a copy left where
        its overflow went takes overflow again while it lasts, but does not draw the prefix
        away (were each overflow a move, groups would wander from backend to backend, each
        move evicting another prefix where it lands, and their load would drift out of
        balance). Rendezvous hashing of the leading block among copies none of which is home."""
        homed = [(self.index.homed_at(prompt, b.name), b) for b in equal]
        last = max(seq for seq, _ in homed)
        return rendezvous(prompt.hashes[0], [b for seq, b in homed if seq == last])

    def _prefill(self, b: Routed, out: float, claim: float) -> float:
        """Seconds of ``b``'s TTFT that a hit on ``claim`` of the prompt skips (none known
        without data)."""
        whole = self.estimate.expected_completion(b, out)
        if not measured(whole):
            return 0.0
        return whole - self.estimate.expected_completion(b, out, claim)

    def worth_waiting(
        self, prompt: Prompt, home: Routed, free: Sequence[Routed], holders: int
    ) -> bool:
        """Whether waiting for a slot on ``home`` (full; ``holders`` wait for it already) is
        expected to cost less than taking a free one elsewhere. The wait: one slot frees every
        E2E / in-flight seconds there, and the holders go first. The miss, on the cheapest free
        backend: the prefill of what the home holds beyond what that backend holds itself (a
        hot prefix is held by several), paid by this request and, batched with their decode,
        by every request that backend runs (the eviction of another prefix it causes is not
        counted: the rule errs toward not waiting)."""
        if not free:
            return True
        matched = self.index.matches(prompt, [home.name, *(b.name for b in free)])
        claim = prompt.fraction(matched.get(home.name, 0)) * self.index.trust(home.name)
        out = self.estimate.mean_output([home, *free])
        e2e = self.estimate.expected_completion(home, out)
        if claim <= 0 or not measured(e2e):
            return False
        wait = (holders + 1) * e2e / max(home.in_flight, 1)
        miss = math.inf
        for b in free:
            if not measured(self.estimate.expected_completion(b, out)):
                return False  # unmeasured: the latency policy probes it
            held = prompt.fraction(matched.get(b.name, 0)) * self.index.trust(b.name)
            if held >= claim * (1.0 - NEAR_BEST):
                return False  # it holds as much: nothing to miss there
            miss = min(miss, self._prefill(b, out, claim - held) * (1 + b.in_flight))
        return wait < miss

    def learn(self, b: Routed, prompt: Prompt, blocks: int, backends: Sequence[Routed]) -> float:
        """``prompt`` was bound to ``b``; the fraction of it predicted cached there. ``b`` is
        its home from now on if it was already, or if no routable backend held the prompt (a
        placement); bound elsewhere (its home was full, or beyond its load bound), ``b`` holds
        a copy."""
        home = self.home(prompt, backends)
        self.index.learn(b.name, prompt, blocks, home=home is None or home is b)
        return prompt.fraction(blocks)

    def report(
        self, name: str, predicted: float, prompt_tokens: int | None, cached_tokens: int
    ) -> None:
        self.index.report(name, predicted, prompt_tokens, cached_tokens)


def _longest_holders(held: Sequence[tuple[Routed, int]]) -> list[Routed]:
    """Of (backend, matched blocks), those within NEAR_BEST of the longest match."""
    top = max((blocks for _, blocks in held), default=0)
    return [b for b, blocks in held if blocks > 0 and blocks >= top * (1.0 - NEAR_BEST)]


#: the latency policy's cost of a backend with requests in flight and no data yet: last
UNMEASURED_BUSY = math.inf


def measured(cost: float) -> bool:
    """Is ``cost`` (an ``expected_completion``) an estimate in seconds, rather than -1 (no
    data, probe it) or ``UNMEASURED_BUSY`` (no data, its probe under way)?"""
    return 0 <= cost < UNMEASURED_BUSY


def near_best(items: Sequence[_T], costs: Sequence[float]) -> list[_T]:
    """The items whose cost is within NEAR_BEST of the cheapest; all unmeasured ones (cost < 0:
    the latency policy probes them first) when there are any."""
    best = min(costs)
    if best < 0:
        return [x for x, c in zip(items, costs, strict=True) if c < 0]
    return [x for x, c in zip(items, costs, strict=True) if c <= best * (1.0 + NEAR_BEST)]
