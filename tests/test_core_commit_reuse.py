"""A commit of the matched prompt itself reuses match's walk while the tree keeps its shape (``walked``): it must
give exactly what a full walk gives, whatever other requests did in between."""

from __future__ import annotations

from typing import Any

from hypothesis import event, given, settings
from hypothesis import strategies as st

from prefixcache import CacheConfig, PrefixCache
from prefixcache.core.block_ids import ids_list
from prefixcache.core.radix_tree import Node


def _cache(num_blocks: int = 8, block_size: int = 4) -> PrefixCache:
    return PrefixCache(CacheConfig(num_blocks=num_blocks, block_size=block_size))


def _commit(cache: PrefixCache, keys: list[int]) -> None:
    m = cache.match_keys(keys)
    cache.commit_keys(m.handle)
    cache.release(m.handle)


def test_plain_match_then_commit_reuses_the_walk():
    cache = _cache()
    _commit(cache, [1, 2])
    m = cache.match_keys([1, 2, 3])
    assert m.handle.walked == cache.tree.generation  # nothing changed since: the commit skips its walk
    r = cache.commit_keys(m.handle)
    assert (r.first_block, r.cached_blocks, r.not_cached) == (2, 3, 0)
    cache.release(m.handle)
    cache.check_integrity()


def test_match_capped_by_max_blocks_walks_again():
    cache = _cache()
    _commit(cache, [1, 2, 3])
    m = cache.match_keys([1, 2, 3], max_blocks=2)  # stops at the cap, not where the cached path ends
    assert m.cached_blocks == 2
    r = cache.commit_keys(m.handle)
    assert (r.first_block, r.cached_blocks, r.not_cached, r.block_ids) == (3, 3, 0, ())
    cache.release(m.handle)
    cache.check_integrity()


def test_token_prompt_of_whole_blocks_walks_again():
    cache = _cache(block_size=4)
    m = cache.match(list(range(8)))
    cache.commit(m.handle)
    cache.release(m.handle)
    m = cache.match(list(range(8)))  # match leaves the last block to the model; commit caches it
    assert m.cached_blocks == 1
    r = cache.commit(m.handle)
    assert (r.first_block, r.cached_blocks, r.not_cached, r.block_ids) == (2, 2, 0, ())
    cache.release(m.handle)
    cache.check_integrity()


def test_another_request_inserts_between_match_and_commit():
    cache = _cache()
    _commit(cache, [1])
    a = cache.match_keys([1, 2, 3])
    _commit(cache, [1, 2, 3, 4])  # caches a's missing blocks (and splits nothing of a's path)
    r = cache.commit_keys(a.handle)
    assert (r.first_block, r.cached_blocks, r.not_cached, r.block_ids) == (3, 3, 0, ())
    cache.release(a.handle)
    cache.check_integrity()


def test_another_request_splits_between_match_and_commit():
    cache = _cache()
    _commit(cache, [1, 2, 3])
    a = cache.match_keys([1, 2, 3, 4])
    b = cache.match_keys([1, 9])  # splits a's terminal node
    r = cache.commit_keys(a.handle)
    assert (r.first_block, r.cached_blocks, r.not_cached) == (3, 4, 0)
    cache.release(a.handle)
    cache.release(b.handle)
    cache.check_integrity()


def _label(node: Node) -> Any:
    return tuple(node._keys) if node._keys is not None else bytes(node.token_view(node_bytes(node)))


def node_bytes(node: Node) -> int:
    root = node
    while root.parent is not None:
        root = root.parent
    return root.tree.block_bytes  # type: ignore[attr-defined,no-any-return]


def _prefix(node: Node) -> tuple[Any, ...]:
    out = []
    n: Node | None = node
    while n is not None and n.parent is not None:
        out.append(_label(n))
        n = n.parent
    return tuple(reversed(out))


def _snapshot(cache: PrefixCache) -> Any:
    nodes = sorted(
        (repr(_prefix(n)), ids_list(n.blocks), n.pins, n.last_access, n.created, n.hits) for n in cache.tree.nodes()
    )
    return nodes, [_prefix(n) for n in cache.policy], cache.stats  # type: ignore[arg-type]


SEQ = st.lists(st.integers(0, 2), min_size=1, max_size=7)
OP = st.tuples(st.sampled_from(["match", "commit", "release"]), st.integers(0, 2), SEQ, st.booleans(), st.booleans())


def _run(ops: list[tuple[str, int, list[int], bool, bool]], tokens: bool, reuse: bool) -> list[Any]:
    cache = _cache(num_blocks=6, block_size=2 if tokens else 4)
    handles: dict[int, Any] = {}
    out: list[Any] = []
    for kind, slot, seq, flag, default in ops:
        h = handles.get(slot)
        if kind == "match" and h is None:
            if tokens:
                m = cache.match(seq)
            else:
                m = cache.match_keys(seq, max_blocks=len(seq) - 1 if flag else None)
            handles[slot] = m.handle
            out.append((m.cached_blocks, m.block_ids))
        elif kind == "commit" and h is not None:
            if reuse and default:
                event(f"commit reuses the walk: {h.walked == cache.tree.generation}")
            if not reuse:
                h.walked = -1  # force the full walk
            if tokens:
                r = cache.commit(h, None if default else [*h.prompt.tolist(), *seq])
            else:
                r = cache.commit_keys(h, None if default else [*h.prompt, *seq])
            out.append((r.first_block, r.cached_blocks, r.not_cached, r.block_ids))
        elif kind == "release" and h is not None:
            cache.release(h)
            del handles[slot]
        cache.check_integrity()
    out.append(_snapshot(cache))
    return out


@settings(max_examples=300, deadline=None)
@given(st.lists(OP, max_size=30), st.booleans())
def test_reused_walk_equals_full_walk(ops, tokens):
    assert _run(ops, tokens, reuse=True) == _run(ops, tokens, reuse=False)


def _served(cache: PrefixCache, keys: list[int], ns: str, combined: bool) -> Any:
    if combined:
        cached, hit, c = cache.serve_keys(keys, ns, num_tokens=len(keys) * 4 - 1)
    else:
        m = cache.match_keys(keys, ns, num_tokens=len(keys) * 4 - 1)
        c = cache.commit_keys(m.handle)
        cache.release(m.handle)
        cached, hit = m.cached_tokens, m.cached_blocks
    return cached, hit, c.first_block, c.cached_blocks, c.not_cached, c.block_ids


REQUEST = st.tuples(st.sampled_from(["serve", "hold", "drop"]), SEQ, st.sampled_from(["a", "b"]))


@settings(max_examples=200, deadline=None)
@given(st.lists(REQUEST, max_size=30), st.sampled_from(["lru", "fifo", "lfu", "priority"]))
def test_serve_keys_equals_match_commit_release(requests, eviction):
    """``serve_keys`` changes the cache exactly as match_keys + commit_keys + release, other requests holding
    pins in between (``hold``: a match kept live; ``drop``: the oldest held one released)."""

    def run(combined: bool) -> list[Any]:
        cache = PrefixCache(CacheConfig(num_blocks=6, block_size=4, eviction=eviction))
        events: list[Any] = []
        cache.subscribe(events.append)
        held: list[Any] = []
        out: list[Any] = []
        for kind, keys, ns in requests:
            if kind == "serve":
                out.append(_served(cache, keys, ns, combined))
            elif kind == "hold":
                held.append(cache.match_keys(keys, ns).handle)
            elif held:
                cache.release(held.pop(0))
            cache.check_integrity()
        return [*out, events, _snapshot(cache)]

    assert run(True) == run(False)
