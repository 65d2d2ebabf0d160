"""The "priority" policy: blocks a request or namespace asked to keep (keep_for seconds) stay until the
retention expires, are evicted only when nothing else can be, and never make a request fail.
Exact eviction orders on tiny pools (block size 1, keys API), checked after every step."""

from __future__ import annotations

import pytest

from prefixcache import POLICIES, CacheConfig, PrefixCache


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(num_blocks: int, policy: str = "priority") -> tuple[PrefixCache, Clock]:
    clock = Clock()
    return PrefixCache(CacheConfig(num_blocks=num_blocks, block_size=1, eviction=policy), clock=clock), clock


def serve(cache: PrefixCache, clock: Clock, at: float, keys: list, keep_for=None, namespace="default"):
    clock.now = at
    m = cache.match_keys(keys, namespace)
    r = cache.commit_keys(m.handle, keep_for=keep_for)
    cache.release(m.handle)
    cache.check_integrity()
    return m, r


def cached(cache: PrefixCache) -> set:
    return {k for node in cache.tree.nodes() for k in node.keys}


def test_registered():
    assert "priority" in POLICIES


def test_retained_prefix_outlives_newer_blocks_then_expires():
    cache, clock = make(4)
    serve(cache, clock, 0, ["a1", "a2"], keep_for=10)
    serve(cache, clock, 1, ["b1"])
    serve(cache, clock, 2, ["c1"])
    assert cached(cache) == {"a1", "a2", "b1", "c1"}
    serve(cache, clock, 3, ["d1", "d2"])  # needs 2: the unretained, least recent first: b1, then c1
    assert cached(cache) == {"a1", "a2", "d1", "d2"}
    serve(cache, clock, 4, ["e1"])  # d2 (D's tail) goes; A is still kept
    assert cached(cache) == {"a1", "a2", "d1", "e1"}
    serve(cache, clock, 11, ["f1"])  # A's retention ended at 10: now A is plain LRU, oldest: its tail a2 goes
    assert cached(cache) == {"a1", "d1", "e1", "f1"}
    assert cache.stats.blocks_evicted == 4


def test_same_sequence_under_lru_evicts_the_kept_prefix():
    cache, clock = make(4, "lru")
    serve(cache, clock, 0, ["a1", "a2"], keep_for=10)  # lru ignores retention
    serve(cache, clock, 1, ["b1"])
    serve(cache, clock, 2, ["c1"])
    serve(cache, clock, 3, ["d1", "d2"])
    assert cached(cache) == {"b1", "c1", "d1", "d2"}


def test_only_retained_left_evicts_soonest_expiry_and_never_fails():
    cache, clock = make(2)
    serve(cache, clock, 0, ["a1"], keep_for=10)  # kept until 10
    serve(cache, clock, 1, ["b1"], keep_for=5)  # kept until 6
    m, r = serve(cache, clock, 2, ["c1"])  # nothing unretained: the soonest expiring (b1) goes
    assert r.cached_blocks == 1 and r.not_cached == 0
    assert cached(cache) == {"a1", "c1"}
    m, r = serve(cache, clock, 3, ["d1", "d2"])  # c1 (unretained) first, then a1 (retained) - the request is served
    assert r.cached_blocks == 2
    assert cached(cache) == {"d1", "d2"}


def test_split_path_keeps_retention_on_both_halves():
    cache, clock = make(4)
    serve(cache, clock, 0, ["x1", "x2", "x3"], keep_for=10)
    m, _ = serve(cache, clock, 1, ["x1", "y1"])  # splits the x-run after x1
    assert m.cached_blocks == 1
    serve(cache, clock, 2, ["z1"])  # y1 is the only unretained block
    assert cached(cache) == {"x1", "x2", "x3", "z1"}
    serve(cache, clock, 3, ["w1"])  # z1 next
    assert cached(cache) == {"x1", "x2", "x3", "w1"}
    serve(cache, clock, 3, ["v1", "v2"])  # w1, then the kept run from its tail: x3
    assert cached(cache) == {"x1", "x2", "v1", "v2"}


def test_hits_do_not_extend_retention_but_a_new_keep_does():
    cache, clock = make(3)
    serve(cache, clock, 0, ["a1"], keep_for=5)
    serve(cache, clock, 4, ["a1"])  # a hit without keep_for: still kept only until 5
    serve(cache, clock, 4.5, ["b1"])
    serve(cache, clock, 6, ["c1"])
    serve(cache, clock, 7, ["d1"])  # a1 expired and is least recent (t=4): it goes, not b1
    assert cached(cache) == {"b1", "c1", "d1"}
    serve(cache, clock, 8, ["b1"], keep_for=100)  # re-kept
    serve(cache, clock, 9, ["e1"])
    serve(cache, clock, 10, ["f1"])  # c1 then d1 went, b1 stays
    assert cached(cache) == {"b1", "e1", "f1"}


def test_namespace_retention():
    cache, clock = make(3)
    cache.retain_namespace("system", 50)
    serve(cache, clock, 0, ["s1"], namespace="system")
    serve(cache, clock, 1, ["u1"], namespace="user")
    serve(cache, clock, 2, ["u2"], namespace="user")
    serve(cache, clock, 3, ["u3"], namespace="user")  # u1 goes, the system prompt stays
    assert cached(cache) == {"s1", "u2", "u3"}
    cache.retain_namespace("system", None)
    serve(cache, clock, 4, ["s2"], namespace="system")  # not retained any more: evicts u2 (s1 still kept)
    serve(cache, clock, 5, ["u4"], namespace="user")  # u3 (t=3) is older than the unretained s2 (t=4): u3 goes
    assert cached(cache) == {"s1", "s2", "u4"}


def test_bad_keep_for_is_rejected():
    cache, clock = make(2)
    m = cache.match_keys(["a"])
    with pytest.raises(ValueError, match="keep_for"):
        cache.commit_keys(m.handle, keep_for=-1)
    cache.release(m.handle)
    cache.check_integrity()


def test_tokens_api_keep_for():
    clock = Clock()
    cache = PrefixCache(CacheConfig(num_blocks=4, block_size=2, eviction="priority"), clock=clock)
    with cache.lookup([1, 2, 3, 4, 5]) as m:
        cache.commit(m.handle, keep_for=30)  # blocks (1,2), (3,4) kept
    for toks in ([7, 7, 7], [8, 8, 8], [9, 9, 9]):
        clock.now += 1
        with cache.lookup(toks) as m:
            cache.commit(m.handle)
        cache.check_integrity()
    assert cache.probe([1, 2, 3, 4, 0]) == 4


def test_keep_only_a_leading_part_of_the_path():
    """keep_blocks retains the system-prompt part of a request; the rest of it is ordinary LRU."""
    cache, clock = make(4)
    clock.now = 0
    m = cache.match_keys(["s1", "s2", "q1"])
    cache.commit_keys(m.handle, keep_for=100, keep_blocks=2)  # splits the new run after s2
    cache.release(m.handle)
    cache.check_integrity()
    serve(cache, clock, 1, ["b1"])
    serve(cache, clock, 2, ["c1"])  # needs 1: q1 is unretained and least recent (kept whole, b1 would go)
    assert cached(cache) == {"s1", "s2", "b1", "c1"}
    m, _ = serve(cache, clock, 3, ["s1", "s2", "q2"])  # the kept prefix hits; q2 takes b1 (LRU)
    assert m.cached_blocks == 2 and cached(cache) == {"s1", "s2", "q2", "c1"}


def test_keep_tokens_on_the_token_path_and_bad_values():
    clock = Clock()
    cache = PrefixCache(CacheConfig(num_blocks=4, block_size=2, eviction="priority"), clock=clock)
    with cache.lookup([1, 2, 3, 4, 5, 6, 7]) as m:
        cache.commit(m.handle, keep_for=50, keep_tokens=3)  # 3 tokens: only the first full block is kept
    for other in ([9, 9, 9, 9, 9], [8, 8, 8, 8, 8]):  # 2 blocks each; only block (1, 2) is protected
        with cache.lookup(other) as m:
            cache.commit(m.handle)
        cache.check_integrity()
    assert cache.probe([1, 2, 3, 4, 5]) == 2 and cache.probe([8, 8, 8, 8, 8]) == 4
    with cache.lookup([1, 2, 7]) as m:
        for bad in (-1, 1.5, True):
            with pytest.raises(ValueError, match="keep_tokens"):
                cache.commit(m.handle, keep_for=5, keep_tokens=bad)
    cache.check_integrity()
