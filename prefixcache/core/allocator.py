"""BlockAllocator: free block ids and reference counts. Knows nothing of the tree."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class BlockAllocator:
    """Hands out block ids ``0..num_blocks-1``.

    The free queue holds free ids in the order they were freed (oldest first), so a freed block is
    reused as late as possible. ``refs[b]`` counts owners of block ``b``; a free block has 0. Both are
    plain Python containers: calls touch a handful of ids, where numpy's per-call overhead dominates.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self.refs: list[int] = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free ids (ref count 1 each). Raises if fewer than ``n`` are free; changes nothing then."""
        free = self._free
        if n > len(free):
            raise MemoryError(f"asked for {n} blocks, {len(free)} free")
        ids = [free.popleft() for _ in range(n)]
        refs = self.refs
        for b in ids:
            refs[b] = 1
        return ids

    def incref(self, ids: Iterable[int]) -> None:
        """Add an owner to each (allocated) block; raises, changing nothing, if one is free."""
        ids = list(ids)
        refs = self.refs
        if any(refs[b] <= 0 for b in ids):
            raise ValueError("incref of a free block")
        for b in ids:
            refs[b] += 1

    def decref(self, ids: Iterable[int]) -> None:
        """Drop an owner from each block (an id listed k times drops k); blocks reaching 0 owners join the
        free queue in the order given. Raises, changing nothing, if a block would go below 0 owners."""
        ids = list(ids)
        refs = self.refs
        if len(set(ids)) != len(ids):
            drop: dict[int, int] = {}
            for b in ids:
                drop[b] = drop.get(b, 0) + 1
            if any(refs[b] < k for b, k in drop.items()):
                raise ValueError("decref of a free block")
            ids = list(drop)
            for b, k in drop.items():
                refs[b] -= k
        else:
            if any(refs[b] <= 0 for b in ids):
                raise ValueError("decref of a free block")
            for b in ids:
                refs[b] -= 1
        self._free.extend([b for b in ids if refs[b] == 0])

    def free_ids(self) -> list[int]:
        """The free queue, oldest first (a copy)."""
        return list(self._free)

    def check_integrity(self) -> None:
        """Raise AssertionError if the free queue and the ref counts disagree. Changes nothing."""
        free = list(self._free)
        if len(set(free)) != len(free):
            raise AssertionError("allocator: a block id is in the free queue twice")
        negative = [b for b, r in enumerate(self.refs) if r < 0]
        if negative:
            raise AssertionError(f"allocator: negative ref count at block {negative[0]}")
        zero = {b for b, r in enumerate(self.refs) if r == 0}
        if zero != set(free):
            raise AssertionError(
                f"allocator: free queue {sorted(set(free) ^ zero)[:8]}... disagrees with zero ref counts"
            )
