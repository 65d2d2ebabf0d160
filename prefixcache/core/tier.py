"""TierIndex: which blocks a second tier (below the pool) holds, in least-recently-used order, under a budget.

The tier is written through: every block a commit puts into the pool is also given to the tier (``add``), so
it survives the block's eviction from the pool, a restart, and (on a shared store) other processes. One
request's protocol, the same in the simulator and on a real model (``keys`` are the request's chained block
keys: the 16-byte digests of ``prefixcache.core.hashing.block_keys`` in tokens mode, ``(namespace, key)`` in
keys mode):

1. ``m = cache.match(prompt)``: the pool serves ``p = m.cached_blocks`` blocks;
2. ``t = tier.lookup(keys, p, limit)``: the tier serves the next ``t`` blocks (``limit``: the blocks a match
   may serve, ``(len(prompt) - 1) // block_size``); the pool hits and the tier hits become most recent;
3. the caller loads those ``t`` blocks into the pool by committing the prompt's first ``p + t`` blocks
   (``cache.commit(handle, prompt[: (p + t) * block_size])``) and writing their K/V into the new block ids
   (a real tier may find an entry torn: it loads the ones before it and ``discard`` s the rest);
4. the rest is computed; the final commit inserts the new blocks, and ``tier.add(keys[: c.cached_blocks])``
   (the whole path the pool now holds) holds the new ones and refreshes the rest, deepest block first, so a
   path's root is its most recent block and eviction takes a chain's tail before its root (the tier then
   evicts exactly as one LRU cache of its size would); the keys evicted beyond ``capacity_blocks`` are returned
   for a store to delete.

Model-free: it knows keys, not bytes. Not thread-safe: callers serialise (as for ``PrefixCache``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import asdict, dataclass

from prefixcache.core.checks import check_int


@dataclass
class TierStats:
    """Running totals of one tier. Mutated only by TierIndex (and, for a real store, its owner)."""

    lookups: int = 0  # lookups that reached the tier (the pool left blocks the match could serve)
    lookups_with_hit: int = 0
    hit_blocks: int = 0  # blocks the tier served
    stored_blocks: int = 0  # blocks added
    evicted_blocks: int = 0  # blocks dropped for room
    discarded_blocks: int = 0  # blocks dropped because a store could not serve them (torn, foreign, lost)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class TierIndex:
    """The keys a tier holds, least recently used first, at most ``capacity_blocks`` (None: no limit)."""

    def __init__(self, capacity_blocks: int | None) -> None:
        if capacity_blocks is not None:
            capacity_blocks = check_int(capacity_blocks, "capacity_blocks", minimum=1, type_error=ValueError)
        self.capacity_blocks = capacity_blocks
        self._lru: OrderedDict[Hashable, None] = OrderedDict()
        self.stats = TierStats()

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._lru

    def keys(self) -> list[Hashable]:
        """The held keys, least recently used first. Changes nothing."""
        return list(self._lru)

    def lookup(self, keys: Sequence[Hashable], start: int, stop: int) -> int:
        """How many consecutive keys ``keys[start:stop]`` the tier holds (``start``: the blocks the pool served).
        Refreshes the held keys of ``keys[:start]`` and the ones served, in prompt order; counts a lookup when
        ``start < stop``."""
        lru = self._lru
        move = lru.move_to_end
        for key in keys[:start]:
            if key in lru:
                move(key)
        if start >= stop:
            return 0
        n = 0
        for key in keys[start:stop]:
            if key not in lru:
                break
            move(key)
            n += 1
        s = self.stats
        s.lookups += 1
        s.lookups_with_hit += n > 0
        s.hit_blocks += n
        return n

    def add(self, keys: Sequence[Hashable]) -> list[Hashable]:
        """Hold the path ``keys`` (root first): each becomes most recent, the last key first, so the root ends
        most recent (a held key is refreshed, not counted again); returns the keys evicted, least recent first,
        to keep within ``capacity_blocks``."""
        lru = self._lru
        added = 0
        for key in reversed(keys):
            if key in lru:
                lru.move_to_end(key)
            else:
                lru[key] = None
                added += 1
        self.stats.stored_blocks += added
        evicted: list[Hashable] = []
        cap = self.capacity_blocks
        if cap is not None:
            while len(lru) > cap:
                evicted.append(lru.popitem(last=False)[0])
        self.stats.evicted_blocks += len(evicted)
        return evicted

    def restore(self, keys: Iterable[Hashable]) -> list[Hashable]:
        """Hold ``keys`` found in a store at start-up (least recent first), counting nothing; returns the keys
        beyond ``capacity_blocks`` (the oldest), which the caller deletes."""
        lru = self._lru
        for key in keys:
            lru[key] = None
            lru.move_to_end(key)
        evicted: list[Hashable] = []
        cap = self.capacity_blocks
        if cap is not None:
            while len(lru) > cap:
                evicted.append(lru.popitem(last=False)[0])
        return evicted

    def discard(self, key: Hashable) -> bool:
        """Stop holding ``key`` (a store could not serve it); True if it was held."""
        if self._lru.pop(key, 0) is None:
            self.stats.discarded_blocks += 1
            return True
        return False

    def clear(self) -> None:
        """Forget every key (counters stay)."""
        self._lru.clear()

    def check_integrity(self) -> None:
        """Raise AssertionError if the tier holds more than its budget. Changes nothing."""
        cap = self.capacity_blocks
        assert cap is None or len(self._lru) <= cap, f"tier holds {len(self._lru)} blocks, budget {cap}"
