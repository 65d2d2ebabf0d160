"""Miss causes (prefixcache.sim.causes): hand-built workloads with a known cause at a known position, a
brute-force reference on random workloads, reuse distances checked by replaying at that capacity, and the
counts adding up on the Mooncake traces and every shipped scenario."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache import CacheConfig, PrefixCache
from prefixcache.sim.causes import LiveCauses, workload_causes
from prefixcache.sim.policy import Capacity, ReplayPolicy
from prefixcache.sim.replay import Replayer, replay, simulate
from prefixcache.sim.requests import CacheRequests, from_scenario, from_trace
from prefixcache.sim.results import CAUSE_FIELDS, Row
from prefixcache.workload.requests import ScenarioRequest
from prefixcache.workload.scenario import Scenario, load_scenario
from prefixcache.workload.trace import load_trace, trace_from_lists

SCENARIOS = Path(__file__).resolve().parents[1] / "scenarios"


def token_requests(prompts, bs, namespaces=None, max_new_tokens=4) -> CacheRequests:
    namespaces = namespaces or ["default"] * len(prompts)
    reqs = tuple(ScenarioRequest(tokens=tuple(p), namespace=ns) for p, ns in zip(prompts, namespaces))
    return from_scenario(Scenario("test", requests=reqs, max_new_tokens=max_new_tokens), bs)


def causes(row: Row) -> dict[str, int]:
    return {c: getattr(row, f) for c, f in CAUSE_FIELDS.items()}


def assert_adds_up(rows) -> None:
    for r in rows:
        assert sum(causes(r).values()) == r.prompt_tokens - r.cached_tokens, r


def only(**nonzero: int) -> dict[str, int]:
    return {c: nonzero.get(c, 0) for c in CAUSE_FIELDS}


# ---- hand-built: one cause at a known position ------------------------------------------------------------------
def test_date_at_the_top_diverges_at_its_position():
    # [1 2 3 | date | 40 shared system tokens | 20-token question], block size 4: every request after the first
    # departs from history at token 3 (the date), and the system prompt after it was seen before.
    system = list(range(1000, 1040))
    prompts = [[1, 2, 3, 500 + k, *system, *range(2000 + 100 * k, 2020 + 100 * k)] for k in range(6)]
    rows = replay(token_requests(prompts, 4), Capacity(None)).rows
    assert_adds_up(rows)
    n, s = 64, 60  # prompt tokens, servable ((64 - 1) // 4 * 4)
    assert causes(rows[0]) == only(cold=s, partial_block=n - s)
    for k, r in enumerate(rows[1:], 1):
        assert r.cached_tokens == 0 and r.shared_tokens == 3 and r.shared_with is not None and r.shared_with < k
        # diverged: the 3 shared tokens of block 0 + the 40 system tokens; cold: the date + the question's 16
        # servable tokens; partial_block: the last block
        assert causes(r) == only(diverged=3 + 40, cold=1 + 16, partial_block=n - s)


def test_reasoning_dropped_from_history():
    # turn 1 sends its reasoning; turn 2's template drops it: the answer and tool output after it were seen
    system, user1, think, answer, tool, user2 = (
        list(range(a, a + n)) for a, n in ((1000, 20), (2000, 10), (3000, 30), (4000, 20), (5000, 20), (6000, 10))
    )
    t1 = [*system, *user1, *think, *answer, *tool]
    t2 = [*system, *user1, *answer, *tool, *user2]
    rows = replay(token_requests([t1, t2], 4), Capacity(None)).rows
    assert_adds_up(rows)
    r = rows[1]
    assert (r.shared_tokens, r.shared_with, r.cached_tokens) == (30, 0, 28)
    # [28, 30): shared, in the block where it departs; [30, 70): answer + tool output, seen in turn 1
    assert causes(r) == only(diverged=2 + 40, cold=76 - 70, partial_block=80 - 76)


def test_namespaces_sharing_a_prefix():
    system = list(range(1000, 1040))
    prompts = [[*system, *range(2000, 2020)], [*system, *range(3000, 3020)], [*system, *range(2000, 2020)]]
    rows = replay(token_requests(prompts, 4, ["a", "b", "b"]), Capacity(None)).rows
    assert_adds_up(rows)
    # b's first request: the system prompt was cached only under a; the question is new
    assert rows[1].cached_tokens == 0
    assert causes(rows[1]) == only(namespace=40, cold=56 - 40, partial_block=4)
    # b's second: the system prompt now hits in b; the question was sent only in a
    assert rows[2].cached_tokens == 40
    assert causes(rows[2]) == only(namespace=56 - 40, partial_block=4)


def test_shared_prompt_shorter_than_a_block():
    system = list(range(1000, 1010))  # 10 shared tokens, block size 16
    prompts = [[*system, *range(2000 + 100 * k, 2030 + 100 * k)] for k in range(4)]
    rows = replay(token_requests(prompts, 16), Capacity(None)).rows
    assert_adds_up(rows)
    for r in rows[1:]:
        assert r.cached_tokens == 0 and r.shared_tokens == 10
        assert causes(r) == only(partial_block=(40 - 32) + 10, cold=32 - 10)


def test_evicted_with_its_reuse_distance():
    # ids A=[1,2,3], B=[4,5,6], A again; 3 blocks: B evicts A. The LRU stack before the 3rd request (top
    # first) is 4 5 6 1 2 3, so block 3 sits at distance 5: 6 blocks would have kept all of A.
    reqs = from_trace(trace_from_lists([[1, 2, 3], [4, 5, 6], [1, 2, 3]], block_size=4))
    r = replay(reqs, Capacity(3)).rows[2]
    assert r.cached_tokens == 0 and r.reuse_blocks == 6
    assert causes(r) == only(evicted=12)
    assert replay(reqs, Capacity(6)).rows[2].cached_tokens == 12
    assert replay(reqs, Capacity(5)).rows[2].cached_tokens == 8


def test_not_cached_when_the_pool_is_full_of_pinned_blocks():
    reqs = from_trace(trace_from_lists([[1, 2, 3], [1, 2, 3]], block_size=4))
    rows = replay(reqs, Capacity(2)).rows
    assert causes(rows[0]) == only(cold=12)
    assert rows[1].cached_tokens == 8 and causes(rows[1]) == only(not_cached=4)
    assert rows[1].reuse_blocks is None


def test_trace_with_full_blocks_only_has_a_partial_tail():
    # kv-cache-tester lines list full blocks only: the tail after them is partial_block
    reqs = from_trace(trace_from_lists([[1, 2], [1, 2]], block_size=4, input_length=[10, 10]))
    rows = replay(reqs, Capacity(None)).rows
    assert causes(rows[0]) == only(cold=8, partial_block=2)
    assert rows[1].cached_tokens == 8 and causes(rows[1]) == only(partial_block=2)


def test_trace_sessions_as_namespaces():
    # kv-cache-tester sessions are namespaces: the same hash ids in another session were cached, not shared
    reqs = from_trace(trace_from_lists([[1, 2, 3], [1, 2, 9], [1, 2, 9]], block_size=4, namespace=["a", "b", "b"]))
    rows = replay(reqs, Capacity(None)).rows
    assert causes(rows[1]) == only(namespace=8, cold=4) and rows[1].shared_with == 0
    assert rows[2].cached_tokens == 12 and causes(rows[2]) == only()


def test_out_of_order_serving_gives_no_causes():
    reqs = from_trace(trace_from_lists([[1], [2], [3]], block_size=4))
    rep = Replayer(reqs, 8, ReplayPolicy())
    assert rep.serve(0).cold_tokens == 4
    assert rep.serve(2).cold_tokens is None
    assert rep.serve(1).cold_tokens is None


# ---- a brute-force reference on random token workloads ------------------------------------------------------------
def lcp(a, b) -> int:
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k


def occurs(window, seq) -> bool:
    w = len(window)
    return any(tuple(seq[j : j + w]) == window for j in range(len(seq) - w + 1))


def brute_force(reqs: CacheRequests, i: int, partner: int | None) -> dict[str, int]:
    """The capacity-independent causes of request i by the definitions, comparing with every earlier sequence."""
    bs = reqs.block_size
    p = reqs.prompts[i].tolist()
    seqs = [c.tolist() for c in reqs.commits[:i]]
    n, s = len(p), ((len(p) - 1) // bs) * bs
    same = max((lcp(p, q) for j, q in enumerate(seqs) if reqs.namespace[j] == reqs.namespace[i]), default=0)
    t = max((lcp(p, q) for q in seqs), default=0)
    a_same, a_any = min(same // bs * bs, s), min(t // bs * bs, s)
    cov = 0
    if partner is not None and t < s:
        q = seqs[partner]
        assert lcp(p, q) == t
        k = max(bs, 16)
        if len(q) > t:  # a fork: the positions of [t, s) inside a k-window that occurs in q after t
            ok = [occurs(tuple(p[j : j + k]), q[t:]) for j in range(t, s - k + 1)]
            cov = sum(any(ok[j - t] for j in range(max(t, x - k + 1), min(x, s - k) + 1)) for x in range(t, s))
    in_block = min(t, s) - a_any
    return {
        "seen_same": a_same,
        "shared": t,
        "namespace": a_any - a_same,
        "diverged": cov + in_block if cov else 0,
        "partial_block": n - s + (0 if cov else in_block),
        "cold": max(0, s - t) - cov,
    }


SEGMENTS = [tuple(range(10, 30)), tuple(range(30, 37)), (40, 41, 42, 40, 41), tuple(range(50, 70)), (1, 2, 3)]


@st.composite
def token_workloads(draw):
    n = draw(st.integers(1, 8))
    prompts, namespaces = [], []
    for _ in range(n):
        segs = draw(st.lists(st.sampled_from(SEGMENTS), min_size=1, max_size=4))
        prompts.append([t for s in segs for t in s] + draw(st.lists(st.integers(0, 5), max_size=3)))
        namespaces.append(draw(st.sampled_from(["a", "a", "b"])))
    return prompts, namespaces, draw(st.sampled_from([1, 2, 4, 8])), draw(st.integers(1, 20))


@settings(max_examples=80, deadline=None)
@given(token_workloads())
def test_matches_brute_force(workload):
    prompts, namespaces, bs, max_new = workload
    reqs = token_requests(prompts, bs, namespaces, max_new)
    rows = replay(reqs, Capacity(None)).rows
    wc = workload_causes(reqs)
    for i, r in enumerate(rows):
        want = brute_force(reqs, i, r.shared_with)
        assert r.cached_tokens == want["seen_same"]  # unlimited: exactly what history holds in its namespace
        assert r.shared_tokens == want["shared"]
        assert wc.unseen[i].seen_same == want["seen_same"]
        got = causes(r)
        for cause in ("namespace", "diverged", "partial_block", "cold"):
            assert got[cause] == want[cause], (i, cause, got, want)
        assert got["evicted"] == got["not_cached"] == 0


@st.composite
def key_workloads(draw):
    n = draw(st.integers(2, 12))
    trie = [[1], [1, 2], [1, 2, 3], [4], [4, 5], [1, 6], [1, 6, 7, 8], [9, 10, 11, 12]]
    return [draw(st.sampled_from(trie)) for _ in range(n)], draw(st.integers(1, 6))


@settings(max_examples=60, deadline=None)
@given(key_workloads())
def test_reuse_distance_is_the_capacity_that_keeps_the_evicted_blocks(workload):
    paths, cap = workload
    reqs = from_trace(trace_from_lists(paths, block_size=2))
    rows = replay(reqs, Capacity(cap)).rows
    assert_adds_up(rows)
    for i, r in enumerate(rows):
        if r.evicted_tokens:
            assert r.not_cached_tokens == 0 or cap < 4  # only pools smaller than a request fail commits
            if r.not_cached_tokens:
                continue
            want = r.cached_tokens + r.evicted_tokens
            assert replay(reqs, Capacity(r.reuse_blocks)).rows[i].cached_tokens == want
            if r.reuse_blocks > 1:
                assert replay(reqs, Capacity(r.reuse_blocks - 1)).rows[i].cached_tokens < want
        else:
            assert r.reuse_blocks is None


@settings(max_examples=40, deadline=None)
@given(token_workloads(), st.integers(2, 12))
def test_token_reuse_distances_and_live_causes(workload, cap):
    prompts, namespaces, bs, max_new = workload
    reqs = token_requests(prompts, bs, namespaces, max_new)
    rows = replay(reqs, Capacity(cap)).rows
    assert_adds_up(rows)
    for i, r in enumerate(rows):
        if r.evicted_tokens and not r.not_cached_tokens:
            want = r.cached_tokens + r.evicted_tokens
            assert replay(reqs, Capacity(r.reuse_blocks)).rows[i].cached_tokens == want
    # the wrapper's incremental analysis, driving a cache by hand, finds the same causes (without reuse)
    cache = PrefixCache(CacheConfig(num_blocks=cap, block_size=bs))
    live = LiveCauses(bs)
    for i, r in enumerate(rows):
        m = cache.match(reqs.prompts[i], namespaces[i])
        lr = live.request(reqs.prompts[i], namespaces[i], m.cached_tokens)
        c = cache.commit(m.handle, reqs.commits[i])
        cache.release(m.handle)
        live.committed(lr, reqs.commits[i], c)
        assert m.cached_tokens == r.cached_tokens
        split = tuple(getattr(r, f) for f in CAUSE_FIELDS.values())
        assert lr.causes._replace(reuse_blocks=None) == (*split, None, r.shared_tokens, r.shared_with)


def test_live_causes_forget_past_their_window():
    live = LiveCauses(4, max_tokens=20)
    cache = PrefixCache(CacheConfig(num_blocks=100, block_size=4))
    a = np.arange(100, 116, dtype=np.int32)
    for k in range(3):  # the second commit overflows the window: history starts over, the cache does not
        m = cache.match(a)
        lr = live.request(a, "default", m.cached_tokens)
        live.committed(lr, a, cache.commit(m.handle))
        cache.release(m.handle)
        assert sum(lr.causes[:7]) == 16 - m.cached_tokens
        assert lr.causes.partial_block == 4 and m.cached_tokens == (0 if k == 0 else 12)


def test_live_no_state_lies_between_the_served_tokens_and_the_kv_match():
    """A hybrid model is served only up to its deepest recurrent-state snapshot: the cached KV past it is no_state,
    what its KV match does not reach any more is evicted (by hand: an 18-token prompt, blocks of 4)."""
    bs = 4
    live = LiveCauses(bs)
    cache = PrefixCache(CacheConfig(num_blocks=4, block_size=bs))
    a = np.arange(100, 118, dtype=np.int32)  # 18 tokens: 16 servable, the last block (2 tokens) never
    b = np.arange(500, 509, dtype=np.int32)  # commits 2 blocks, evicting a's last 2 (LRU, leaf first)

    def serve(p: np.ndarray, snapshot_blocks: int | None = None):
        kv = cache.probe(p)
        m = cache.match(p, max_blocks=snapshot_blocks)
        lr = live.request(p, "default", m.cached_tokens, kv_cached=None if snapshot_blocks is None else kv)
        live.committed(lr, p, cache.commit(m.handle))
        cache.release(m.handle)
        assert sum(lr.causes[:7]) == len(p) - m.cached_tokens
        return m.cached_tokens, lr.causes

    assert serve(a)[1][:7] == (16, 0, 0, 2, 0, 0, 0)  # cold
    cached, c = serve(a, snapshot_blocks=1)  # KV for 16 tokens, a snapshot after block 1 only
    assert cached == 4 and (c.no_state, c.evicted, c.partial_block, c.cold) == (12, 0, 2, 0)
    serve(b)
    assert cache.probe(a) == 8  # a's blocks 2 and 3 are gone
    cached, c = serve(a, snapshot_blocks=1)
    assert cached == 4 and (c.no_state, c.evicted, c.partial_block, c.cold) == (4, 8, 2, 0)
    with pytest.raises(ValueError, match="kv_cached"):
        live.request(a, "default", 8, kv_cached=4)
    with pytest.raises(ValueError, match="kv_cached"):
        live.request(a, "default", 4, kv_cached=20)  # beyond the 16 servable tokens


# ---- the counts add up on real workloads ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["mooncake_conversation_trace.jsonl.gz", "mooncake_synthetic_trace.jsonl.gz"])
def test_adds_up_on_mooncake(traces_dir, name):
    results = simulate(from_trace(load_trace(traces_dir / name)), [Capacity(1_000), Capacity(None)])
    for res in results:
        assert_adds_up(res.rows)
        t = res.totals()
        assert sum(t[f] for f in CAUSE_FIELDS.values()) == t["uncached_tokens"]
        assert t["diverged_tokens"] == t["partial_block_tokens"] == t["namespace_tokens"] == 0
    small, unlimited = (r.totals() for r in results)
    assert unlimited["evicted_tokens"] == unlimited["not_cached_tokens"] == 0
    assert small["evicted_tokens"] > 0 and small["cold_tokens"] == unlimited["cold_tokens"]


@pytest.mark.parametrize("path", sorted(p.name for p in SCENARIOS.glob("*.yaml") if "mooncake" not in p.name))
def test_adds_up_on_every_scenario(path):
    sc = load_scenario(SCENARIOS / path)
    reqs = from_scenario(sc, sc.block_size or 16)
    caps = [Capacity.from_tokens(c, reqs.block_size) for c in sc.capacity] or [Capacity(None)]
    for res in simulate(reqs, [Capacity(4), *caps]):
        assert_adds_up(res.rows)
        assert all(r.cold_tokens is not None for r in res.rows)
