"""The one-pass LRU curve equals separate replays through the real PrefixCache, capacity by capacity."""

from __future__ import annotations

import gzip
import itertools
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache import CacheConfig, PrefixCache
from prefixcache.sim.lru_curve import lru_curve
from prefixcache.sim.node_trace import canonical_blocks
from prefixcache.sim.plan import log_grid
from prefixcache.workload.order import ordered
from prefixcache.workload.trace import load_trace, trace_from_lists


def replay_lru(trace, capacity: int, warmup_from: int = 0) -> tuple[int, int, int, int]:
    """Independent reference: (hit blocks, hit tokens, looked-up blocks, prompt tokens) of a real LRU replay."""
    cache = PrefixCache(CacheConfig(num_blocks=capacity, block_size=trace.block_size, eviction="lru"))
    hb = ht = tb = tt = 0
    for i in range(len(trace)):
        keys = trace.hash_ids(i).tolist()
        m = cache.match_keys(keys, trace.namespace[i], num_tokens=int(trace.input_length[i]))
        if i >= warmup_from:
            hb += m.cached_blocks
            ht += m.cached_tokens
            tb += len(keys)
            tt += int(trace.input_length[i])
        cache.commit_keys(m.handle)
        cache.release(m.handle)
    return hb, ht, tb, tt


def check_equal(trace, capacities, warmup: float = 0.0) -> None:
    curve = lru_curve(canonical_blocks(trace), warmup)
    start = int(np.floor(warmup * len(trace)))
    for c in capacities:
        hb, ht, tb, tt = replay_lru(trace, c, start)
        assert (curve.hits(c, "blocks"), curve.hits(c, "tokens")) == (hb, ht), f"capacity {c}"
        assert (curve.total_blocks, curve.total_tokens) == (tb, tt)


DATA = Path(__file__).parent / "data"


def slice_lines(src: Path, dst: Path, first: int, count: int) -> Path:
    opener = gzip.open if src.suffix == ".gz" else open
    with opener(src, "rt", encoding="utf-8") as f, open(dst, "w", encoding="utf-8") as out:
        out.writelines(itertools.islice(f, first, first + count))
    return dst


# ---- hand-computed -------------------------------------------------------------------------------------
def test_hand_computed_stack_distances():
    # blocks: A=[1,2,3], B=[1,4], A again. LRU stack before the 3rd request (top first): 1, 4, 2, 3
    # (B touched 1 and 4 last; deeper-first among A's own). So A hits 1 block at C=1, and only at C >= 4
    # all three (2 sits at distance 2, 3 at distance 3); at C=2,3 the hit stops after block 1 / block 2.
    tr = trace_from_lists([[1, 2, 3], [1, 4], [1, 2, 3]], block_size=4)
    curve = lru_curve(canonical_blocks(tr))
    # hits by capacity: request 2 hits block 1 whenever C >= 1 (distance 0); request 3 hits per the stack
    expect = {1: 1 + 1, 2: 1 + 1, 3: 1 + 2, 4: 1 + 3}
    for c, h in expect.items():
        assert curve.hits(c) == h
        assert replay_lru(tr, c)[0] == h
    assert curve.total_blocks == 8


# ---- real traces ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name,first,count",
    [
        ("mooncake_conversation_trace.jsonl.gz", 0, 500),
        ("mooncake_conversation_trace.jsonl.gz", 6000, 400),
        ("mooncake_synthetic_trace.jsonl.gz", 0, 500),
    ],
)
def test_mooncake_slices_equal_replays(traces_dir, tmp_path, name, first, count):
    tr = load_trace(slice_lines(traces_dir / name, tmp_path / "slice.jsonl", first, count))
    W = canonical_blocks(tr).num_nodes
    caps = sorted(set(log_grid(W, 10)) | {1, 2, 3, W - 1, W + 5})
    check_equal(tr, [c for c in caps if c >= 1])


def test_mooncake_warmup_and_timestamp_order(traces_dir, tmp_path):
    tr = load_trace(slice_lines(traces_dir / "mooncake_conversation_trace.jsonl.gz", tmp_path / "s.jsonl", 2000, 300))
    check_equal(tr, [1, 10, 100, 400, 1500], warmup=0.3)
    rng = np.random.default_rng(0)
    shuffled = tr.take(rng.permutation(len(tr)))  # out of time order, so the stable sort matters
    by_time = ordered(shuffled, "timestamp")
    assert np.all(np.diff(by_time.timestamp) >= 0)
    check_equal(by_time, [5, 50, 500])


def test_kvtester_sessions_interleaved_equal_replays(tmp_path):
    """kv-tester lines carry sessions (namespaces) and resend their history: long runs per request."""
    tr = load_trace(slice_lines(DATA / "kvtester_head160.jsonl.gz", tmp_path / "kv.jsonl", 0, 160))
    assert len(set(tr.namespace)) > 1
    tr = ordered(tr, "timestamp")
    W = canonical_blocks(tr).num_nodes
    check_equal(tr, [1, 64, 1000, 5000, W // 3, W], warmup=0.1)


# ---- random traces --------------------------------------------------------------------------------------
def tree_traces(max_requests: int = 14):
    """Requests walking random paths of a small tree: ids consistent with their parents (the fast path)."""

    @st.composite
    def build(draw):
        n = draw(st.integers(1, max_requests))
        reqs, lens, stamps = [], [], []
        for _ in range(n):
            depth = draw(st.integers(1, 6))
            branch = draw(st.lists(st.integers(0, 2), min_size=depth, max_size=depth))
            ids, node = [], 0
            for b in branch:
                node = node * 3 + b + 1  # heap numbering: unique per path
                ids.append(node)
            reqs.append(ids)
            lens.append(draw(st.integers((depth - 1) * 4 + 1, depth * 4)))
            stamps.append(draw(st.integers(0, 5)))
        return trace_from_lists(reqs, block_size=4, input_length=lens, timestamp=stamps)

    return build()


def arbitrary_traces():
    """Any id lists: repeated ids, ids under different parents, several namespaces (the dict path)."""

    @st.composite
    def build(draw):
        n = draw(st.integers(1, 12))
        reqs = [draw(st.lists(st.integers(0, 4), min_size=1, max_size=6)) for _ in range(n)]
        ns = [draw(st.sampled_from(["a", "b"])) for _ in range(n)]
        return trace_from_lists(reqs, block_size=2, namespace=ns)

    return build()


@settings(max_examples=60, deadline=None)
@given(tree_traces(), st.sampled_from([0.0, 0.25, 0.5]), st.sampled_from(["file", "timestamp"]))
def test_random_tree_traces_equal_replays(tr, warmup, order):
    tr = ordered(tr, order)
    W = canonical_blocks(tr).num_nodes
    check_equal(tr, range(1, W + 2), warmup)


@settings(max_examples=60, deadline=None)
@given(arbitrary_traces())
def test_random_arbitrary_traces_equal_replays(tr):
    W = canonical_blocks(tr).num_nodes
    check_equal(tr, range(1, W + 2))


def test_fast_and_dict_paths_agree():
    """The vectorised node numbering and the dict walk give the same partition of references."""
    from prefixcache.sim.node_trace import _consistent_nodes, _walk_nodes

    rng = np.random.default_rng(1)
    reqs = []
    for _ in range(300):
        node, ids = 0, []
        for _ in range(int(rng.integers(1, 10))):
            node = 2 * node + 1 + int(rng.integers(0, 2))  # heap numbering: one parent per id
            ids.append(node)
        reqs.append(ids)
    tr = trace_from_lists(reqs, block_size=8)
    no_ns = np.zeros(len(tr), dtype=np.int64)
    fast = _consistent_nodes(tr.ids, tr.offsets[:-1], no_ns)
    assert fast is not None
    walked = _walk_nodes(tr.ids, tr.offsets, no_ns)
    pairs = set(zip(fast.tolist(), walked.tolist()))  # same partition: a bijection between the numberings
    assert len(pairs) == len(set(fast.tolist())) == len(set(walked.tolist()))
    # an id under two parents sends the trace to the dict path
    assert _consistent_nodes(np.array([1, 2, 3, 2]), np.array([0, 2]), np.zeros(2, dtype=np.int64)) is None
