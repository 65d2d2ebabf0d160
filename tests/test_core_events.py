"""Cache events: BlocksStored / BlocksRemoved / CacheCleared against the cache's own contents and block_keys.

A router mirrors a cache by replaying its events into a dict; after any sequence of matches, commits
(with evictions), releases and resets, the mirror must hold exactly the blocks the cache holds, keyed as
``block_keys`` computes them from token ids (tokens mode) or by the caller's keys (keys mode).
"""

from __future__ import annotations

import random

import pytest
import xxhash

import prefixcache.core.hashing as hashing
from prefixcache.core import (
    BlocksRemoved,
    BlocksStored,
    CacheCleared,
    CacheConfig,
    PrefixCache,
    block_keys,
)


class Mirror:
    """What a router learns from events: the cached keys per (namespace, mode), with each key's parent."""

    def __init__(self) -> None:
        self.blocks: dict[tuple[str, str, object], object] = {}  # (namespace, mode, key) -> parent key
        self.events: list[object] = []

    def __call__(self, event: object) -> None:
        self.events.append(event)
        if isinstance(event, BlocksStored):
            parent = event.parent
            if parent is not None:
                assert (event.namespace, event.mode, parent) in self.blocks, "stored under an unknown parent"
            for key in event.keys:
                assert (event.namespace, event.mode, key) not in self.blocks, "stored twice"
                self.blocks[(event.namespace, event.mode, key)] = parent
                parent = key
        elif isinstance(event, BlocksRemoved):
            for key in event.keys:
                del self.blocks[(event.namespace, event.mode, key)]
        else:
            assert isinstance(event, CacheCleared)
            self.blocks.clear()


def contents(cache: PrefixCache) -> set[tuple[str, str, object]]:
    """Every cached block as (namespace, mode, key), read from the tree."""
    out = set()
    for (mode, namespace), root in cache.tree.roots.items():
        stack = list(root.children.values())
        while stack:
            node = stack.pop()
            out.update((namespace, mode, k) for k in node.keys)
            stack.extend(node.children.values())
    return out


def test_stored_keys_are_block_keys_of_the_committed_tokens():
    cache = PrefixCache(CacheConfig(num_blocks=16, block_size=2, hash_seed=5))
    mirror = Mirror()
    cache.subscribe(mirror)
    seq = [1, 2, 3, 4, 5, 6, 7]
    m = cache.match(seq[:5], namespace="t")
    cache.commit(m.handle, seq)
    cache.release(m.handle)
    expected = block_keys(seq, "t", block_size=2, hash_seed=5)
    assert mirror.events == [BlocksStored("t", "tokens", None, tuple(expected), (1, 2, 3, 4, 5, 6))]
    # A longer sequence stores only its new blocks, under the last cached one.
    longer = seq + [8, 9, 10]
    m = cache.match(longer, namespace="t")
    r = cache.commit(m.handle)
    cache.release(m.handle)
    keys = block_keys(longer, "t", block_size=2, hash_seed=5)
    assert r.first_block == 3 and keys[:3] == expected
    assert mirror.events[-1] == BlocksStored("t", "tokens", keys[2], tuple(keys[3:]), (7, 8, 9, 10))
    assert block_keys(longer, "t", block_size=2, hash_seed=5, max_blocks=2) == keys[:2]
    assert block_keys(longer, "u", block_size=2, hash_seed=5)[0] != keys[0]
    assert contents(cache) == set(mirror.blocks)


def test_block_keys_follow_the_chained_formula():
    tokens = [5, 70000, 3, 2**31 - 1, 0]
    h = xxhash.xxh3_128_digest(b"prefixcache-namespace\x00" + b"ns", 9)
    expected = []
    for i in range(2):
        block = b"".join(int(t).to_bytes(4, "little") for t in tokens[i * 2 : i * 2 + 2])
        h = xxhash.xxh3_128_digest(h + block, 9)
        expected.append(h)
    assert block_keys(tokens, "ns", block_size=2, hash_seed=9) == expected
    with pytest.raises(TypeError, match="namespace must be a str"):
        block_keys(tokens, 3, block_size=2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="block_size must be an int"):
        block_keys(tokens, "ns", block_size=True)


def test_keys_mode_events_carry_the_callers_keys():
    cache = PrefixCache(CacheConfig(num_blocks=3, block_size=4))
    mirror = Mirror()
    cache.subscribe(mirror)
    for keys in (["a", "b"], ["a", "c"], ["d"]):
        m = cache.match_keys(keys)
        cache.commit_keys(m.handle)
        cache.release(m.handle)
    assert mirror.events == [
        BlocksStored("default", "keys", None, ("a", "b"), None),
        BlocksStored("default", "keys", "a", ("c",), None),
        BlocksRemoved("default", "keys", ("b",)),  # the least recently used leaf
        BlocksStored("default", "keys", None, ("d",), None),
    ]
    assert contents(cache) == set(mirror.blocks)


def test_events_arrive_after_the_change_and_unsubscribe_stops_them():
    cache = PrefixCache(CacheConfig(num_blocks=2, block_size=1))
    seen = []

    def listener(event):
        cache.check_integrity()  # the cache is consistent when a listener runs
        seen.append((type(event).__name__, cache.num_cached_blocks))

    stop = cache.subscribe(listener)
    mirror = Mirror()
    cache.subscribe(mirror)
    with cache.lookup([1, 2, 3]) as m:
        cache.commit(m.handle)
    with cache.lookup([4, 5]) as m:
        cache.commit(m.handle)  # evicts (1,2) then stores (4,5): removal reported first
    assert seen == [("BlocksStored", 2), ("BlocksRemoved", 2), ("BlocksStored", 2)]
    cache.reset()
    assert seen[-1] == ("CacheCleared", 0) and mirror.blocks == {}
    stop()
    stop()  # idempotent
    with cache.lookup([6, 7]) as m:
        cache.commit(m.handle)
    assert len(seen) == 4 and len(mirror.events) == 5
    with pytest.raises(TypeError, match="listener must be callable"):
        cache.subscribe("not a function")  # type: ignore[arg-type]


def test_without_a_listener_nothing_is_hashed(monkeypatch):
    calls = [0]
    real = xxhash.xxh3_128_digest

    def counting(data, seed=0):
        calls[0] += 1
        return real(data, seed)

    monkeypatch.setattr(hashing.xxhash, "xxh3_128_digest", counting)
    cache = PrefixCache(CacheConfig(num_blocks=6, block_size=1))
    rng = random.Random(0)
    for _ in range(200):  # hits, misses, splits, evictions, several namespaces
        prompt = [rng.randrange(3) for _ in range(rng.randrange(1, 9))]
        m = cache.match(prompt, namespace=str(rng.randrange(3)))
        cache.commit(m.handle, prompt + [rng.randrange(3)])
        cache.release(m.handle)
        cache.probe(prompt)
        cache.divergence(prompt)
    assert cache.stats.blocks_evicted > 0 and cache.stats.hit_blocks > 0
    assert calls[0] == 0
    cache.subscribe(lambda e: None)
    with cache.lookup([1, 2, 3]) as m:
        cache.commit(m.handle, [1, 2, 3, 4, 5, 6, 7])
    assert calls[0] > 0


@pytest.mark.parametrize("block_size", [1, 3])
@pytest.mark.parametrize("mode", ["tokens", "keys"])
@pytest.mark.parametrize("seed", range(4))
def test_replaying_events_mirrors_the_cache(block_size, mode, seed):
    """Random requests over a small pool (evictions, splits, pins, several namespaces, resets): after every
    step the mirror holds exactly the cache's blocks, keyed by block_keys of their token prefixes."""
    rng = random.Random(seed)
    cache = PrefixCache(CacheConfig(num_blocks=7, block_size=block_size, hash_seed=seed))
    mirror = Mirror()
    cache.subscribe(mirror)
    prefixes: dict[tuple[str, object], tuple] = {}  # (namespace, key) -> the token prefix it stands for
    live = []
    for step in range(300):
        ns = rng.choice(["a", "b", "c"])
        prompt = tuple(rng.randrange(2) for _ in range(rng.randrange(1, 4 * block_size + 2)))
        seq = prompt + tuple(rng.randrange(2) for _ in range(rng.randrange(2 * block_size)))
        if mode == "tokens":
            m = cache.match(list(prompt), namespace=ns)
            cache.commit(m.handle, list(seq))
            nb = len(seq) // block_size
            for key, i in zip(block_keys(list(seq), ns, block_size=block_size, hash_seed=seed), range(nb)):
                prefixes[(ns, key)] = seq[: (i + 1) * block_size]
        else:
            keys = [seq[: (i + 1) * block_size] for i in range(len(seq) // block_size)] or [seq]
            m = cache.match_keys(keys[:-1] or keys, namespace=ns)
            cache.commit_keys(m.handle, keys)
        live.append(m.handle)
        while len(live) > rng.randrange(3):  # up to two requests stay pinned
            cache.release(live.pop(rng.randrange(len(live))))
        if step % 97 == 96:
            cache.reset(keep_stats=rng.random() < 0.5)
            live.clear()
        have = contents(cache)
        assert have == set(mirror.blocks)
        if mode == "tokens":  # each key is the chained hash of the token prefix it was stored for
            for ns_, _mode, key in have:
                assert block_keys(list(prefixes[(ns_, key)]), ns_, block_size=block_size, hash_seed=seed)[-1] == key
        cache.check_integrity()
    assert any(isinstance(e, BlocksRemoved) for e in mirror.events)
