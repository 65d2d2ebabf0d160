"""Cache events: what a listener learns when a PrefixCache's contents change (for a router that mirrors the
blocks each replica caches, in the spirit of vLLM's KV events).

``PrefixCache.subscribe(listener)`` registers ``listener(event)``; events are delivered synchronously, in
order, after the change is complete and the cache consistent (an operation that evicts and stores reports
its ``BlocksRemoved`` first). A block's key is what the cache knows it by: in tokens mode its chained
16-byte xxh3_128 digest (``prefixcache.core.hashing.block_keys`` computes the same keys from token ids), in
keys mode the caller's key. With no subscriber, nothing is computed for events.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass


@dataclass(frozen=True)
class BlocksStored:
    """A commit cached ``keys`` (in path order) right after the block keyed ``parent`` (None: at the namespace's
    root). ``tokens``: the stored blocks' token ids (tokens mode; None in keys mode)."""

    namespace: str
    mode: str  # "tokens" | "keys"
    parent: Hashable | None
    keys: tuple[Hashable, ...]
    tokens: tuple[int, ...] | None


@dataclass(frozen=True)
class BlocksRemoved:
    """Eviction removed the blocks ``keys`` (the tail of one cached path, in path order)."""

    namespace: str
    mode: str
    keys: tuple[Hashable, ...]


@dataclass(frozen=True)
class CacheCleared:
    """``reset()`` forgot every cached block."""


CacheEvent = BlocksStored | BlocksRemoved | CacheCleared
Listener = Callable[[CacheEvent], None]


class Subscribers:
    """The listeners of one cache, in subscription order. Falsy when there are none (the hot path's check)."""

    def __init__(self) -> None:
        self._listeners: list[Listener] = []

    def __bool__(self) -> bool:
        return bool(self._listeners)

    def add(self, listener: Listener) -> Callable[[], None]:
        """Register ``listener``; returns a function that unregisters it (idempotent)."""
        if not callable(listener):
            raise TypeError(f"listener must be callable, got {type(listener).__name__}")
        entry = [listener]  # a fresh object per subscription, so the same function may subscribe twice
        self._listeners.append(listener)

        def unsubscribe() -> None:
            if entry:
                self._listeners.remove(entry.pop())

        return unsubscribe

    def emit(self, events: list[CacheEvent]) -> None:
        """Deliver ``events`` in order to every listener. A listener's exception propagates (later listeners
        of that event are skipped); the cache is consistent by then."""
        for event in events:
            for listener in list(self._listeners):
                listener(event)
