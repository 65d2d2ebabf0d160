"""The optimal bound: equal to a brute force over every eviction choice on tiny traces, and never below what
real policies reach, never above the unlimited-capacity hit rate."""

from __future__ import annotations

import itertools
from functools import cache

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_curves_lru import slice_lines

from prefixcache import CacheConfig, PrefixCache
from prefixcache.sim.lru_curve import lru_curve
from prefixcache.sim.node_trace import canonical_blocks
from prefixcache.sim.optimal import next_uses, optimal_hits
from prefixcache.sim.plan import log_grid
from prefixcache.workload.trace import load_trace, trace_from_lists


def brute_force_best(trace, capacity: int, warmup_from: int = 0, weight: str = "blocks") -> int:
    """The most measured hits over EVERY sequence of eviction choices, on an abstract model of PrefixCache.

    State: the set of cached tree paths (tuples of keys from the namespace root), closed under prefixes.
    A request hits its leading cached blocks; afterwards its first min(L, C) blocks are cached and, when
    they do not fit, exactly the missing number of other blocks is dropped, any choice whose remainder is
    still prefix-closed (= evicting unpinned leaves one by one, in some order).
    """
    reqs = []
    for i in range(len(trace)):
        keys = trace.hash_ids(i).tolist()
        paths = [(trace.namespace[i], *keys[: j + 1]) for j in range(len(keys))]
        reqs.append((paths, int(trace.input_length[i])))
    bs = trace.block_size

    @cache
    def best(t: int, state: frozenset) -> int:
        if t == len(reqs):
            return 0
        paths, n = reqs[t]
        h = 0
        while h < len(paths) and paths[h] in state:
            h += 1
        gain = (h if weight == "blocks" else min(h * bs, n)) if t >= warmup_from else 0
        forced = frozenset(paths[: min(len(paths), capacity)])
        others = sorted(state - forced)
        keep = min(len(others), capacity - len(forced))
        result = -1
        for kept in itertools.combinations(others, keep):
            new = forced | frozenset(kept)
            if all(len(p) == 2 or p[:-1] in new for p in new):  # prefix-closed
                result = max(result, best(t + 1, new))
        assert result >= 0
        return gain + result

    return best(0, frozenset())


def replay(trace, policy: str, capacity: int, warmup_from: int = 0) -> tuple[int, int]:
    now = [0.0]
    cache = PrefixCache(
        CacheConfig(num_blocks=capacity, block_size=trace.block_size, eviction=policy), clock=lambda: now[0]
    )
    hb = ht = 0
    for i in range(len(trace)):
        now[0] = float(i)
        m = cache.match_keys(trace.hash_ids(i).tolist(), trace.namespace[i], num_tokens=int(trace.input_length[i]))
        if i >= warmup_from:
            hb += m.cached_blocks
            ht += m.cached_tokens
        cache.commit_keys(m.handle, keep_for=2.5 if policy == "priority" and i % 3 == 0 else None)
        cache.release(m.handle)
    return hb, ht


@st.composite
def tiny_traces(draw):
    n = draw(st.integers(1, 7))
    reqs, lens = [], []
    for _ in range(n):
        reqs.append(draw(st.lists(st.integers(0, 2), min_size=1, max_size=4)))
        lens.append(draw(st.integers((len(reqs[-1]) - 1) * 3 + 1, len(reqs[-1]) * 3)))
    return trace_from_lists(reqs, block_size=3, input_length=lens)


@settings(max_examples=50, deadline=None)
@given(tiny_traces(), st.integers(1, 5))
def test_equals_brute_force_in_blocks(tr, capacity):
    nt = canonical_blocks(tr)
    assert optimal_hits(nt, capacity).hit_blocks == brute_force_best(tr, capacity)


@settings(max_examples=30, deadline=None)
@given(tiny_traces(), st.integers(1, 4), st.sampled_from([0.3, 0.6]))
def test_upper_bound_with_warmup_and_tokens(tr, capacity, warmup):
    nt = canonical_blocks(tr)
    start = int(np.floor(warmup * len(tr)))
    unl = lru_curve(nt, warmup).hits(10**6, "tokens")
    o = optimal_hits(nt, capacity, warmup, unlimited_tokens=unl)
    assert o.hit_blocks >= brute_force_best(tr, capacity, start, "blocks")
    assert o.hit_tokens >= brute_force_best(tr, capacity, start, "tokens")
    assert o.hit_tokens >= o.schedule_tokens  # the schedule itself is achievable


def test_hand_example_beats_lru():
    # C=2, blocks 1, 2, 3 requested in a cycle, three times. LRU always evicts the block needed next: 0 hits.
    # Belady (by hand): t2 [3] evicts 2 (next use t4; 1's is t3) -> t3 [1] hits; t4 [2] evicts 1 (t6; 3's is t5)
    # -> t5 [3] hits; t6 [1] evicts 3 (t8; 2's is t7) -> t7 [2] hits; t8 [3] misses: 3 hits.
    tr = trace_from_lists([[1], [2], [3]] * 3, block_size=1)
    nt = canonical_blocks(tr)
    assert replay(tr, "lru", 2) == (0, 0)  # a real LRU replay through PrefixCache
    assert optimal_hits(nt, 2).hit_blocks == 3 == brute_force_best(tr, 2)
    assert lru_curve(nt).hits(2, "blocks") == 0
    # with 3 blocks everything fits: both hit all 6 repeats; with 1 block neither hits (no back-to-back repeat)
    assert replay(tr, "lru", 3)[0] == optimal_hits(nt, 3).hit_blocks == 6
    assert replay(tr, "lru", 1)[0] == optimal_hits(nt, 1).hit_blocks == 0
    # FIFO-like trap: C=2, [1],[2],[3],[1],[2]: [3] is forced in, so only one of 1, 2 stays: at most 1 hit.
    tr2 = trace_from_lists([[1], [2], [3], [1], [2]], block_size=1)
    assert optimal_hits(canonical_blocks(tr2), 2).hit_blocks == 1 == brute_force_best(tr2, 2)
    assert replay(tr2, "lru", 2)[0] == 0


def test_prefix_semantics_counted_once():
    # deep paths: [1,2,3,4] then [1,2,3,4] with C=2: only the first 2 blocks stay (commit caches a prefix)
    tr = trace_from_lists([[1, 2, 3, 4], [1, 2, 3, 4]], block_size=1)
    nt = canonical_blocks(tr)
    assert optimal_hits(nt, 2).hit_blocks == 2
    assert optimal_hits(nt, 4).hit_blocks == 4
    assert replay(tr, "lru", 2)[0] == 2


@pytest.mark.parametrize(
    "name,first,count",
    [("mooncake_conversation_trace.jsonl.gz", 3000, 300), ("mooncake_synthetic_trace.jsonl.gz", 0, 300)],
)
@pytest.mark.parametrize("warmup", [0.0, 0.4])
def test_bound_dominates_policies_on_mooncake_slices(traces_dir, tmp_path, name, first, count, warmup):
    tr = load_trace(slice_lines(traces_dir / name, tmp_path / "s.jsonl", first, count))
    nt = canonical_blocks(tr)
    curve = lru_curve(nt, warmup)
    start = int(np.floor(warmup * len(tr)))
    W = nt.num_nodes
    unl_b, unl_t = curve.hits(W, "blocks"), curve.hits(W, "tokens")
    nu = next_uses(nt)
    prev = 0
    for c in log_grid(W, 7):
        o = optimal_hits(nt, c, warmup, nu=nu, unlimited_tokens=unl_t)
        assert prev <= o.hit_blocks <= unl_b  # monotone in capacity, never above unlimited
        assert o.hit_tokens <= unl_t
        prev = o.hit_blocks
        for policy in ("lru", "fifo", "lfu", "priority"):
            hb, ht = replay(tr, policy, c, start)
            assert hb <= o.hit_blocks, (policy, c)
            assert ht <= o.hit_tokens, (policy, c)
    assert optimal_hits(nt, W, warmup, nu=nu).hit_blocks == unl_b
