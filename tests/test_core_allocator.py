"""BlockAllocator: free order and reference counts, by hand."""

from __future__ import annotations

import pytest

from prefixcache.core.allocator import BlockAllocator


def test_free_queue_is_oldest_freed_first():
    a = BlockAllocator(5)
    assert list(a.allocate(3)) == [0, 1, 2]
    a.decref([2, 0])
    assert a.free_ids() == [3, 4, 2, 0]
    assert list(a.allocate(3)) == [3, 4, 2]
    a.check_integrity()


def test_reference_counts_with_repeated_ids():
    a = BlockAllocator(4)
    a.allocate(2)  # 0 1
    a.incref([1, 1])  # block 1: three owners
    a.decref([1, 1, 0])  # one decref call dropping two of them, and block 0's only owner
    assert a.refs == [0, 1, 0, 0] and a.free_ids() == [2, 3, 0]
    a.decref([1])
    assert a.free_ids() == [2, 3, 0, 1]
    a.check_integrity()


def test_errors_change_nothing():
    a = BlockAllocator(3)
    a.allocate(1)
    with pytest.raises(MemoryError, match="asked for 3 blocks, 2 free"):
        a.allocate(3)
    with pytest.raises(ValueError, match="decref of a free block"):
        a.decref([0, 0])  # two drops, one owner
    with pytest.raises(ValueError, match="decref of a free block"):
        a.decref([2])
    with pytest.raises(ValueError, match="incref of a free block"):
        a.incref([1])
    assert a.refs == [1, 0, 0] and a.num_free == 2
    a.check_integrity()
