"""Eviction policies: which unpinned leaf gives up its blocks first.

A policy holds the set of *evictable* nodes (unpinned leaves with blocks) in eviction order. The tree
adds a node when it becomes evictable and removes it when it stops being so; a node's ordering key is
computed when it is added and must not change while it is inside. Register new policies in POLICIES.
"""

from __future__ import annotations

from typing import Callable, Hashable, Iterator, Protocol

from sortedcontainers import SortedDict


class Evictable(Protocol):
    id: int
    last_access: int
    created: int
    hits: int


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
    """An evictable set ordered by ``key(node)``, ties broken by node id; a SortedDict underneath."""

    name = "keyed"

    def __init__(self, key: Callable[[Evictable], Hashable]) -> None:
        self._key = key
        self._order: SortedDict = SortedDict()
        self._keys: dict[int, tuple] = {}

    def add(self, node: Evictable) -> None:
        if node.id in self._keys:
            raise AssertionError(f"node {node.id} is already evictable")
        k = (self._key(node), node.id)
        self._keys[node.id] = k
        self._order[k] = node

    def remove(self, node: Evictable) -> None:
        k = self._keys.pop(node.id, None)
        if k is not None:
            del self._order[k]

    def peek(self) -> Evictable | None:
        if not self._order:
            return None
        return self._order.peekitem(0)[1]

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, node: object) -> bool:
        return getattr(node, "id", None) in self._keys

    def __iter__(self) -> Iterator[Evictable]:
        return iter(list(self._order.values()))


def lru() -> EvictionPolicy:
    """Least recently used first (last match or insert)."""
    return KeyedPolicy(lambda n: n.last_access)


def fifo() -> EvictionPolicy:
    """Oldest inserted first, whatever its use since."""
    return KeyedPolicy(lambda n: n.created)


def lfu() -> EvictionPolicy:
    """Fewest hits first; among equals, least recently used."""
    return KeyedPolicy(lambda n: (n.hits, n.last_access))


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {"lru": lru, "fifo": fifo, "lfu": lfu}
