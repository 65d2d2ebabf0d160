"""BlockAllocator: free block ids and reference counts, in runs. Knows nothing of the tree."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

from prefixcache.core.block_ids import (
    EMPTY_IDS,
    BlockIds,
    Piece,
    compact_piece,
    ids_array,
    ids_list,
    make_ids,
    pieces_of,
)


class BlockAllocator:
    """Hands out block ids ``0..num_blocks-1`` in runs (``BlockIds``), without materialising the pool.

    Free order: ids never handed out come first, in increasing order (every id ``>= hw``, the high-water
    mark, is free and untouched), then the free queue: freed runs in the order they were freed (oldest
    first, a deque of runs), so a freed block is reused as late as possible. Memory is proportional to the
    ids handed out and not yet reused, never to ``num_blocks``: a pool of 2**40 blocks costs nothing until
    used (fresh ids are handed out as ranges). ``allocate`` and ``free`` cost O(runs touched) steps on ranges
    and array views, no per-block Python work.

    Reference counts: a handed-out block has one owner, plus those added by ``incref`` (kept in a dict, only
    for such blocks). ``free`` is the one-owner fast path the cache uses; it trusts its caller (the partition
    of ``0..hw-1`` into free and owned ids is checked by ``check_integrity``). ``incref``/``decref`` check
    everything and cost O(free ids) per call.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.hw = 0  # ids >= hw were never handed out
        self._queue: deque[Piece] = deque()  # freed runs (flat pieces), oldest first
        self._queued = 0
        self._extra: dict[int, int] = {}  # block -> owners beyond the first (incref)

    @property
    def num_free(self) -> int:
        return self.num_blocks - self.hw + self._queued

    def allocate(self, n: int) -> BlockIds:
        """Take ``n`` free ids in free order (one owner each), as one run. Raises MemoryError, changing nothing,
        if fewer than ``n`` are free."""
        if n > self.num_free:
            raise MemoryError(f"asked for {n} blocks, {self.num_free} free")
        if n <= 0:
            return EMPTY_IDS
        parts: list[Piece] = []
        fresh = min(n, self.num_blocks - self.hw)
        if fresh:
            lo = self.hw
            self.hw = lo + fresh
            parts.append(range(lo, lo + fresh))
        need = n - fresh
        if need:
            queue = self._queue
            self._queued -= need
            while need:
                run = queue.popleft()
                if len(run) > need:
                    queue.appendleft(compact_piece(run[need:]))
                    run = run[:need]
                parts.append(run)
                need -= len(run)
        if len(parts) == 1:  # what make_ids makes of one piece
            return compact_piece(parts[0])
        return make_ids(parts)

    def free(self, ids: BlockIds) -> None:
        """Drop the only owner of each block of the run ``ids`` (distinct ids, each handed out and owned once);
        they join the free queue in the order given (a range continuing the last queued one is merged into it).
        The caller hands ``ids`` over and must not write to it."""
        if not len(ids):
            return
        queue = self._queue
        for p in pieces_of(ids):
            last = queue[-1] if queue else None
            if type(p) is range and type(last) is range and last.stop == p.start and last.step == p.step:
                queue[-1] = range(last.start, p.stop, p.step)  # a run continuing the last one: keep it whole
            else:
                queue.append(p)
        self._queued += len(ids)

    def _free_set(self) -> set[int]:
        return {b for run in self._queue for b in ids_list(run)}

    def _owned(self, ids: Iterable[int], what: str) -> list[int]:
        """``ids`` as ints, each a handed-out block that is not free; raises ValueError naming ``what``."""
        out = [int(b) for b in ids]
        free = self._free_set()
        if any(not 0 <= b < self.hw or b in free for b in out):
            raise ValueError(f"{what} of a free block")
        return out

    def incref(self, ids: Iterable[int]) -> None:
        """Add an owner to each (allocated) block, once per listing; raises ValueError, changing nothing,
        if one is free."""
        for b in self._owned(ids, "incref"):
            self._extra[b] = self._extra.get(b, 0) + 1

    def decref(self, ids: Iterable[int]) -> None:
        """Drop an owner from each block (an id listed k times drops k); blocks reaching 0 owners join the
        free queue in the order first listed. Raises ValueError, changing nothing, if a block would go below
        0 owners."""
        drop: dict[int, int] = {}
        for b in self._owned(ids, "decref"):
            drop[b] = drop.get(b, 0) + 1
        if any(1 + self._extra.get(b, 0) < k for b, k in drop.items()):
            raise ValueError("decref of a free block")
        freed = []
        for b, k in drop.items():
            left = self._extra.get(b, 0) - k  # owners beyond the first, after the drop; -1: none left
            if left > 0:
                self._extra[b] = left
            else:
                self._extra.pop(b, None)
                if left < 0:
                    freed.append(b)
        if freed:
            self.free(np.asarray(freed, dtype=np.int64))

    @property
    def refs(self) -> list[int]:
        """Owners of every block id, as a list of ``num_blocks`` ints (O(num_blocks): for tests)."""
        out = [1] * self.hw + [0] * (self.num_blocks - self.hw)
        for b in self._free_set():
            out[b] = 0
        for b, k in self._extra.items():
            out[b] += k
        return out

    def free_ids(self) -> list[int]:
        """The free ids in free order: never-used ids, then the free queue oldest first (a copy; O(num_free))."""
        return list(range(self.hw, self.num_blocks)) + [b for run in self._queue for b in ids_list(run)]

    def check_integrity(self, owned: npt.NDArray[np.int64] | None = None, *, single_owner: bool = False) -> None:
        """Raise AssertionError unless the free queue holds distinct handed-out ids and (given ``owned``, every
        id some owner holds) the free and owned ids split ``0..hw-1`` exactly; with ``single_owner``, unless no
        block has extra owners. Changes nothing."""
        hw = self.hw
        if not 0 <= hw <= self.num_blocks:
            raise AssertionError(f"allocator: high-water mark {hw} outside [0, {self.num_blocks}]")
        queued = ids_array(make_ids(list(self._queue)))
        if len(queued) != self._queued:
            raise AssertionError(f"allocator: {len(queued)} ids queued, counter says {self._queued}")
        if len(queued) and (int(queued.min()) < 0 or int(queued.max()) >= hw):
            raise AssertionError("allocator: a queued id was never handed out")
        if len(np.unique(queued)) != len(queued):
            raise AssertionError("allocator: a block id is in the free queue twice")
        if any(b in self._extra for b in queued.tolist()) if self._extra else False:
            raise AssertionError("allocator: a free block has extra owners")
        if single_owner and self._extra:
            raise AssertionError(f"allocator: blocks {sorted(self._extra)[:8]}... have several owners")
        if owned is not None:
            if len(owned) and (int(owned.min()) < 0 or int(owned.max()) >= hw):
                raise AssertionError("allocator: an owned block id was never handed out")
            both = np.concatenate((queued, owned))
            if len(both) != hw or not np.array_equal(np.sort(both), np.arange(hw)):
                bad = np.flatnonzero(np.bincount(both, minlength=hw) != 1)[:8].tolist()
                raise AssertionError(f"allocator: blocks {bad}... are not exactly one of free or owned")
