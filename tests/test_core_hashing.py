"""Chained block hashes against DESIGN.md §3's formula, computed here with xxhash directly."""

from __future__ import annotations

import xxhash

from prefixcache import CacheConfig, PrefixCache
from prefixcache.core.hashing import as_token_array, chain_hashes, namespace_root, xxh3_hasher


def reference_chain(tokens: list[int], bs: int, namespace: str, seed: int) -> list[bytes]:
    """h_i = xxh3_128(h_{i-1} || block i as little-endian int32, seed); h_-1 from the namespace."""
    h = xxhash.xxh3_128_digest(b"prefixcache-namespace\x00" + namespace.encode(), seed)
    out = []
    for i in range(len(tokens) // bs):
        block = b"".join(int(t).to_bytes(4, "little") for t in tokens[i * bs : (i + 1) * bs])
        h = xxhash.xxh3_128_digest(h + block, seed)
        out.append(h)
    return out


def test_chain_matches_the_formula_and_the_tree_keys():
    tokens = [5, 70000, 3, 2**31 - 1, 0, 9, 8, 7, 6]
    seed = 1234
    expected = reference_chain(tokens, 2, "tenant", seed)
    data = as_token_array(tokens).tobytes()
    root = namespace_root("tenant", seed)
    assert chain_hashes(xxh3_hasher(seed), root, data, 2, 0, 4) == expected
    # A custom hasher goes through the generic loop and gets the same answer.
    assert chain_hashes(lambda p, b: xxhash.xxh3_128_digest(p + b, seed), root, data, 2, 0, 4) == expected
    assert chain_hashes(xxh3_hasher(seed), expected[1], data, 2, 2, 4) == expected[2:]
    cache = PrefixCache(CacheConfig(num_blocks=8, block_size=2, hash_seed=seed))
    m = cache.match(tokens, namespace="tenant")
    cache.commit(m.handle)
    cache.release(m.handle)
    (node,) = list(cache.tree.nodes())
    assert node.keys == expected


def committed_keys(tokens: list[int], bs: int, namespace: str, seed: int) -> list[bytes]:
    """The keys a fresh cache stores for ``tokens`` committed in ``namespace`` (its one tree node)."""
    cache = PrefixCache(CacheConfig(num_blocks=8, block_size=bs, hash_seed=seed))
    with cache.lookup(tokens, namespace) as m:
        cache.commit(m.handle)
    (node,) = list(cache.tree.nodes())
    return node.keys


def test_seed_and_namespace_change_every_hash():
    tokens = list(range(9))  # two full blocks of 4
    base = committed_keys(tokens, 4, "default", 0)
    for namespace, seed in (("default", 0), ("default", 1), ("other", 0), ("tenant", 2**64 - 1)):
        keys = committed_keys(tokens, 4, namespace, seed)
        assert keys == reference_chain(tokens, 4, namespace, seed)  # the cache's keys follow the formula
        assert keys == committed_keys(tokens, 4, namespace, seed)  # the same seed and namespace: the same keys
        if (namespace, seed) != ("default", 0):
            assert not set(keys) & set(base)  # another seed or namespace: no key in common
    # behaviour: the same tokens in another namespace of one cache never hit; in the same namespace they do
    cache = PrefixCache(CacheConfig(num_blocks=8, block_size=4, hash_seed=7))
    with cache.lookup(tokens, "a") as m:
        cache.commit(m.handle)
    assert cache.probe(tokens, "a") == 8 and cache.probe(tokens, "b") == 0 and cache.probe(tokens) == 0
