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


@pytest.mark.parametrize("near", [-1.0, -1e-9, float("nan"), float("inf")])
def test_near_must_be_finite_and_not_negative(near):
    with pytest.raises(ValueError, match="near"):
        RoutingConfig(near=near)


def test_a_short_prefix_settles_near_ties():
    """A short request goes, among the replicas within ``near`` of the least load, to the longest holder."""
    replicas = ["idle", "holder", "far"]
    matched = {"holder": 2, "far": 3}  # 3 of 20 blocks: below min_match 0.3, so "short"
    near = make_policy("prefix_balanced", RoutingConfig(min_match=0.3, near=10))
    assert near.choose(replicas, matched, {"holder": 8, "far": 10.5}, blocks=20) == Decision("holder", 2, "short")
    # "far" holds more but is 10.5 above the least: just outside near; at exactly 10 above it is inside
    assert near.choose(replicas, matched, {"holder": 20, "far": 10.5}, blocks=20) == Decision("idle", 0, "short")
    assert near.choose(replicas, matched, {"holder": 8, "far": 10}, blocks=20) == Decision("far", 3, "short")
    # holders of the same length: the least loaded of them, then in turn
    same = {"holder": 2, "far": 2}
    assert near.choose(replicas, same, {"holder": 7, "far": 3}, blocks=20) == Decision("far", 2, "short")
    assert [near.choose(replicas, same, {"idle": 9}, blocks=20).replica for _ in range(3)] == [
        "holder",
        "far",
        "holder",
    ]
    # near = 0 (the default): the least loaded, whatever the others hold, as before
    plain = make_policy("prefix_balanced", RoutingConfig(min_match=0.3))
    assert plain.choose(replicas, matched, {"holder": 8, "far": 10}, blocks=20) == Decision("idle", 0, "short")
    # a long enough prefix is followed whatever near says; a cold request still goes to the least loaded
    assert near.choose(replicas, {"far": 6}, {"far": 10}, blocks=20) == Decision("far", 6, "prefix")
    assert near.choose(replicas, {}, {"idle": 3, "holder": 1, "far": 2}, blocks=20) == Decision("holder", 0, "cold")


def test_the_guard_ignores_near():
    """Unbalanced loads route purely by load: near does not let a holder within near of the least win."""
    policy = make_policy("prefix_balanced", RoutingConfig(LoadGuard(2, 1.5), min_match=0.3, near=10))
    loads = {"idle": 0.0, "holder": 1.0, "busy": 100.0}
    d = policy.choose(["idle", "holder", "busy"], {"holder": 2}, loads, blocks=20)
    assert d == Decision("idle", 0, "load")


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.lists(st.integers(0, 3), min_size=3, max_size=3),
            st.lists(st.sampled_from([0.0, 1.0, 2.0, 5.0]), min_size=3, max_size=3),
            st.integers(1, 30),
        ),
        min_size=1,
        max_size=12,
    )
)
def test_near_zero_routes_cold_and_short_requests_exactly_as_least_loaded(steps):
    """With near = 0, prefix_balanced's cold and short requests take the very replicas (turns included) that
    least_loaded gives, as before near existed."""
    replicas = ["a", "b", "c"]
    balanced = make_policy("prefix_balanced", RoutingConfig(LoadGuard(1e9, 1.5), min_match=1.0))
    ll = make_policy("least_loaded")
    for matched_list, load_list, blocks in steps:
        matched = {r: m for r, m in zip(replicas, matched_list) if m}
        loads = dict(zip(replicas, load_list))
        blocks = max(blocks, max(matched_list) + 1)  # min_match 1.0: every request is cold or short
        d = balanced.choose(replicas, matched, loads, blocks=blocks)
        assert d.reason in ("cold", "short")
        assert d.replica == ll.choose(replicas, matched, loads, blocks=blocks).replica


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


def _reference(name, replicas, matched, loads, blocks, config):
    """Brute force of each policy's first decision (a fresh policy gives a tie to the first of the tied):
    (replica, reason)."""

    def least(pool):
        return min(pool, key=lambda r: loads[r])  # min() keeps the first of equals

    if name == "round_robin":
        return replicas[0], "round_robin"
    if name == "least_loaded":
        return least(replicas), "least_loaded"
    balanced = name == "prefix_balanced"
    if balanced and config.guard.unbalanced(loads.values()):
        return least(replicas), "load"
    best = max(matched.values())
    if best == 0:
        return least(replicas), "cold"
    if balanced and blocks is not None and best < config.min_match * blocks:
        if config.near == 0:
            return least(replicas), "short"
        near = [r for r in replicas if loads[r] <= min(loads.values()) + config.near]
        longest = max(matched[r] for r in near)
        return least([r for r in near if matched[r] == longest]), "short"
    return least([r for r in replicas if matched[r] == best]), "prefix"


@settings(max_examples=500, deadline=None)
@given(
    st.lists(st.integers(0, 6), min_size=1, max_size=5),
    # loads: any, or small whole numbers (balanced under the guard, exact ties, near ties)
    st.lists(st.one_of(st.floats(0, 200, allow_nan=False), st.integers(0, 40).map(float)), min_size=5, max_size=5),
    st.sampled_from(list(ROUTING_POLICIES)),
    st.one_of(st.none(), st.integers(1, 30)),
    st.sampled_from([0.0, 5.0, 30.0, 1000.0]),
)
def test_policy_properties(matched_list, load_list, name, blocks, near):
    replicas = [f"r{i}" for i in range(len(matched_list))]
    matched = dict(zip(replicas, matched_list))
    loads = dict(zip(replicas, load_list))
    guard = LoadGuard(20, 1.5)
    config = RoutingConfig(guard, min_match=0.3, near=near)
    d = make_policy(name, config).choose(replicas, matched, loads, blocks=blocks)
    assert d.replica in replicas and d.matched_blocks == matched[d.replica]
    assert (d.replica, d.reason) == _reference(name, replicas, matched, loads, blocks, config)
    if blocks is not None:
        return  # the properties below are for a request of unknown length (no "short")
    unbalanced = guard.unbalanced(loads.values())
    if name == "least_loaded" or (name == "prefix_balanced" and unbalanced):
        assert loads[d.replica] == min(loads.values())
    if name == "prefix" or (name == "prefix_balanced" and not unbalanced):
        best = max(matched.values())
        assert d.matched_blocks == best
        ties = [r for r in replicas if matched[r] == best]
        assert loads[d.replica] == min(loads[r] for r in ties)
        assert d.reason == ("prefix" if best else "cold")


@settings(max_examples=500, deadline=None)
@given(
    st.lists(st.integers(0, 4), min_size=1, max_size=5),
    st.lists(st.one_of(st.integers(0, 30).map(float), st.floats(0, 30, allow_nan=False)), min_size=5, max_size=5),
    st.one_of(st.none(), st.integers(1, 20)),
    st.sampled_from([0.0, 0.5, 3.0, 10.0, 100.0]),
)
def test_prefix_balanced_near_against_the_brute_force(matched_list, load_list, blocks, near):
    """The same reference, on loads close enough that the guard seldom fires and near ties are common."""
    replicas = [f"r{i}" for i in range(len(matched_list))]
    matched = dict(zip(replicas, matched_list))
    loads = dict(zip(replicas, load_list))
    config = RoutingConfig(LoadGuard(20, 1.5), min_match=0.3, near=near)
    d = make_policy("prefix_balanced", config).choose(replicas, matched, loads, blocks=blocks)
    assert d.matched_blocks == matched[d.replica]
    assert (d.replica, d.reason) == _reference("prefix_balanced", replicas, matched, loads, blocks, config)


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
