"""A token-level radix tree of KV-cached prefixes, as SGLang's RadixAttention keeps one.

Why: SGLang keeps the KV cache of every prompt (and answer) it has computed in a radix tree
and, for a new request, skips prefill of the longest prefix the tree holds. Where a request
goes then decides how much prefill it pays, which is what the proxy's prefix-aware routing
must see on the simulator too.

The tree only knows tokens; the scheduler (loadtest/sim/scheduler.py) decides when to match,
insert, lock and evict, and owns the pool accounting:

- every node holds the tokens of its edge (``key``); a path from the root is a cached prefix;
- a node is *locked* (``lock_ref`` > 0) while a running request uses the prefix through it:
  locked tokens are never evicted (``protected_size``); the rest is ``evictable_size``;
- ``evict(n)`` drops least-recently-used unlocked leaves (a parent becomes a leaf in turn)
  until at least n tokens are freed, as SGLang's ``RadixCache.evict``.

Recency is a logical clock (one tick per match or insert), not wall time, so the same
sequence of requests evicts the same prefixes on every clock.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence


class CacheNode:
    """One edge of the tree: the tokens on it, its children by first token, its locks."""

    __slots__ = ("children", "key", "last_access", "lock_ref", "parent", "serial")

    def __init__(self, key: tuple[int, ...], parent: CacheNode | None, serial: int) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[int, CacheNode] = {}
        self.lock_ref = 0
        self.last_access = 0
        self.serial = serial  # creation order: breaks recency ties deterministically


def _common_len(key: Sequence[int], ids: Sequence[int], start: int, end: int) -> int:
    """How many leading tokens of ``key`` equal ``ids[start:end]`` (without copying ids)."""
    n = min(len(key), end - start)
    i = 0
    while i < n and key[i] == ids[start + i]:
        i += 1
    return i


class PrefixCache:
    """Cached token prefixes with lock counts and LRU eviction (see the module docstring)."""

    def __init__(self) -> None:
        self._serial = itertools.count()
        self._tick = 0
        self.root = CacheNode((), None, next(self._serial))
        self.root.lock_ref = 1  # the root is never evicted
        self.total_size = 0  # tokens in the tree
        self.protected_size = 0  # tokens on paths locked by running requests

    @property
    def evictable_size(self) -> int:
        """Tokens that may be dropped to make room (cached, no running request uses them)."""
        return self.total_size - self.protected_size

    def reset(self) -> None:
        """Drop everything (``/flush_cache``); only valid while nothing is locked."""
        if self.protected_size:
            raise RuntimeError("cannot flush a prefix cache that running requests use")
        self.root.children.clear()
        self.total_size = 0

    # --- lookup and insertion ---------------------------------------------------------------
    def match(self, ids: Sequence[int], limit: int | None = None) -> tuple[CacheNode, int]:
        """The deepest node on the longest cached prefix of ``ids[:limit]`` and its length.

        A match that ends inside an edge splits it, so the returned node covers exactly the
        matched tokens (and can be locked alone). Every node on the path counts as used now.
        """
        self._tick += 1
        end = len(ids) if limit is None else min(limit, len(ids))
        node, i = self.root, 0
        while i < end:
            child = node.children.get(ids[i])
            if child is None:
                break
            n = _common_len(child.key, ids, i, end)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = self._tick
            node, i = child, i + n
        return node, i

    def insert(self, ids: Sequence[int]) -> tuple[CacheNode, int]:
        """Cache ``ids`` (their prefix may already be there); the node that ends them and how
        many tokens were already cached (those the caller's own copy duplicates)."""
        node, i = self.match(ids)
        if i < len(ids):
            leaf = CacheNode(tuple(ids[i:]), node, next(self._serial))
            leaf.last_access = self._tick
            node.children[leaf.key[0]] = leaf
            self.total_size += len(leaf.key)
            node = leaf
        return node, i

    def _split(self, child: CacheNode, n: int) -> CacheNode:
        """Cut ``child``'s edge after n tokens; the new upper node inherits its locks."""
        parent = child.parent
        assert parent is not None
        upper = CacheNode(child.key[:n], parent, next(self._serial))
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        parent.children[upper.key[0]] = upper
        child.key = child.key[n:]
        child.parent = upper
        upper.children[child.key[0]] = child
        return upper

    # --- locks ------------------------------------------------------------------------------
    def lock(self, node: CacheNode) -> int:
        """A running request uses the prefix ending at ``node``; tokens newly protected."""
        newly = 0
        while node is not self.root:
            if node.lock_ref == 0:
                newly += len(node.key)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]
        self.protected_size += newly
        return newly

    def unlock(self, node: CacheNode) -> int:
        """The request no longer uses it; tokens that became evictable."""
        freed = 0
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                freed += len(node.key)
            node = node.parent  # type: ignore[assignment]
        self.protected_size -= freed
        return freed

    def lock_cost(self, node: CacheNode) -> int:
        """Tokens ``lock(node)`` would newly protect (what admitting on this prefix takes from
        the room evictable tokens give)."""
        cost = 0
        while node is not self.root and node.lock_ref == 0:
            cost += len(node.key)
            node = node.parent  # type: ignore[assignment]
        return cost

    # --- eviction ---------------------------------------------------------------------------
    def evict(self, tokens: int) -> int:
        """Drop least-recently-used unlocked leaves until ``tokens`` are freed (or nothing
        evictable is left); tokens freed (whole leaves, so possibly more than asked)."""
        if tokens <= 0:
            return 0
        heap = [(n.last_access, n.serial, n) for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < tokens:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[0]]
            freed += len(leaf.key)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.serial, parent))
        self.total_size -= freed
        return freed

    def _leaves(self) -> list[CacheNode]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root:
                out.append(node)
        return out
