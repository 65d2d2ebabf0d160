"""PrefixCache.divergence against a brute-force reference over the set of cached token prefixes.

The reference knows only which token prefixes are cached (every full-block prefix of every committed
sequence that is still cached, read back as whole root-to-leaf token paths): the longest common prefix of
the prompt with any of them, in tokens, is ``common_tokens``; ``cached_next`` must continue the prompt's
common part along some cached path, diverge from the prompt right there, and stop only at ``context``
tokens or where that cached path ends.
"""

from __future__ import annotations

import random

import pytest

from prefixcache import CacheConfig, PrefixCache
from prefixcache.core import Divergence


def cached_paths(cache: PrefixCache, namespace: str = "default") -> list[tuple[int, ...]]:
    """Every root-to-leaf token path of ``namespace``, from the cached blocks' token ids."""
    root = cache.tree.roots.get(("tokens", namespace))
    if root is None:
        return []
    out = []
    stack = [(child, ()) for child in root.children.values()]
    while stack:
        node, before = stack.pop()
        view = node.token_view(cache.tree.block_bytes)
        here = before + tuple(int.from_bytes(view[i : i + 4], "little") for i in range(0, len(view), 4))
        if node.children:
            stack.extend((c, here) for c in node.children.values())
        else:
            out.append(here)
    return out


def lcp(a: tuple, b: tuple) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def check(cache: PrefixCache, prompt: list[int], context: int, namespace: str = "default") -> Divergence:
    d = cache.divergence(prompt, namespace, context=context)
    paths = cached_paths(cache, namespace)
    p = tuple(prompt)
    common = max((lcp(p, q) for q in paths), default=0)
    assert d.cached_tokens == cache.probe(prompt, namespace)
    assert d.common_tokens == common
    assert d.common_tokens >= d.cached_tokens
    assert len(d.cached_next) <= context
    if not paths:
        assert d.cached_next == ()
        return d
    ext = p[:common] + d.cached_next
    along = [q for q in paths if q[: len(ext)] == ext]
    assert along, "cached_next does not continue a cached path"
    if d.cached_next and common < len(p):
        assert d.cached_next[0] != p[common], "cached_next must start where the prompt diverges"
    if len(d.cached_next) < context:
        assert any(len(q) == len(ext) for q in along), "cached_next stopped before the cached path ends"
    return d


def test_hand_example():
    cache = PrefixCache(CacheConfig(num_blocks=32, block_size=4))
    for seq in ([1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 9, 9, 9, 9, 9, 9]):
        with cache.lookup(seq) as m:
            cache.commit(m.handle)
    # Cached: 1 2 3 4 | 5 6 7 8   and   1 2 3 4 | 5 6 9 9 | 9 9 9 9
    d = cache.divergence([1, 2, 3, 4, 5, 6, 8, 0, 0], context=3)
    assert d == Divergence(cached_tokens=4, common_tokens=6, cached_next=d.cached_next)
    assert d.cached_next in ((7, 8), (9, 9, 9))  # either cached continuation after "5 6"
    d = cache.divergence([1, 2, 3, 4, 5, 6, 9, 9, 9, 9, 9, 9, 9, 9], context=5)
    assert d == Divergence(12, 12, ())  # the whole cached path is in the prompt; it ends there
    d = cache.divergence([1, 2, 3], context=2)
    assert d == Divergence(0, 3, (4, 5))
    d = cache.divergence([7], context=2)
    assert d.cached_tokens == 0 and d.common_tokens == 0 and d.cached_next == (1, 2)
    assert cache.divergence([1, 2], namespace="other") == Divergence(0, 0, ())
    cache.check_integrity()


def test_divergence_changes_nothing():
    cache = PrefixCache(CacheConfig(num_blocks=4, block_size=2))
    with cache.lookup([1, 2, 3, 4, 5]) as m:
        cache.commit(m.handle)
    before = (cache.stats.as_dict(), [(n.id, n.last_access, n.hits, n.pins) for n in cache.tree.nodes()])
    cache.divergence([1, 2, 3, 9])  # would split the node if it were a match
    assert (cache.stats.as_dict(), [(n.id, n.last_access, n.hits, n.pins) for n in cache.tree.nodes()]) == before
    with pytest.raises(ValueError, match="context must be an int >= 0"):
        cache.divergence([1], context=-1)


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("block_size", [1, 2, 3])
@pytest.mark.parametrize("seed", range(5))
def test_random_against_brute_force(block_size, seed, verify):
    rng = random.Random(seed)
    cache = PrefixCache(CacheConfig(num_blocks=12, block_size=block_size, verify_tokens=verify))
    for _ in range(150):
        prompt = [rng.randrange(3) for _ in range(rng.randrange(1, 5 * block_size + 2))]
        check(cache, prompt, rng.randrange(6))
        if rng.random() < 0.7:
            with cache.lookup(prompt) as m:
                cache.commit(m.handle, prompt + [rng.randrange(3) for _ in range(rng.randrange(3))])
        cache.check_integrity()
    check(cache, [], 4)


def test_with_an_injected_hasher_and_no_verification_it_is_block_granular():
    """Matching trusts the hash then: a colliding block counts as common, so the answer is in whole blocks."""
    cache = PrefixCache(CacheConfig(num_blocks=8, block_size=2, verify_tokens=False), hasher=lambda p, b: b"x" * 16)
    with cache.lookup([1, 2, 3, 4, 5]) as m:
        cache.commit(m.handle)
    d = cache.divergence([6, 7, 8, 9, 1])
    assert d == Divergence(cached_tokens=4, common_tokens=4, cached_next=())
