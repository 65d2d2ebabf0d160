"""Eviction policies: which unpinned leaf gives up its blocks first.

A policy holds the set of *evictable* nodes (unpinned leaves with blocks) in eviction order. The tree
adds a node when it becomes evictable and removes it when it stops being so; a node's ordering key is
computed when it is added and must not change while it is inside. Register new policies in POLICIES:
``POLICIES[name](clock)`` makes a fresh policy; ``clock()`` is the cache's time in seconds (only policies
that look at retention use it).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Hashable, Iterator
from operator import attrgetter
from typing import Any, Protocol

from sortedcontainers import SortedDict

Clock = Callable[[], float]
NOT_RETAINED = -math.inf  # a node's keep_until when nobody asked to keep it


class Evictable(Protocol):
    id: int
    last_access: int
    created: int
    hits: int
    keep_until: float  # retained until this time on the cache's clock (NOT_RETAINED: not retained)


class EvictionPolicy(Protocol):
    """The evictable set, ordered victim first."""

    def add(self, node: Evictable) -> None:
        """Make ``node`` evictable."""

    def remove(self, node: Evictable) -> None:
        """Make ``node`` no longer evictable (no-op if it is not in the set)."""

    def peek(self) -> Evictable | None:
        """The next victim, or None when nothing is evictable. Changes nothing."""

    def __len__(self) -> int: ...

    def __contains__(self, node: object) -> bool: ...

    def __iter__(self) -> Iterator[Evictable]:
        """Nodes in eviction order, victim first."""


class KeyedPolicy:
    """An evictable set ordered by ``(key(node), node.id)``, victim first.

    A binary heap of ``(key, id)`` entries with lazy deletion: ``_live`` maps the id of every node in the set
    to ``(key, node)``; ``remove`` only forgets the id, and heap entries whose id is gone (or back under
    another key) are dropped when they reach the top, or all at once when they outnumber live ones. Entries
    hold no node, so an evicted node is freed at once. add/remove/peek cost O(log n) C-level heap steps;
    iteration sorts (for tests and integrity checks).
    """

    name = "keyed"

    def __init__(self, key: Callable[[Evictable], Hashable]) -> None:
        self._key = key
        self._heap: list[tuple[Any, int]] = []
        self._live: dict[int, tuple[Any, Evictable]] = {}

    def add(self, node: Evictable) -> None:
        i = node.id
        if i in self._live:
            raise AssertionError(f"node {i} is already evictable")
        k = self._key(node)
        self._live[i] = (k, node)
        heapq.heappush(self._heap, (k, i))

    def remove(self, node: Evictable) -> None:
        if self._live.pop(node.id, None) is not None and len(self._heap) > 2 * len(self._live) + 64:
            self._heap = [(k, i) for i, (k, _n) in self._live.items()]
            heapq.heapify(self._heap)

    def peek(self) -> Evictable | None:
        heap, live = self._heap, self._live
        while heap:
            k, i = heap[0]
            entry = live.get(i)
            if entry is not None and entry[0] == k:
                return entry[1]
            heapq.heappop(heap)
        return None

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, node: object) -> bool:
        return getattr(node, "id", None) in self._live

    def __iter__(self) -> Iterator[Evictable]:
        order = sorted((k, i) for i, (k, _n) in self._live.items())
        return iter([self._live[i][1] for _k, i in order])


def lru(clock: Clock | None = None) -> EvictionPolicy:
    """Least recently used first (last match or insert)."""
    return KeyedPolicy(attrgetter("last_access"))


def fifo(clock: Clock | None = None) -> EvictionPolicy:
    """Oldest inserted first, whatever its use since."""
    return KeyedPolicy(attrgetter("created"))


def lfu(clock: Clock | None = None) -> EvictionPolicy:
    """Fewest hits first; among equals, least recently used."""
    return KeyedPolicy(attrgetter("hits", "last_access"))


class RetentionPolicy:
    """LRU that honours retention: a node marked ``keep_until`` (``commit(..., keep_for=s)``) is kept
    until then, evicted only when no unretained leaf is left, and then the soonest-expiring first.

    Two ordered sets: ``free`` (unretained, LRU order, a KeyedPolicy) and ``kept`` (a SortedDict keyed by
    (keep_until, last_access, id)). ``peek`` first moves expired nodes from ``kept`` to ``free``.
    """

    name = "priority"

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._free = KeyedPolicy(attrgetter("last_access"))
        self._kept: SortedDict = SortedDict()
        self._kept_keys: dict[int, tuple[float, int, int]] = {}

    def _retained(self, node: Evictable) -> bool:
        return node.keep_until != NOT_RETAINED and node.keep_until > self._clock()

    def add(self, node: Evictable) -> None:
        if node in self:
            raise AssertionError(f"node {node.id} is already evictable")
        if self._retained(node):
            k = (node.keep_until, node.last_access, node.id)
            self._kept_keys[node.id] = k
            self._kept[k] = node
        else:
            self._free.add(node)

    def remove(self, node: Evictable) -> None:
        k = self._kept_keys.pop(node.id, None)
        if k is not None:
            del self._kept[k]
        else:
            self._free.remove(node)

    def _expire(self) -> None:
        kept = self._kept
        if not kept:
            return
        now = self._clock()
        while kept and kept.peekitem(0)[0][0] <= now:
            _k, node = kept.popitem(0)
            del self._kept_keys[node.id]
            self._free.add(node)

    def peek(self) -> Evictable | None:
        """The next victim (moves expired nodes to the LRU set first; the victim order is unchanged)."""
        self._expire()
        victim = self._free.peek()
        if victim is None and self._kept:
            victim = self._kept.peekitem(0)[1]
        return victim

    def __len__(self) -> int:
        return len(self._free) + len(self._kept_keys)

    def __contains__(self, node: object) -> bool:
        return node in self._free or getattr(node, "id", None) in self._kept_keys

    def __iter__(self) -> Iterator[Evictable]:
        self._expire()
        return iter([*self._free, *self._kept.values()])


def priority(clock: Clock | None = None) -> EvictionPolicy:
    """LRU, except blocks retained with ``keep_for`` stay until their time runs out (see RetentionPolicy)."""
    if clock is None:
        import time

        clock = time.monotonic
    return RetentionPolicy(clock)


POLICIES: dict[str, Callable[..., EvictionPolicy]] = {"lru": lru, "fifo": fifo, "lfu": lfu, "priority": priority}
