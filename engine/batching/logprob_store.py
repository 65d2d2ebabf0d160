"""PromptLogprobStore: the log-probabilities of cached prompt tokens, so prompt-logprob requests hit the cache.

A request that wants the log-probability of every prompt token (OpenAI's ``echo`` with ``logprobs``, which
evaluation harnesses score with) cannot take those of its cached tokens from the KV cache: K/V hold no logits.
This store keeps them per block, keyed by the block's chained hash (namespace, every token up to the block's
end: the same keys as the radix tree's events), so an entry is valid whenever its key matches, whoever made it
and whatever happened to the pool block since. Each entry holds, for the ``block_size`` positions of the block,
the log-probability of the token there given every token before it and the ``TOP`` most likely tokens at that
position (block 0's first position has none: NaN, no alternatives). Bounded: least recently used entries go
first beyond ``capacity`` blocks.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from prefixcache.core.hashing import block_keys

TOP = 5  # alternatives kept per position (OpenAI's completions API allows at most 5)


@dataclass(frozen=True)
class BlockLogprobs:
    """One block's positions: ``logprobs[i]`` of its token i; ``top[i]``: token id -> log-probability."""

    logprobs: tuple[float, ...]
    top: tuple[dict[int, float], ...]


class PromptLogprobStore:
    def __init__(self, block_size: int, capacity: int, hash_seed: int = 0) -> None:
        self.block_size = block_size
        self.capacity = max(1, capacity)
        self.hash_seed = hash_seed
        self._entries: OrderedDict[bytes, BlockLogprobs] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self, tokens: Sequence[int], namespace: str, blocks: int) -> list[bytes]:
        return block_keys(
            list(tokens), namespace, block_size=self.block_size, hash_seed=self.hash_seed, max_blocks=blocks
        )

    def lookup(self, tokens: Sequence[int], namespace: str, blocks: int) -> list[BlockLogprobs]:
        """The entries of the leading ``blocks`` blocks of ``tokens``, up to the first one missing."""
        out: list[BlockLogprobs] = []
        for key in self.keys(tokens, namespace, blocks):
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                break
            self._entries.move_to_end(key)
            out.append(entry)
        self.hits += len(out)
        return out

    def put(
        self, tokens: Sequence[int], namespace: str, logprobs: Sequence[float], top: Sequence[dict[int, float]]
    ) -> None:
        """Store every full block of ``tokens`` whose positions are all in ``logprobs`` / ``top`` (index i:
        token i; index 0 ignored). Entries already there are refreshed."""
        bs = self.block_size
        full = min(len(tokens), len(logprobs), len(top)) // bs
        if not full:
            return
        for b, key in enumerate(self.keys(tokens, namespace, full)):
            if key in self._entries:
                self._entries.move_to_end(key)
                continue
            lo = b * bs
            lps = tuple(math.nan if i == 0 else float(logprobs[i]) for i in range(lo, lo + bs))
            tops = tuple({} if i == 0 else dict(top[i]) for i in range(lo, lo + bs))
            self._entries[key] = BlockLogprobs(lps, tops)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()
