"""The vision-encoder cache: each image's tower output kept by its content id, least recently used first out under
a byte budget, so the same image after another text prefix (another system prompt, another user) skips the tower.
Dropped with the KV when the weights, dtype or device change (``ModelRuntime.drop``)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.media.families import Features

DEFAULT_MAX_ENCODER_CACHE_BYTES = 256 * 2**20
MAX_COUNTS = 1 << 16  # content ids whose placeholder count is kept (a few dozen bytes each)


class EncoderCache:
    """Tower outputs by content id (LRU under ``max_bytes``; 0 keeps none) and, beside them, each item's placeholder
    count (the last ``MAX_COUNTS`` items), so a hit need not run the tower to know it. Counts hits, misses, bytes."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._items: OrderedDict[bytes, Features] = OrderedDict()
        self._counts: OrderedDict[bytes, int] = OrderedDict()
        self.nbytes = 0
        self.hits = 0
        self.misses = 0

    def get(self, content_id: bytes, compute: Callable[[], Features]) -> Features:
        """The tower output of ``content_id``: the kept one (refreshed), else ``compute()``, kept if it fits."""
        got = self._items.get(content_id)
        if got is not None:
            self._items.move_to_end(content_id)
            self.hits += 1
            return got
        self.misses += 1
        value = compute()
        self._counts[content_id] = int(value.main.shape[0])
        self._counts.move_to_end(content_id)
        if len(self._counts) > MAX_COUNTS:
            self._counts.popitem(last=False)
        size = value.nbytes
        if size <= self.max_bytes:
            while self.nbytes + size > self.max_bytes:
                _, old = self._items.popitem(last=False)
                self.nbytes -= old.nbytes
            self._items[content_id] = value
            self.nbytes += size
        return value

    def count(self, content_id: bytes) -> int | None:
        """The placeholder count of an item encoded before (None: not kept)."""
        return self._counts.get(content_id)

    def clear(self, *, keep_stats: bool = True) -> None:
        """Forget every kept output (the counters too unless ``keep_stats``)."""
        self._items.clear()
        self._counts.clear()
        self.nbytes = 0
        if not keep_stats:
            self.hits = self.misses = 0

    def stats(self) -> dict[str, int]:
        return {
            "encoder_cache_hits": self.hits,
            "encoder_cache_misses": self.misses,
            "encoder_cache_items": len(self._items),
            "encoder_cache_bytes": self.nbytes,
        }
