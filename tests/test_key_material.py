"""Per-block key material (``prefixcache.core.key_material``) against a brute-force reference: a cache keyed
on (token ids, material of each block) as tuples, where equal keys are equal prefixes by construction."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache import CacheConfig, PrefixCache
from prefixcache.core.key_material import MIN_BLOCK_SIZE, block_material, keyed_tokens

BS = 4


def reference_hit(cached: list[tuple[list[int], dict[int, bytes]]], tokens: list[int], mat: dict[int, bytes]) -> int:
    """Blocks of the longest prefix of (tokens, material) that some cached prompt shares, block by block, leaving
    at least one token uncached (what ``match`` serves)."""
    limit = (len(tokens) - 1) // BS
    best = 0
    for ctoks, cmat in cached:
        n = 0
        while (
            n < limit
            and (n + 1) * BS <= len(ctoks)
            and ctoks[n * BS : (n + 1) * BS] == tokens[n * BS : (n + 1) * BS]
            and cmat.get(n) == mat.get(n)
        ):
            n += 1
        best = max(best, n)
    return best


prompts = st.lists(st.integers(0, 3), min_size=1, max_size=24)  # few distinct ids: prefixes collide a lot
images = st.lists(st.tuples(st.integers(0, 20), st.integers(1, 9), st.sampled_from([b"A", b"B", b"C"])), max_size=2)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(prompts, images), min_size=1, max_size=6))
def test_hits_follow_tokens_and_material(requests):
    cache = PrefixCache(CacheConfig(num_blocks=256, block_size=BS))
    cached: list[tuple[list[int], dict[int, bytes]]] = []
    for tokens, items in requests:
        spans = [(s, min(s + n, len(tokens)), cid) for s, n, cid in items if s < len(tokens)]
        mat = block_material(spans, BS)
        keyed = keyed_tokens(tokens, mat, BS)
        assert keyed.dtype == np.dtype("<i4") and (keyed >= 0).all()
        m = cache.match(keyed)
        assert m.cached_blocks == reference_hit(cached, tokens, mat)
        cache.commit(m.handle)
        cache.release(m.handle)
        cache.check_integrity()
        cached.append((tokens, mat))


def test_same_ids_other_image_misses_from_its_first_block():
    tokens = list(range(10)) + [99] * 20 + list(range(10, 26))  # 20 placeholders at 10..29
    cache = PrefixCache(CacheConfig(num_blocks=64, block_size=BS))
    a = keyed_tokens(tokens, block_material([(10, 30, b"image-a")], BS), BS)
    b = keyed_tokens(tokens, block_material([(10, 30, b"image-b")], BS), BS)
    m = cache.match(a)
    cache.commit(m.handle)
    cache.release(m.handle)
    assert cache.probe(a) == 44  # the same image: all full blocks but the last token's
    assert cache.probe(b) == 8  # another image: blocks 0-1 are text, block 2 holds placeholder 10
    assert cache.probe(tokens) == 8  # no image at all (ids alone) does not hit the image's blocks either
    assert (a[:8] == np.asarray(tokens[:8])).all() and not (a[8:30] == np.asarray(tokens[8:30])).any()
    assert (a[32:] == np.asarray(tokens[32:])).all()  # blocks past the image keep their ids


def test_no_material_is_the_plain_stream_and_partial_block_masks_are_stable():
    tokens = np.arange(9, dtype=np.int32)
    assert keyed_tokens(tokens, {}, BS) is tokens
    mat = block_material([(6, 9, b"x")], BS)  # the image ends the prompt, inside block 2 (tokens 8..11)
    short = keyed_tokens(tokens, mat, BS)
    longer = keyed_tokens(np.arange(12, dtype=np.int32), mat, BS)  # the block completed by generated tokens
    assert (longer[:9] == short).all()


def test_bad_material_is_refused():
    with pytest.raises(ValueError, match="block 5"):
        keyed_tokens([1, 2, 3], {5: b"x"}, BS)
    with pytest.raises(ValueError, match="non-empty"):
        keyed_tokens([1, 2, 3], {0: b""}, BS)
    with pytest.raises(ValueError, match="too small"):
        keyed_tokens([1, 2, 3], {0: b"x"}, MIN_BLOCK_SIZE - 1)
    with pytest.raises(ValueError, match="stop"):
        block_material([(4, 4, b"x")], BS)
    with pytest.raises(TypeError, match="content id"):
        block_material([(0, 4, "x")], BS)  # type: ignore[list-item]
