"""Model-free replay: published figures, a brute-force LRU reference, token scenarios, warm-up, interrupts."""

from __future__ import annotations

import gc
import json
import random
from pathlib import Path

import pytest

from prefixcache import CacheConfig, PrefixCache
from prefixcache.sim.policy import Capacity, ReplayPolicy
from prefixcache.sim.replay import replay, simulate
from prefixcache.sim.requests import from_scenario, from_trace
from prefixcache.workload.render import ByteRenderer, Conversations, synthetic_reply
from prefixcache.workload.scenario import load_scenario
from prefixcache.workload.trace import load_trace

DATA = Path(__file__).parent / "data"
SCENARIOS = Path(__file__).resolve().parents[1] / "scenarios"


# ---- DESIGN.md §7: LRU, file order, no warm-up, block-weighted ---------------------------------------------
@pytest.mark.parametrize(
    "name, blocks, expected",
    [
        ("mooncake_conversation_trace.jsonl.gz", 1_000, 0.0445),
        ("mooncake_conversation_trace.jsonl.gz", 10_000, 0.2116),
        ("mooncake_conversation_trace.jsonl.gz", None, 0.3664),
        ("mooncake_synthetic_trace.jsonl.gz", None, 0.6396),
        ("mooncake_synthetic_trace.jsonl.gz", 10_000, 0.4239),
    ],
)
def test_published_block_hit_rates(traces_dir, name, blocks, expected):
    trace = load_trace(traces_dir / name)
    r = replay(from_trace(trace), Capacity(blocks))
    assert round(r.totals()["block_hit_rate"], 4) == expected
    if blocks is None:
        assert r.totals()["evicted_blocks"] == 0


def simulate_trace(trace, blocks, warmup=0.0, on_row=None):
    """One replay of a trace through the shared loop at ``blocks`` blocks."""
    return replay(from_trace(trace), Capacity(blocks), ReplayPolicy(warmup=warmup), on_row=on_row)


# ---- an independent brute-force LRU over hash ids -------------------------------------------------------
def brute_force_lru(requests: list[list[int]], capacity: int) -> list[int]:
    """Hit blocks per request: leading cached ids; then the missing ids are inserted, evicting unpinned leaves
    least recently used first (a request touches its whole path at once; among its blocks the deepest goes
    first). Scans everything on every eviction: slow and obviously right."""
    parent: dict[int, int | None] = {}
    children: dict[int, int] = {}
    last: dict[int, tuple[int, int]] = {}  # id -> (time, -depth)
    hits = []
    for t, ids in enumerate(requests):
        h = 0
        while h < len(ids) and ids[h] in parent:
            h += 1
        hits.append(h)
        pinned = set(ids[:h])
        for d, b in enumerate(ids[:h]):
            last[b] = (t, -d)
        for d in range(h, len(ids)):
            if len(parent) >= capacity:
                leaves = [b for b in parent if children.get(b, 0) == 0 and b not in pinned]
                if not leaves:
                    break
                victim = min(leaves, key=lambda b: last[b])
                p = parent.pop(victim)
                del last[victim]
                if p is not None:
                    children[p] -= 1
            b = ids[d]
            p = ids[d - 1] if d else None
            parent[b] = p
            if p is not None:
                children[p] = children.get(p, 0) + 1
            last[b] = (t, -d)
            pinned.add(b)
    return hits


@pytest.mark.parametrize("capacity", [40, 300, 1200])
def test_trace_replay_equals_brute_force(capacity):
    # lines 3601-3800 of the Mooncake synthetic trace: 8,662 block references, 44% reusable
    trace = load_trace(DATA / "mooncake_synthetic_3601_3800.jsonl")
    reqs = [list(r.hash_ids) for r in trace]
    expected = brute_force_lru(reqs, capacity)
    assert sum(expected) > 50  # the window really reuses blocks
    got = simulate_trace(trace, capacity)
    assert [row.hit_blocks for row in got.rows] == expected
    assert all(row.cached_tokens == min(h * 512, row.prompt_tokens) for row, h in zip(got.rows, expected))
    assert max(row.pool_used_blocks for row in got.rows) <= capacity


def random_prefix_trace(seed: int, n: int = 120) -> list[list[int]]:
    """Requests that extend a random prefix of an earlier request with fresh ids (heavy sharing)."""
    rng = random.Random(seed)
    reqs: list[list[int]] = []
    fresh = iter(range(10**6))
    for _ in range(n):
        base = rng.choice(reqs)[: rng.randint(0, 12)] if reqs and rng.random() < 0.8 else []
        reqs.append(base + [next(fresh) for _ in range(rng.randint(0 if base else 1, 6))])
    return reqs


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("capacity", [3, 8, 25])
def test_random_trace_replay_equals_brute_force(tmp_path, seed, capacity):
    reqs = random_prefix_trace(seed)
    p = tmp_path / "r.jsonl"
    p.write_text(
        "".join(
            json.dumps({"timestamp": i, "input_length": 16 * len(ids), "hash_ids": ids}) + "\n"
            for i, ids in enumerate(reqs)
        )
    )
    got = simulate_trace(load_trace(p, block_size=16), capacity)
    assert [row.hit_blocks for row in got.rows] == brute_force_lru(reqs, capacity)


# ---- token scenarios: unlimited capacity = longest common prefix with anything served before --------------
def lcp_reference(scenario, block_size: int) -> list[int]:
    """Cached tokens per request with unlimited capacity: the longest block-aligned common prefix with an
    earlier request's prompt + synthesised reply (less its last token), same namespace; >= 1 token computed."""
    conv, r = Conversations(), ByteRenderer()
    seen: list[tuple[str, list[int]]] = []
    out = []
    for i, req in enumerate(scenario.requests):
        prompt = conv.prompt(req, r)
        k = req.max_new_tokens or scenario.max_new_tokens
        best = 0
        for ns, seq in seen:
            if ns != req.namespace:
                continue
            n = 0
            while n < min(len(seq), len(prompt)) and seq[n] == prompt[n]:
                n += 1
            best = max(best, n)
        best = min(best // block_size, (len(prompt) - 1) // block_size) * block_size
        out.append(best)
        reply = synthetic_reply(scenario.seed, i, k)
        full = prompt + list(reply.encode("ascii"))[:-1]
        seen.append((req.namespace, full[: len(full) // block_size * block_size]))
        conv.add_reply(req, reply)
    return out


@pytest.mark.parametrize(
    "name", ["handwritten", "chat", "agent", "rag", "few_shot", "parallel_samples", "shared_prompt"]
)
def test_scenario_unlimited_equals_lcp_reference(name):
    sc = load_scenario(SCENARIOS / f"{name}.yaml")
    bs = sc.block_size
    got = replay(from_scenario(sc, bs), Capacity(None))
    assert [row.cached_tokens for row in got.rows] == lcp_reference(sc, bs)
    assert got.totals()["evicted_blocks"] == 0


def test_small_pool_never_beats_unlimited_and_evicts():
    sc = load_scenario(SCENARIOS / "rag.yaml")
    small, big = simulate(from_scenario(sc, 16), [Capacity(20), Capacity(None)])
    assert small.totals()["cached_tokens"] < big.totals()["cached_tokens"]
    assert small.totals()["evicted_blocks"] > 0
    assert small.totals()["peak_pool_blocks"] <= 20


# ---- warm-up and totals -----------------------------------------------------------------------------------
def test_warmup_excludes_first_requests():
    trace = load_trace(DATA / "mooncake_conversation_head200.jsonl")
    full = simulate_trace(trace, 100)
    warm = simulate_trace(trace, 100, warmup=0.25)
    assert [r.hit_blocks for r in warm.rows] == [r.hit_blocks for r in full.rows]  # same replay
    t = warm.totals()
    later = full.rows[50:]
    assert t["requests"] == 150
    assert t["hit_blocks"] == sum(r.hit_blocks for r in later)
    assert t["blocks"] == sum(r.blocks for r in later)
    assert t["token_hit_rate"] == sum(r.cached_tokens for r in later) / sum(r.prompt_tokens for r in later)
    with pytest.raises(ValueError, match="warmup"):
        simulate_trace(trace, 100, warmup=1.0)


def _write_lines(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(d) + "\n" for d in lines))
    return path


def test_namespaces_never_share(tmp_path):
    # three kv-tester sessions sending the SAME hash ids, interleaved: ids are only comparable within a session
    ids = [0, 1, 2, 3]
    lines = [
        {"timestamp": t, "session": s, "input_length": 256, "block_size": 64, "hash_ids": ids}
        for t, s in enumerate([0, 1, 2, 0, 1, 2, 1])
    ]
    r = simulate_trace(load_trace(_write_lines(tmp_path / "kv.jsonl", lines)), 100)
    # by hand: each session's first request misses although another session sent the same ids before it
    assert [row.hit_blocks for row in r.rows] == [0, 0, 0, 4, 4, 4, 4]
    assert r.totals()["peak_pool_blocks"] == 12  # three separate copies of the 4 blocks
    # the same lines in one session: everything after the first request hits
    one = [dict(d, session=0) for d in lines]
    r = simulate_trace(load_trace(_write_lines(tmp_path / "one.jsonl", one)), 100)
    assert [row.hit_blocks for row in r.rows] == [0, 4, 4, 4, 4, 4, 4]


# ---- token and block hit rates, by hand ---------------------------------------------------------------------
def test_token_and_block_hit_rates_by_hand(tmp_path):
    """A 3-request trace (blocks of 16) where the two rates differ; every figure worked out by hand."""
    lines = [
        {"timestamp": 0, "input_length": 40, "hash_ids": [1, 2, 3]},  # miss: 0 of 3 blocks, 0 of 40 tokens
        {"timestamp": 1, "input_length": 50, "hash_ids": [1, 2, 4, 5]},  # [1, 2] hit: 2 of 4 blocks, 32 of 50
        {"timestamp": 2, "input_length": 33, "hash_ids": [1, 2, 3]},  # all 3 hit: 3 of 3, min(48, 33) = 33 of 33
    ]
    block_rate, token_rate = (0 + 2 + 3) / (3 + 4 + 3), (0 + 32 + 33) / (40 + 50 + 33)
    assert block_rate == 0.5 and round(token_rate, 4) == 0.5285
    trace = load_trace(_write_lines(tmp_path / "t.jsonl", lines), block_size=16)
    t = simulate_trace(trace, 100).totals()
    assert (t["hit_blocks"], t["blocks"], t["cached_tokens"], t["prompt_tokens"]) == (5, 10, 65, 123)
    assert t["block_hit_rate"] == block_rate and t["token_hit_rate"] == pytest.approx(token_rate)
    # the core's own counters, driven by the same keys
    cache = PrefixCache(CacheConfig(num_blocks=100, block_size=16))
    for d in lines:
        m = cache.match_keys(d["hash_ids"], num_tokens=d["input_length"])
        cache.commit_keys(m.handle)
        cache.release(m.handle)
    assert cache.stats.block_hit_rate == block_rate and cache.stats.token_hit_rate == pytest.approx(token_rate)
    # and on tokens (blocks of 4): 10 tokens miss; then its first 9 + 3 more: 2 of ceil(12 / 4) = 3 blocks hit
    cache = PrefixCache(CacheConfig(num_blocks=100, block_size=4))
    first = list(range(10, 20))
    for prompt in (first, first[:9] + [7, 8, 9]):
        with cache.lookup(prompt) as m:
            cache.commit(m.handle)
    assert cache.stats.as_dict()["token_hit_rate"] == pytest.approx(8 / 22)
    assert cache.stats.as_dict()["block_hit_rate"] == pytest.approx(2 / 6)


# ---- Ctrl-C keeps a usable partial run --------------------------------------------------------------------
def test_interrupt_returns_partial_rows_and_releases_pins():
    trace = load_trace(DATA / "mooncake_conversation_head200.jsonl")
    seen = []

    def on_row(row, cache):
        seen.append((cache.num_active_requests, cache.num_cached_blocks))
        cache.check_integrity()
        if row.index == 9:
            raise KeyboardInterrupt

    r = simulate_trace(trace, 50, on_row=on_row)
    assert r.partial and len(r.rows) == 10
    assert seen[-1][0] == 0 and seen[-1][1] == r.rows[-1].pool_used_blocks  # served, pins let go
    results = simulate(
        from_scenario(load_scenario(SCENARIOS / "chat.yaml"), 16),
        [Capacity(10), Capacity(100)],
        on_row=lambda row, c: (_ for _ in ()).throw(KeyboardInterrupt) if row.index == 3 else None,
    )
    assert len(results) == 1 and results[0].partial and len(results[0].rows) == 4


def test_a_finished_replay_leaves_no_garbage_for_the_collector():
    """A replay's cache goes when the replay ends (freed by reference counts), not at a later collector pass:
    the tree's parent/child links and the cache's clock would otherwise be cycles."""
    reqs = from_scenario(load_scenario(SCENARIOS / "rag.yaml"), 16)
    trace = from_trace(load_trace(DATA / "mooncake_conversation_head200.jsonl"))
    gc.collect()
    gc.disable()
    try:
        results = [replay(reqs, Capacity(20)), replay(trace, Capacity(50)), replay(trace, Capacity(None))]
        assert gc.collect() == 0
    finally:
        gc.enable()
    assert all(r.totals()["cached_tokens"] > 0 for r in results)
