"""BlockAllocator: free block ids and reference counts, in runs. Knows nothing of the tree."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

BlockIds = npt.NDArray[np.int64]  # a run of block ids, in order
EMPTY_IDS: BlockIds = np.zeros(0, np.int64)
EMPTY_IDS.flags.writeable = False


def compact(ids: BlockIds) -> BlockIds:
    """``ids`` itself, or a copy when it is a view holding on to a much larger array (so that what a node
    keeps alive stays proportional to what it holds)."""
    base = ids.base
    if base is not None and isinstance(base, np.ndarray) and base.size > 2 * ids.size + 8:
        return ids.copy()
    return ids


class BlockAllocator:
    """Hands out block ids ``0..num_blocks-1`` in runs (numpy int64 arrays), without materialising the pool.

    Free order: ids never handed out come first, in increasing order (a high-water mark ``hw``: every id
    ``>= hw`` is free and untouched), then the free queue, which holds freed ids in the order they were
    freed (oldest first, as a deque of runs), so a freed block is reused as late as possible. ``refs[b]``
    counts owners of block ``b`` (0: free); it is an int32 array over ``0..hw-1`` only, grown by doubling.
    Memory is proportional to the highest id ever handed out (at most the peak number of blocks in use),
    never to ``num_blocks``: a pool of 2**40 blocks costs nothing until used. Calls cost O(runs touched)
    numpy operations, plus memcpy-like work on the ids.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.hw = 0  # ids >= hw were never handed out
        self._queue: deque[BlockIds] = deque()  # freed runs, oldest first
        self._queued = 0
        self._refs: npt.NDArray[np.int32] = np.zeros(0, np.int32)

    @property
    def num_free(self) -> int:
        return self.num_blocks - self.hw + self._queued

    def _grow(self, hw: int) -> None:
        """Make ``_refs`` cover ids ``< hw`` (amortised doubling, capped at num_blocks)."""
        if hw > len(self._refs):
            size = min(self.num_blocks, max(hw, 2 * len(self._refs), 1024))
            refs = np.zeros(size, np.int32)
            refs[: len(self._refs)] = self._refs
            self._refs = refs

    def allocate(self, n: int) -> BlockIds:
        """Take ``n`` free ids in free order (ref count 1 each), as one int64 array the caller owns.
        Raises MemoryError, changing nothing, if fewer than ``n`` are free."""
        if n > self.num_free:
            raise MemoryError(f"asked for {n} blocks, {self.num_free} free")
        if n <= 0:
            return EMPTY_IDS
        parts: list[BlockIds] = []
        fresh = min(n, self.num_blocks - self.hw)
        if fresh:
            lo = self.hw
            self._grow(lo + fresh)
            self._refs[lo : lo + fresh] = 1
            self.hw = lo + fresh
            parts.append(np.arange(lo, lo + fresh, dtype=np.int64))
        need = n - fresh
        if need:
            queue = self._queue
            self._queued -= need
            while need:
                run = queue.popleft()
                if len(run) > need:
                    queue.appendleft(compact(run[need:]))
                    run = run[:need]
                parts.append(run)
                need -= len(run)
            taken = parts[1:] if fresh else parts
            ids = taken[0] if len(taken) == 1 else np.concatenate(taken)
            self._refs[ids] = 1
        out = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return compact(out)

    def free(self, ids: BlockIds) -> None:
        """Drop the only owner of each block of the run ``ids`` (distinct ids, each with ref count 1); they join
        the free queue in the order given. The caller hands ``ids`` over and must not change it later. Raises
        ValueError, changing nothing, if a block has another count (a repeated id is the caller's error;
        ``check_integrity`` finds it)."""
        if not len(ids):
            return
        refs = self._refs
        if int(ids.min()) < 0 or int(ids.max()) >= self.hw or not (refs[ids] == 1).all():
            raise ValueError("free of a block that is free or has several owners")
        refs[ids] = 0
        self._queue.append(ids)
        self._queued += len(ids)

    def _as_ids(self, ids: Iterable[int]) -> BlockIds:
        arr = np.fromiter((int(b) for b in ids), np.int64) if not isinstance(ids, np.ndarray) else ids
        if len(arr) and (int(arr.min()) < 0 or int(arr.max()) >= self.num_blocks):
            raise ValueError(f"block id out of range [0, {self.num_blocks})")
        return arr.astype(np.int64, copy=False)

    def incref(self, ids: Iterable[int]) -> None:
        """Add an owner to each (allocated) block, once per listing; raises ValueError, changing nothing,
        if one is free."""
        arr = self._as_ids(ids)
        if not len(arr):
            return
        if int(arr.max()) >= self.hw or not (self._refs[arr] > 0).all():
            raise ValueError("incref of a free block")
        np.add.at(self._refs, arr, 1)

    def decref(self, ids: Iterable[int]) -> None:
        """Drop an owner from each block (an id listed k times drops k); blocks reaching 0 owners join the
        free queue in the order first listed. Raises ValueError, changing nothing, if a block would go below
        0 owners."""
        arr = self._as_ids(ids)
        if not len(arr):
            return
        if int(arr.max()) >= self.hw:
            raise ValueError("decref of a free block")
        uniq, first, counts = np.unique(arr, return_index=True, return_counts=True)
        if (self._refs[uniq] < counts).any():
            raise ValueError("decref of a free block")
        self._refs[uniq] -= counts.astype(np.int32)
        order = uniq[np.argsort(first, kind="stable")]
        freed = order[self._refs[order] == 0]
        if len(freed):
            self._queue.append(freed)
            self._queued += len(freed)

    @property
    def refs(self) -> list[int]:
        """Ref count of every block id, as a list of ``num_blocks`` ints (O(num_blocks): for tests)."""
        out = self._refs[: self.hw].tolist()
        return out + [0] * (self.num_blocks - self.hw)

    def ref(self, block: int) -> int:
        """Ref count of one block. Changes nothing."""
        return int(self._refs[block]) if 0 <= block < self.hw else 0

    def free_ids(self) -> list[int]:
        """The free ids in free order: never-used ids, then the free queue oldest first (a copy; O(num_free))."""
        queued = np.concatenate(list(self._queue)).tolist() if self._queue else []
        return list(range(self.hw, self.num_blocks)) + queued

    def check_integrity(self, cached: BlockIds | None = None) -> None:
        """Raise AssertionError if the free queue and the ref counts disagree (and, given ``cached``, the
        ids the tree holds, unless those are exactly the ids with ref count 1). Changes nothing."""
        hw = self.hw
        if not 0 <= hw <= self.num_blocks:
            raise AssertionError(f"allocator: high-water mark {hw} outside [0, {self.num_blocks}]")
        refs = self._refs[:hw]
        queued = np.concatenate(list(self._queue)) if self._queue else EMPTY_IDS
        if len(queued) != self._queued:
            raise AssertionError(f"allocator: {len(queued)} ids queued, counter says {self._queued}")
        if len(queued) and (int(queued.min()) < 0 or int(queued.max()) >= hw):
            raise AssertionError("allocator: a queued id was never handed out")
        if len(np.unique(queued)) != len(queued):
            raise AssertionError("allocator: a block id is in the free queue twice")
        negative = np.flatnonzero(refs < 0)
        if len(negative):
            raise AssertionError(f"allocator: negative ref count at block {int(negative[0])}")
        zero = np.flatnonzero(refs == 0)
        if not np.array_equal(zero, np.sort(queued)):
            diff = np.setxor1d(zero, queued)[:8].tolist()
            raise AssertionError(f"allocator: free queue {diff}... disagrees with zero ref counts")
        if cached is not None:
            one = np.flatnonzero(refs == 1)
            if not np.array_equal(one, np.sort(cached)) or len(one) + len(zero) != hw:
                diff = np.setxor1d(np.flatnonzero(refs > 0), cached)[:8].tolist()
                raise AssertionError(f"allocator: cached blocks {diff}... are not exactly the blocks in use")
