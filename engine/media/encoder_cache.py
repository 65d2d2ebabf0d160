"""The vision-encoder cache: each image's tower output kept by its content id, least recently used first out under
a byte budget, so the same image after another text prefix (another system prompt, another user) skips the tower.
Dropped with the KV when the weights, dtype or device change (``ModelRuntime.drop``)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

DEFAULT_MAX_ENCODER_CACHE_BYTES = 256 * 2**20


class EncoderCache:
    """Tower outputs by content id (LRU under ``max_bytes``; 0 keeps none). Counts hits, misses and bytes."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._items: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.nbytes = 0
        self.hits = 0
        self.misses = 0

    def get(self, content_id: bytes, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The tower output of ``content_id``: the kept one (refreshed), else ``compute()``, kept if it fits."""
        got = self._items.get(content_id)
        if got is not None:
            self._items.move_to_end(content_id)
            self.hits += 1
            return got
        self.misses += 1
        value = compute()
        size = value.numel() * value.element_size()
        if size <= self.max_bytes:
            while self.nbytes + size > self.max_bytes:
                _, old = self._items.popitem(last=False)
                self.nbytes -= old.numel() * old.element_size()
            self._items[content_id] = value
            self.nbytes += size
        return value

    def clear(self, *, keep_stats: bool = True) -> None:
        """Forget every kept output (the counters too unless ``keep_stats``)."""
        self._items.clear()
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
