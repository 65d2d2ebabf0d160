"""Window groups in the core (prefixcache.core.windows): every served match holds, in the window group's slots, the
KV of exactly the blocks its window needs, checked against a brute-force model of what was written where."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.core import CacheConfig, PrefixCache
from prefixcache.core.windows import OutOfWindowSlots, WindowRule, WindowSlots

BS = 4


def brute_served(ws: WindowSlots, path: list[int], upto: int) -> int:
    """The deepest point <= upto whose window blocks all hold slots, by trying every point."""
    for p in range(upto, 0, -1):
        if all(ws.table[b] >= 0 for b in path[ws.first_block(p) : p]):
            return p
    return 0


@pytest.mark.parametrize(
    ("kind", "tokens", "blocks", "first"),
    [
        ("sliding", 8, 4, 2),  # query at 16 reads keys 9..: block 2 on
        ("sliding", 9, 4, 2),  # keys 8..: block 2
        ("sliding", 10, 4, 1),  # keys 7..: block 1
        ("sliding", 100, 4, 0),
        ("chunked", 8, 4, 2),  # query at 16: chunk 16..23, block 4
        ("chunked", 8, 3, 2),  # query at 12: chunk 8..15
        ("chunked", 6, 4, 3),  # query at 16: chunk 12..17, block 3
    ],
)
def test_first_block_by_hand(kind: str, tokens: int, blocks: int, first: int) -> None:
    rule = WindowRule(kind, tokens)
    expect = 4 if (kind, tokens, blocks) == ("chunked", 8, 4) else first
    assert rule.first_block(blocks, BS) == expect


def test_bad_rules_are_refused() -> None:
    with pytest.raises(ValueError, match="kind"):
        WindowRule("local", 8)
    with pytest.raises(ValueError, match="tokens"):
        WindowRule("sliding", 0)
    cache = PrefixCache(CacheConfig(num_blocks=8, block_size=BS))
    with pytest.raises(ValueError, match="attach_windows"):
        cache.attach_windows(WindowSlots(WindowRule("sliding", 8), BS, 4, num_blocks=9))


def test_match_is_cut_to_the_deepest_held_window() -> None:
    cache = PrefixCache(CacheConfig(num_blocks=32, block_size=BS))
    ws = WindowSlots(WindowRule("sliding", 8), BS, capacity=16, num_blocks=32)
    cache.attach_windows(ws)
    tokens = list(range(1, 42))  # 10 full blocks
    m = cache.match(tokens)
    res = cache.commit(m.handle, tokens)
    path = list(res.block_ids)
    assert ws.keep_point(path, 6) == path[4:6]  # the window of point 6: blocks 4, 5
    cache.release(m.handle)
    m = cache.match(tokens)
    assert m.cached_blocks == 6 and m.block_ids == tuple(path[:6])
    assert ws.held(("request", m.handle.id)) == {path[4], path[5]}
    assert cache.probe(tokens) == 6 * BS
    cache.release(m.handle)
    assert ws.keep_point(path, 9) == path[7:9]
    m = cache.match(tokens)
    assert m.cached_blocks == 9
    cache.release(m.handle)
    assert cache.match(tokens[: 5 * BS + 1]).cached_blocks == 0  # point 5's window (3, 4) lacks block 3
    cache.check_integrity()


def test_evicted_blocks_lose_their_slots_and_points() -> None:
    cache = PrefixCache(CacheConfig(num_blocks=6, block_size=BS))
    ws = WindowSlots(WindowRule("sliding", 8), BS, capacity=4, num_blocks=6)
    cache.attach_windows(ws)
    a = list(range(1, 22))  # 5 full blocks
    m = cache.match(a)
    path = list(cache.commit(m.handle, a).block_ids)
    ws.keep_point(path, 5)
    cache.release(m.handle)
    b = list(range(100, 121))
    m = cache.match(b)
    cache.commit(m.handle, b)  # evicts a's tail: its point goes, its slots free
    cache.release(m.handle)
    cache.check_integrity()
    assert ws.num_points == 0 and ws.num_free + ws.num_idle == 4 and ws.num_held == 0
    assert cache.match(a).cached_blocks == 0


def test_give_is_all_or_nothing() -> None:
    ws = WindowSlots(WindowRule("sliding", 8), BS, capacity=3, num_blocks=10)
    assert ws.give("r", [0, 1]) == [0, 1]
    with pytest.raises(OutOfWindowSlots):
        ws.give("s", [1, 2, 3])
    assert ws.held("s") == frozenset() and ws.num_free == 1
    ws.check_integrity()
    ws.keep_point([0, 1, 2], 3)  # window: blocks 1, 2
    assert ws.num_free == 0
    assert ws.give("s", [5]) == [5]  # drops the point: block 2's slot goes idle, then to block 5
    assert ws.num_points == 0 and ws.slot(2) is None and ws.slot(1) is not None  # block 1 stays, idle
    ws.check_integrity()


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(["sliding", "chunked"]),
    window=st.integers(1, 14),
    num_blocks=st.integers(4, 24),
    capacity=st.integers(1, 12),
    ops=st.lists(
        st.tuples(
            st.lists(st.integers(0, 2), min_size=1, max_size=40),  # a prompt from a tiny alphabet: shared prefixes
            st.lists(st.integers(0, 10), max_size=3),  # points to keep (block boundaries)
            st.booleans(),  # keep the request-end point
            st.booleans(),  # offer idle slots to the rest
        ),
        min_size=1,
        max_size=25,
    ),
)
def test_served_windows_hold_exactly_their_blocks_kv(
    kind: str, window: int, num_blocks: int, capacity: int, ops: list[tuple[list[int], list[int], bool, bool]]
) -> None:
    cache = PrefixCache(CacheConfig(num_blocks=num_blocks, block_size=BS))
    ws = WindowSlots(WindowRule(kind, window), BS, capacity, num_blocks)
    cache.attach_windows(ws)
    full: dict[int, tuple[int, ...]] = {}  # block id -> the prefix whose last block's KV it holds
    slots: dict[int, tuple[int, ...]] = {}  # window slot -> the same
    for prompt, points, end, offer in ops:
        m = cache.match(prompt)
        path = list(m.block_ids)
        walked = cache.tree.walk_tokens(
            cache.tree.roots.get(("tokens", "default")),
            np.asarray(prompt, np.int32).tobytes(),
            (len(prompt) - 1) // BS,
        )
        tree_path = cache._path_ids(walked.node)[: walked.blocks]
        assert m.cached_blocks == brute_served(ws, tree_path, walked.blocks)
        for i, b in enumerate(path):  # served: full KV of every block, window KV of the window's blocks
            assert full[b] == tuple(prompt[: (i + 1) * BS])
        for i in range(ws.first_block(m.cached_blocks), m.cached_blocks):
            assert slots[int(ws.table[path[i]])] == tuple(prompt[: (i + 1) * BS])
        res = cache.commit(m.handle, prompt)
        seq = cache._path_ids(cache._live[m.handle.id].terminal)[: res.cached_blocks]
        for i, b in zip(range(res.first_block, res.cached_blocks), res.block_ids):
            full[b] = tuple(prompt[: (i + 1) * BS])
        # the request computed the window KV of its blocks from where it was served
        for p in [*points, res.cached_blocks if end else 0]:
            if p <= 0 or p > res.cached_blocks:
                continue
            new = ws.keep_point(seq, p, known_from=m.cached_blocks)
            for b in new or ():
                i = seq.index(b)
                assert i >= m.cached_blocks  # only blocks this request computed get a slot now
                slots[int(ws.table[b])] = tuple(prompt[: (i + 1) * BS])
        if offer:  # the rest of what it computed, into free or idle slots
            for b in ws.offer(seq[m.cached_blocks :]):
                slots[int(ws.table[b])] = tuple(prompt[: (seq.index(b) + 1) * BS])
        cache.release(m.handle)
        cache.check_integrity()


@settings(max_examples=80, deadline=None)
@given(
    capacity=st.integers(1, 10),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["give", "let_go", "drop", "point", "offer", "replace", "forget"]),
            st.integers(0, 3),  # holder
            st.lists(st.integers(0, 15), min_size=1, max_size=5),  # blocks
        ),
        max_size=40,
    ),
)
def test_every_slot_holds_its_blocks_kv_whatever_the_ops(capacity: int, ops: list[tuple[str, int, list[int]]]) -> None:
    """Slots never alias and never go stale: a model of what each slot was written with, against the block's own
    content, after any mix of holds, points, idle offers, duplicate replacement and frees."""
    ws = WindowSlots(WindowRule("sliding", 9), BS, capacity, num_blocks=16)
    content = {b: (b, 0) for b in range(16)}  # a block's K/V (a freed id gets new content when reused)
    written: dict[int, tuple[int, int]] = {}  # slot -> what was written there

    def write(blocks: list[int]) -> None:
        for b in blocks:
            written[int(ws.table[b])] = content[b]

    for op, h, blocks in ops:
        holder = ("request", h)
        if op == "give":
            with contextlib.suppress(OutOfWindowSlots):
                write(ws.give(holder, blocks))
        elif op == "let_go":
            ws.let_go(holder, blocks)
        elif op == "drop":
            ws.drop(holder)
        elif op == "point":
            write(ws.keep_point(blocks, len(blocks)) or [])
        elif op == "offer":
            write(ws.offer(blocks))
        elif op == "replace" and len(blocks) >= 2 and blocks[0] != blocks[1]:
            own, tree = blocks[0], blocks[1]
            content[own] = content[tree]  # a duplicate: the same K/V (what its slot holds is the tree block's)
            if ws.slot(own) is not None:
                written[ws.slot(own)] = content[tree]
            ws.replace(own, tree)
            ws.forget([own])
            content[own] = (own, content[own][1] + 1)  # the id is free: new content when reused
        elif op == "forget":
            ws.forget(blocks)
            for b in blocks:
                content[b] = (b, content[b][1] + 1)
        ws.check_integrity()
        for b in range(16):
            s = ws.slot(b)
            if s is not None:
                assert written.get(s) == content[b], (op, b, s)
