"""The cluster index and routing policies (prefixcache.sim.routing), model-free.

The index is built only from each replica's cache events; the reference is each replica's own PrefixCache
(``probe`` in tokens mode, a pinning ``match_keys`` in keys mode), replayed with tiny pools so that evictions
are frequent. Policies are checked against hand-computed choices and properties.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.core import CacheConfig, PrefixCache
from prefixcache.core.events import BlocksRemoved, BlocksStored, CacheCleared
from prefixcache.core.hashing import block_keys
from prefixcache.sim.routing import (
    ROUTING_POLICIES,
    ClusterIndex,
    Decision,
    IndexSyncError,
    LoadGuard,
    PrefixAffinity,
    RoutingConfig,
    make_policy,
    prompt_keys,
)

BS = 4


def _replicas(n: int, num_blocks: int, index: ClusterIndex) -> list[PrefixCache]:
    caches = []
    for r in range(n):
        cache = PrefixCache(CacheConfig(num_blocks=num_blocks, block_size=BS))
        cache.subscribe(lambda e, r=r: index.apply(r, e))
        caches.append(cache)
    return caches


def _serve(cache: PrefixCache, tokens: list[int], extra: list[int], namespace: str) -> None:
    m = cache.match(tokens, namespace)
    cache.commit(m.handle, tokens + extra)
    cache.release(m.handle)


def _expected(caches: list[PrefixCache], tokens: list[int], namespace: str) -> dict[int, int]:
    """Brute force: each replica's own cache says how many leading blocks it would serve."""
    return {r: n for r, c in enumerate(caches) if (n := c.probe(tokens, namespace) // BS) > 0}


# prompts over a tiny alphabet share prefixes often; namespaces split them
_prompt = st.lists(st.integers(0, 2), min_size=1, max_size=24)
_step = st.tuples(st.integers(0, 2), _prompt, st.lists(st.integers(0, 2), max_size=6), st.sampled_from(["a", "b"]))


@settings(max_examples=150, deadline=None)
@given(st.lists(_step, min_size=1, max_size=40), st.integers(2, 12))
def test_index_equals_every_replicas_own_cache_tokens_mode(steps, num_blocks):
    index = ClusterIndex()
    caches = _replicas(3, num_blocks, index)
    seen: list[tuple[list[int], str]] = []
    for replica, prompt, extra, ns in steps:
        _serve(caches[replica], prompt, extra, ns)
        seen.append((prompt + extra, ns))
        for tokens, space in seen[-6:] + [(prompt, "a" if ns == "b" else "b")]:
            keys = prompt_keys(tokens, space, block_size=BS)
            assert index.match(keys, space) == _expected(caches, tokens, space)
    for r, c in enumerate(caches):
        assert index.num_blocks(r) == c.num_cached_blocks
        c.check_integrity()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1), st.lists(st.integers(0, 3), min_size=1, max_size=10)), max_size=30))
def test_index_equals_every_replicas_own_cache_keys_mode(steps):
    """Mooncake-style requests: precomputed chained block ids (here: prefix tuples stand for hash_ids)."""
    index = ClusterIndex()
    caches = [PrefixCache(CacheConfig(num_blocks=6, block_size=BS)) for _ in range(2)]
    for r, c in enumerate(caches):
        c.subscribe(lambda e, r=r: index.apply(r, e))
    for replica, path in steps:
        keys = [tuple(path[: i + 1]) for i in range(len(path))]  # chained: a key names its whole prefix
        m = caches[replica].match_keys(keys, "ns")
        caches[replica].commit_keys(m.handle)
        caches[replica].release(m.handle)
        got = index.match(keys, "ns", mode="keys")
        want = {}
        for r, c in enumerate(caches):  # the reference: what each cache's match_keys serves (then let go)
            probe = c.match_keys(keys, "ns")
            c.release(probe.handle)
            if probe.cached_blocks:
                want[r] = probe.cached_blocks
        assert got == want


def test_events_by_hand_store_remove_clear_and_forget():
    index = ClusterIndex()
    store = lambda parent, keys: BlocksStored("ns", "keys", parent, tuple(keys), None)  # noqa: E731
    index.apply("r0", store(None, ["a", "ab", "abc"]))
    index.apply("r1", store(None, ["a"]))
    index.apply("r1", store("a", ["ax"]))
    assert index.match(["a", "ab", "abc", "abcd"], "ns", "keys") == {"r0": 3, "r1": 1}
    assert index.match(["a", "ax"], "ns", "keys") == {"r0": 1, "r1": 2}
    assert index.match(["a", "ab"], "other", "keys") == {}  # another namespace
    assert index.match(["a", "ab"], "ns", "tokens") == {}  # another mode
    assert index.holders("a", "ns", "keys") == {"r0", "r1"}
    index.apply("r0", BlocksRemoved("ns", "keys", ("ab", "abc")))
    assert index.match(["a", "ab", "abc"], "ns", "keys") == {"r0": 1, "r1": 1}
    assert index.num_blocks("r0") == 1 and index.num_blocks("r1") == 2
    index.apply("r1", CacheCleared())
    assert index.match(["a", "ax"], "ns", "keys") == {"r0": 1}
    index.forget("r0")
    assert index.match(["a"], "ns", "keys") == {} and index.replicas == ("r1",)
    index.apply("r2", store(None, ["a"]))  # a new replica takes the freed slot
    assert index.match(["a"], "ns", "keys") == {"r2": 1}


def test_contradicting_events_raise_and_change_nothing():
    index = ClusterIndex()
    index.apply("r", BlocksStored("ns", "keys", None, ("a", "ab"), None))
    bad = [
        BlocksStored("ns", "keys", "zz", ("zzq",), None),  # under a parent it does not hold
        BlocksStored("ns", "keys", "a", ("ab",), None),  # a block it holds already
        BlocksRemoved("ns", "keys", ("ab", "nope")),  # a block it does not hold
    ]
    for event in bad:
        with pytest.raises(IndexSyncError):
            index.apply("r", event)
        assert index.match(["a", "ab"], "ns", "keys") == {"r": 2} and index.num_blocks("r") == 2
    index.discard("r", "keys", "ns", ["ab", "nope"])  # the lenient removal drops what is held
    assert index.match(["a", "ab"], "ns", "keys") == {"r": 1}
    with pytest.raises(TypeError):
        index.apply("r", "not an event")  # type: ignore[arg-type]


def test_prompt_keys_are_the_caches_keys_and_leave_one_token():
    cache = PrefixCache(CacheConfig(num_blocks=64, block_size=BS))
    events = []
    cache.subscribe(events.append)
    tokens = list(range(3, 3 + 4 * BS))
    _serve(cache, tokens, [], "t")
    stored = [k for e in events for k in e.keys]
    assert stored == block_keys(tokens, "t", block_size=BS)
    assert prompt_keys(tokens, "t", block_size=BS) == stored[:3]  # 16 tokens: 3 blocks can hit, one token is left
    assert prompt_keys(tokens[:1], "t", block_size=BS) == []


# ---- policies ------------------------------------------------------------------------------------------------
def test_registry_names_the_four_policies():
    assert set(ROUTING_POLICIES) == {"round_robin", "least_loaded", "prefix", "prefix_balanced"}
    for name in ROUTING_POLICIES:
        assert make_policy(name).choose(["x"], {}, {}).replica == "x"
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("random")
    with pytest.raises(ValueError, match="no replica"):
        make_policy("prefix").choose([], {}, {})


def test_round_robin_and_least_loaded():
    rr = make_policy("round_robin")
    assert [rr.choose(["a", "b", "c"], {"c": 9}, {"a": 5}).replica for _ in range(4)] == ["a", "b", "c", "a"]
    ll = make_policy("least_loaded")
    assert ll.choose(["a", "b", "c"], {}, {"a": 3, "b": 1, "c": 2}) == Decision("b", 0, "least_loaded")
    # ties take turns; a missing load counts as 0
    assert [ll.choose(["a", "b", "c"], {}, {"b": 4}).replica for _ in range(4)] == ["a", "c", "a", "c"]


def test_prefix_prefers_the_longest_held_prefix_then_load():
    p = make_policy("prefix")
    assert p.choose(["a", "b", "c"], {"a": 2, "b": 5}, {"b": 1000}) == Decision("b", 5, "prefix")
    assert p.choose(["a", "b", "c"], {"a": 5, "b": 5}, {"a": 3, "b": 1}) == Decision("b", 5, "prefix")
    assert p.choose(["a", "b", "c"], {"x": 9}, {"a": 2, "b": 1, "c": 2}) == Decision("b", 0, "cold")


@pytest.mark.parametrize(
    ("loads", "guard", "unbalanced"),
    [
        ((100, 30), LoadGuard(), True),  # 70 > 64 and 100 > 45
        ((100, 70), LoadGuard(), False),  # 30 is not > 64
        ((200, 140), LoadGuard(), False),  # 60 is not > 64
        ((65, 0), LoadGuard(), True),
        ((64, 0), LoadGuard(), False),  # the absolute threshold is strict
        ((300, 200), LoadGuard(), False),  # 100 > 64 but 300 is not > 1.5 * 200
        ((301, 200), LoadGuard(), True),
        ((5, 2), LoadGuard(2, 2.0), True),
        ((4, 2), LoadGuard(2, 2.0), False),
    ],
)
def test_load_guard_thresholds(loads, guard, unbalanced):
    assert guard.unbalanced(loads) is unbalanced
    policy = PrefixAffinity(guard)
    d = policy.choose(["hot", "cold"], {"hot": 8}, dict(zip(["hot", "cold"], loads)))
    assert d == (Decision("cold", 0, "load") if unbalanced else Decision("hot", 8, "prefix"))


def test_load_guard_rejects_bad_thresholds():
    with pytest.raises(ValueError):
        LoadGuard(-1, 1.5)
    with pytest.raises(ValueError):
        LoadGuard(64, 0.5)
    with pytest.raises(ValueError):
        RoutingConfig(min_match=1.5)


def test_a_short_held_prefix_does_not_bind_the_request():
    """prefix_balanced follows a held prefix only when it covers min_match of the request; prefix always does."""
    balanced = make_policy("prefix_balanced", RoutingConfig(min_match=0.3))
    loads = {"holder": 2.0, "idle": 0.0}
    assert balanced.choose(["holder", "idle"], {"holder": 2}, loads, blocks=10) == Decision("idle", 0, "short")
    assert balanced.choose(["holder", "idle"], {"holder": 3}, loads, blocks=10) == Decision("holder", 3, "prefix")
    assert balanced.choose(["holder", "idle"], {"holder": 2}, loads) == Decision(
        "holder", 2, "prefix"
    )  # unknown length
    pure = make_policy("prefix")
    assert pure.choose(["holder", "idle"], {"holder": 1}, loads, blocks=40) == Decision("holder", 1, "prefix")


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 6), min_size=1, max_size=5),
    st.lists(st.floats(0, 200, allow_nan=False), min_size=5, max_size=5),
    st.sampled_from(list(ROUTING_POLICIES)),
)
def test_policy_properties(matched_list, load_list, name):
    replicas = [f"r{i}" for i in range(len(matched_list))]
    matched = dict(zip(replicas, matched_list))
    loads = dict(zip(replicas, load_list))
    guard = LoadGuard(20, 1.5)
    d = make_policy(name, RoutingConfig(guard, min_match=0.3)).choose(replicas, matched, loads)  # length unknown
    assert d.replica in replicas and d.matched_blocks == matched[d.replica]
    unbalanced = guard.unbalanced(loads.values())
    if name == "least_loaded" or (name == "prefix_balanced" and unbalanced):
        assert loads[d.replica] == min(loads.values())
    if name == "prefix" or (name == "prefix_balanced" and not unbalanced):
        best = max(matched.values())
        assert d.matched_blocks == best
        ties = [r for r in replicas if matched[r] == best]
        assert loads[d.replica] == min(loads[r] for r in ties)
        assert d.reason == ("prefix" if best else "cold")


def test_the_simulator_path_routes_a_trace_by_prefix():
    """The way a cluster replay drives it: keys per request, loads as numbers, each replica a PrefixCache."""
    index = ClusterIndex()
    caches = [PrefixCache(CacheConfig(num_blocks=50, block_size=BS)) for _ in range(2)]
    for r, c in enumerate(caches):
        c.subscribe(lambda e, r=r: index.apply(r, e))
    policy = make_policy("prefix_balanced")
    rng = random.Random(0)
    convs = [[rng.randrange(1000) for _ in range(3)] for _ in range(6)]
    placed: dict[int, set[int]] = {}
    for _turn in range(4):
        for c, conv in enumerate(convs):
            conv.append(rng.randrange(1000))
            keys = [hash(tuple(conv[: i + 1])) for i in range(len(conv))]
            d = policy.choose([0, 1], index.match(keys, "trace", "keys"), {0: 0.0, 1: 0.0})
            placed.setdefault(c, set()).add(int(d.replica))
            m = caches[int(d.replica)].match_keys(keys, "trace")
            assert m.cached_blocks == d.matched_blocks  # the index predicted the hit exactly
            caches[int(d.replica)].commit_keys(m.handle)
            caches[int(d.replica)].release(m.handle)
    assert all(len(where) == 1 for where in placed.values())  # every conversation stayed on one replica
    assert {next(iter(w)) for w in placed.values()} == {0, 1}  # and cold starts spread them
