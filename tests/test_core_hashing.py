"""Chained block hashes against DESIGN.md §3's formula, computed here with xxhash directly."""

from __future__ import annotations

import numpy as np
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


def test_seed_and_namespace_change_every_hash():
    tokens = list(range(8))
    a = reference_chain(tokens, 4, "default", 0)
    assert not set(a) & set(reference_chain(tokens, 4, "default", 1))
    assert not set(a) & set(reference_chain(tokens, 4, "other", 0))
    data = np.asarray(tokens, dtype=np.int32).tobytes()
    assert chain_hashes(xxh3_hasher(0), namespace_root("default", 0), data, 4, 0, 2) == a
