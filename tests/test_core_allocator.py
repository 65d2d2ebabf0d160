"""BlockAllocator: free order and reference counts by hand; runs of ids against a brute-force free list."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.core.allocator import BlockAllocator
from prefixcache.core.block_ids import ids_array, ids_list, make_ids


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


# ---- runs: a brute-force free-list model -------------------------------------------------------------
class FreeList:
    """The free order spelled out: a plain list of every free id, never-used ids first, then freed ids oldest
    first."""

    def __init__(self, n: int) -> None:
        self.free = list(range(n))

    def allocate(self, k: int) -> list[int]:
        taken, self.free = self.free[:k], self.free[k:]
        return taken

    def release(self, ids: list[int]) -> None:
        self.free.extend(ids)


@settings(max_examples=200, deadline=None)
@given(
    num_blocks=st.integers(1, 40),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 45), st.integers(0, 10**6)), max_size=40),
)
def test_runs_follow_the_free_list_model(num_blocks, ops):
    """Allocating and freeing runs (ranges, array views, multi-piece Runs, cut and reversed as the tree does)
    hands out exactly the ids a plain free list would, and the free and owned ids always split 0..hw-1."""
    a = BlockAllocator(num_blocks)
    ref = FreeList(num_blocks)
    owned: list = []  # runs held by "nodes"
    for alloc, k, pick in ops:
        if alloc:
            if k > len(ref.free):
                with pytest.raises(MemoryError):
                    a.allocate(k)
                continue
            run = a.allocate(k)
            assert ids_list(run) == ref.allocate(k) and len(run) == k
            if k:
                owned.append(run)
        elif owned:
            run = owned.pop(pick % len(owned))
            cut = pick % (len(run) + 1)  # a node drops its tail from ``cut`` on (in its order; reversed: any order)
            head, tail = run[:cut], (run[cut:][::-1] if pick % 2 else run[cut:])
            assert ids_list(head) + sorted(ids_list(tail)) == ids_list(head) + sorted(ids_list(run)[cut:])
            a.free(tail)
            ref.release(ids_list(tail))
            if len(head):
                owned.append(head)
        assert a.num_free == len(ref.free) and a.free_ids() == ref.free
        held = np.concatenate([ids_array(r) for r in owned]) if owned else np.zeros(0, np.int64)
        a.check_integrity(held, single_owner=True)


@given(
    pieces=st.lists(
        st.one_of(
            st.tuples(st.integers(0, 50), st.integers(0, 6), st.sampled_from([1, -1])).map(
                lambda t: range(t[0], t[0] + t[2] * t[1], t[2])
            ),
            st.lists(st.integers(0, 99), max_size=6).map(lambda x: np.asarray(x, np.int64)),
        ),
        max_size=20,
    ),
    a=st.integers(-30, 60),
    b=st.integers(-30, 60),
)
def test_a_run_slices_like_the_list_of_its_ids(pieces, a, b):
    flat = [int(x) for p in pieces for x in p]
    run = make_ids(list(pieces))
    assert len(run) == len(flat) and ids_list(run) == flat and [int(x) for x in run] == flat
    assert ids_list(run[a:b]) == flat[a:b]
    assert ids_list(run[::-1]) == flat[::-1]
    assert ids_list(run[a:][::-1]) == flat[a:][::-1]
    assert ids_array(run).tolist() == flat


def test_a_huge_pool_costs_nothing_until_used():
    a = BlockAllocator(2**40)
    assert a.num_free == 2**40
    run = a.allocate(3)
    assert run == range(3) and a.num_free == 2**40 - 3
    a.free(run[::-1])
    assert a.allocate(2) == range(3, 5)  # never-used ids first, freed ones after them
    a.check_integrity(np.asarray([3, 4], np.int64), single_owner=True)
