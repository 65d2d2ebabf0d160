"""BlockAllocator: free block ids and reference counts. Knows nothing of the tree."""

from __future__ import annotations

from collections import deque
from typing import Iterable

import numpy as np


class BlockAllocator:
    """Hands out block ids ``0..num_blocks-1``.

    The free queue holds free ids in the order they were freed (oldest first), so a freed block is
    reused as late as possible. ``refs[b]`` counts owners of block ``b``; a free block has 0.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self.refs = np.zeros(num_blocks, dtype=np.int32)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free ids (ref count 1 each). Raises if fewer than ``n`` are free; changes nothing then."""
        if n > len(self._free):
            raise MemoryError(f"asked for {n} blocks, {len(self._free)} free")
        free = self._free
        ids = [free.popleft() for _ in range(n)]
        self.refs[ids] = 1
        return ids

    def incref(self, ids: Iterable[int]) -> None:
        """Add an owner to each (allocated) block."""
        ids = list(ids)
        if ids and (self.refs[ids] <= 0).any():
            raise ValueError("incref of a free block")
        np.add.at(self.refs, ids, 1)

    def decref(self, ids: Iterable[int]) -> None:
        """Drop an owner from each block; blocks reaching 0 owners return to the free queue."""
        ids = list(ids)
        if not ids:
            return
        if (self.refs[ids] <= 0).any():
            raise ValueError("decref of a free block")
        np.subtract.at(self.refs, ids, 1)
        self._free.extend(b for b in ids if self.refs[b] == 0)

    def free_ids(self) -> list[int]:
        """The free queue, oldest first (a copy)."""
        return list(self._free)

    def check_integrity(self) -> None:
        """Raise AssertionError if the free queue and the ref counts disagree."""
        free = list(self._free)
        if len(set(free)) != len(free):
            raise AssertionError("allocator: a block id is in the free queue twice")
        if (self.refs < 0).any():
            raise AssertionError(f"allocator: negative ref count at block {int(np.argmax(self.refs < 0))}")
        zero = set(np.flatnonzero(self.refs == 0).tolist())
        if zero != set(free):
            raise AssertionError(
                f"allocator: free queue {sorted(set(free) ^ zero)[:8]}... disagrees with zero ref counts"
            )
