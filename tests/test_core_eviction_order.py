"""Exact eviction orders on tiny pools, computed by hand (free ids are handed out oldest-freed first)."""

from __future__ import annotations

import pytest

from prefixcache import CacheConfig, PrefixCache


def make(num_blocks: int, block_size: int, eviction: str = "lru") -> PrefixCache:
    return PrefixCache(CacheConfig(num_blocks=num_blocks, block_size=block_size, eviction=eviction))


def touch(cache: PrefixCache, tokens: list[int]) -> tuple[int, ...]:
    """A request that matches and ends without committing (e.g. it failed); returns the blocks it was served."""
    m = cache.match(tokens)
    cache.release(m.handle)
    cache.check_integrity()
    return m.block_ids


def test_lru_block_size_1_evicts_tail_of_least_recent_leaf(serve):
    cache = make(5, 1)
    _, r = serve(cache, [1, 2, 3])  # run A = (1)(1,2)(1,2,3) -> blocks 0 1 2
    assert r.block_ids == (0, 1, 2) and r.first_block == 0
    _, r = serve(cache, [4, 5])  # run B -> blocks 3 4; pool full
    assert r.block_ids == (3, 4) and cache.num_free_blocks == 0
    # A is least recently used: only its tail block (1,2,3) goes, and its id is reused at once.
    _, r = serve(cache, [6])
    assert r.block_ids == (2,) and cache.stats.blocks_evicted == 1
    assert cache.probe([1, 2, 3, 0]) == 2 and cache.probe([4, 5, 0]) == 2 and cache.probe([6, 0]) == 1
    # [1,2,7] refreshes (1)(1,2); committing [1,2,7,8] needs 2 blocks: B is now the LRU leaf (tail first).
    m, r = serve(cache, [1, 2, 7], full=[1, 2, 7, 8])
    assert m.block_ids == (0, 1) and m.cached_tokens == 2
    # B's blocks are freed in its order, so they are reused as (3, 4), not last block first
    assert r.first_block == 2 and r.block_ids == (3, 4) and r.cached_blocks == 4 and r.not_cached == 0
    assert cache.probe([4, 5, 0]) == 0 and cache.probe([6, 0]) == 1 and cache.probe([1, 2, 7, 8, 0]) == 4
    assert cache.stats.blocks_evicted == 3


def test_lru_block_size_2_split_keeps_unmatched_tail_old(serve):
    cache = make(6, 2)
    _, r = serve(cache, [1, 1, 2, 2, 3, 3, 4])  # 3 full blocks: 0 1 2 (the 7th token is not a full block)
    assert r.block_ids == (0, 1, 2)
    serve(cache, [5, 5, 6, 6])  # blocks 3 4
    # A match that ends inside A's run refreshes only the two matched blocks.
    assert touch(cache, [1, 1, 2, 2, 9, 9, 9]) == (0, 1)
    # 2 blocks needed, 1 free (5): the victim is A's unmatched tail (3,3), older than B.
    _, r = serve(cache, [7, 7, 8, 8, 0])
    assert r.block_ids == (5, 2)
    assert cache.probe([1, 1, 2, 2, 3, 3, 4]) == 4 and cache.probe([5, 5, 6, 6, 0]) == 4
    # Next the least recent leaf is B (its tail first), not A's refreshed head.
    _, r = serve(cache, [9, 9, 9, 9, 9])
    assert r.block_ids == (3, 4)  # freed in B's order, reused so
    assert cache.probe([5, 5, 6, 6, 0]) == 0 and cache.probe([1, 1, 2, 2, 0]) == 4 and cache.probe([7, 7, 8, 8, 0]) == 4


def test_prompt_of_whole_blocks_leaves_last_token_to_the_model(serve):
    cache = make(4, 2)
    serve(cache, [1, 2, 3, 4])
    m, _ = serve(cache, [1, 2, 3, 4])  # both blocks cached, but only (4-1)//2 = 1 may be served
    assert m.cached_tokens == 2 and m.block_ids == (0,)
    m, _ = serve(cache, [1, 2, 3, 4, 5])
    assert m.cached_tokens == 4 and m.block_ids == (0, 1)


def test_pinned_blocks_are_never_evicted_and_full_pool_caches_a_prefix(serve):
    cache = make(5, 1)
    serve(cache, [6])  # block 0
    serve(cache, [1, 2, 7, 8])  # blocks 1 2 3 4
    held_a = cache.match([6, 0])  # pins (6)
    held_b = cache.match([1, 2, 7, 8, 9])  # pins all four
    assert held_a.block_ids == (0,) and held_b.block_ids == (1, 2, 3, 4)
    # Every block is pinned: a new request runs, caches nothing, and nothing is evicted.
    m = cache.match([9, 9, 9])
    assert m.cached_tokens == 0
    r = cache.commit(m.handle)
    assert r.block_ids == () and r.cached_blocks == 0 and r.not_cached == 3
    assert cache.stats.blocks_evicted == 0 and cache.stats.blocks_not_cached == 3
    cache.check_integrity()
    # Releasing one pinned path frees exactly one block; a second commit caches a 1-block prefix.
    cache.release(held_a.handle)
    r = cache.commit(m.handle)
    assert r.block_ids == (0,) and r.first_block == 0 and r.cached_blocks == 1 and r.not_cached == 2
    cache.check_integrity()
    assert cache.probe([6, 0]) == 0 and cache.probe([1, 2, 7, 8, 9]) == 4 and cache.probe([9, 9, 9]) == 1
    cache.release(m.handle)
    cache.release(held_b.handle)
    cache.check_integrity()


def test_commit_evicts_nothing_on_its_own_path(serve):
    cache = make(4, 1)
    serve(cache, [1, 2, 3])  # 0 1 2
    serve(cache, [5])  # 3
    # The oldest leaf is (1,2,3), but this request's commit runs through it: (5) goes instead.
    m = cache.match([1, 2, 3, 4])
    assert m.block_ids == (0, 1, 2)
    r = cache.commit(m.handle, [1, 2, 3, 4, 4])
    assert r.first_block == 3 and r.block_ids == (3,) and r.not_cached == 1
    cache.release(m.handle)
    cache.check_integrity()
    assert cache.probe([5, 0]) == 0 and cache.probe([1, 2, 3, 4, 0]) == 4


def _policy_scenario(cache: PrefixCache, serve) -> None:
    serve(cache, [1, 2])  # A: blocks 0 1, inserted first
    serve(cache, [3, 4])  # B: blocks 2 3; pool full
    touch(cache, [3, 4, 9])  # B: 1 hit
    touch(cache, [3, 4, 9])  # B: 2 hits
    touch(cache, [1, 2, 9])  # A: 1 hit, most recent


@pytest.mark.parametrize(
    ("policy", "first", "second", "gone"),
    [
        # LRU: B is least recent -> its tail (3,4) then its head (3).
        ("lru", (3,), (2,), ([3, 4, 0], 0)),
        # FIFO: A was inserted first, whatever its use -> (1,2) then (1).
        ("fifo", (1,), (0,), ([1, 2, 0], 0)),
        # LFU: A has fewer hits -> (1,2); then the new, never-hit (5) goes before anything else.
        ("lfu", (1,), (1,), ([1, 2, 0], 1)),
    ],
)
def test_policy_orders(serve, policy, first, second, gone):
    cache = make(4, 1, policy)
    _policy_scenario(cache, serve)
    _, r = serve(cache, [5])
    assert r.block_ids == first
    _, r = serve(cache, [6])
    assert r.block_ids == second
    tokens, left = gone
    assert cache.probe(tokens) == left
    assert cache.stats.blocks_evicted == 2


def test_lfu_second_victim_is_the_unhit_block(serve):
    cache = make(4, 1, "lfu")
    _policy_scenario(cache, serve)
    serve(cache, [5])
    serve(cache, [6])
    assert cache.probe([5, 0]) == 0 and cache.probe([6, 0]) == 1
    assert cache.probe([1, 2, 0]) == 1 and cache.probe([3, 4, 0]) == 2


def test_fifo_blocks_appended_by_a_later_commit_are_younger(serve):
    cache = make(4, 1, "fifo")
    serve(cache, [1])  # block 0, inserted first
    serve(cache, [5])  # block 1
    serve(cache, [1, 9], full=[1, 2, 3])  # (1,2) (1,2,3) -> blocks 2 3, inserted last
    _, r = serve(cache, [7])  # the oldest leaf block is (5), not the just-inserted (1,2,3)
    assert r.block_ids == (1,)
    assert cache.probe([5, 0]) == 0 and cache.probe([1, 2, 3, 0]) == 3


def test_lfu_blocks_appended_by_a_later_commit_start_without_hits(serve):
    cache = make(4, 1, "lfu")
    serve(cache, [1])  # block 0
    touch(cache, [1, 9])
    touch(cache, [1, 9])
    serve(cache, [1, 9], full=[1, 2, 3])  # (1) has 3 hits; (1,2) (1,2,3) -> blocks 1 2, no hits
    serve(cache, [5])  # block 3; pool full
    touch(cache, [5, 9])  # (5): 1 hit
    _, r = serve(cache, [7])  # the never-hit leaf (1,2,3) goes, not (5)
    assert r.block_ids == (2,)
    assert cache.probe([5, 0]) == 1 and cache.probe([1, 2, 3, 0]) == 2
