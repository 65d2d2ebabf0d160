"""BlockAllocator: free order and reference counts by hand; runs of ids against a brute-force free list."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.core.allocator import BlockAllocator, ascending
from prefixcache.core.block_ids import Runs, ids_array, ids_list, make_ids, pieces_of


def test_free_queue_is_oldest_freed_first():
    a = BlockAllocator(7)
    assert list(a.allocate(5)) == [0, 1, 2, 3, 4]
    a.decref([2, 0])
    a.free(range(4, 2, -1))  # a node's tail, tail block first
    assert a.free_ids() == [5, 6, 0, 2, 3, 4]  # each freed run ascending, the older run first
    assert list(a.allocate(4)) == [5, 6, 0, 2]
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
    first (one release's ids ascending)."""

    def __init__(self, n: int) -> None:
        self.free = list(range(n))

    def allocate(self, k: int) -> list[int]:
        taken, self.free = self.free[:k], self.free[k:]
        return taken

    def release(self, ids: list[int]) -> None:
        self.free.extend(sorted(ids))


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
            cut = pick % (len(run) + 1)  # a node drops its tail from ``cut`` on, tail block first
            head, tail = run[:cut], run[cut:][::-1]
            assert ids_list(head) + ids_list(tail)[::-1] == ids_list(run)
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


def test_a_long_run_freed_tail_first_comes_back_ascending():
    """A multi-piece run of ranges (a large allocation over freed runs) freed reversed, as a node's tail is,
    joins the free queue ascending and stays ranges (no array of its ids)."""
    a = BlockAllocator(10_000)
    first, second = a.allocate(5_000), a.allocate(5_000)
    a.free(first[:2_500][::-1])
    a.free(second[:2_500][::-1])
    run = a.allocate(5_000)  # the two freed runs, one after the other
    assert ids_list(run) == list(range(2_500)) + list(range(5_000, 7_500))
    a.free(run[::-1])
    assert a.free_ids() == list(range(2_500)) + list(range(5_000, 7_500))
    assert all(type(p) is range for p in a._queue)
    a.check_integrity(np.concatenate([ids_array(first[2_500:]), ids_array(second[2_500:])]), single_owner=True)


@given(
    pieces=st.lists(
        st.one_of(
            st.tuples(st.integers(0, 60), st.integers(1, 8), st.booleans()).map(
                lambda t: ("range", t[0] * 10, t[1], t[2])
            ),
            st.lists(st.integers(0, 9), min_size=1, max_size=6, unique=True).map(lambda x: ("array", x)),
        ),
        max_size=8,
    ),
    big=st.booleans(),
)
def test_ascending_sorts_any_run(pieces, big):
    """``ascending`` gives the ids of any run (ranges either way round, arrays, multi-piece runs, large ones of
    ranges) sorted, and keeps a large run of ranges as ranges."""
    made, used = [], set()
    for i, p in enumerate(pieces):
        if p[0] == "range":
            _, start, n, down = p
            start += 100_000 * i
            r = range(start, start + n * (5_000 if big else 1))
            made.append(r[::-1] if down else r)
        else:
            made.append(np.asarray([100_000 * i + 90_000 + x for x in p[1]], np.int64))
        used.update(ids_list(made[-1]))
    run = make_ids(made)
    assert len(used) == len(run)  # distinct ids, as a run's are
    up = ascending(run)
    assert ids_list(up) == sorted(used)
    if isinstance(run, Runs) and all(isinstance(p, range) for p in made):  # large: no array of its ids
        assert all(isinstance(p, range) for p in pieces_of(up))
