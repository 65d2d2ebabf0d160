"""The precomputed-key path (match_keys / commit_keys): hand examples and DESIGN.md §7's trace figures."""

from __future__ import annotations

import gzip
import json

import pytest

from prefixcache import CacheConfig, PrefixCache


def test_keys_hits_counts_and_default_commit():
    cache = PrefixCache(CacheConfig(num_blocks=4, block_size=512))
    m = cache.match_keys([10, 11, 12], num_tokens=1100)  # last block partial (76 tokens)
    assert m.cached_tokens == 0
    r = cache.commit_keys(m.handle)  # default: every key given to match_keys, partial block included
    assert r.block_ids == (0, 1, 2) and r.cached_blocks == 3
    cache.release(m.handle)
    m = cache.match_keys([10, 11, 13], num_tokens=1500)
    assert m.block_ids == (0, 1) and m.cached_tokens == 1024
    r = cache.commit_keys(m.handle, [10, 11, 13, 14])  # needs 2, 1 free: evicts 12, the unpinned leaf
    assert r.first_block == 2 and r.block_ids == (3, 2) and r.not_cached == 0
    cache.release(m.handle)
    m = cache.match_keys([10, 11, 13, 14], max_blocks=3, num_tokens=2048)  # a cap on what may hit
    assert m.block_ids == (0, 1, 3) and m.cached_tokens == 1536
    cache.release(m.handle)
    m = cache.match_keys([10, 11], num_tokens=700)  # token count capped by the prompt length
    assert m.cached_blocks == 2 and m.cached_tokens == 700
    cache.release(m.handle)
    s = cache.stats
    assert (s.lookups, s.prompt_tokens, s.cached_tokens) == (4, 1100 + 1500 + 2048 + 700, 1024 + 1536 + 700)
    assert (s.lookup_blocks, s.hit_blocks, s.lookups_with_hit) == (3 + 3 + 4 + 2, 2 + 3 + 2, 3)
    assert s.blocks_evicted == 1 and s.blocks_inserted == 5
    cache.check_integrity()


def _replay(path, num_blocks: int | None) -> float:
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f]
    unlimited = sum(len(r["hash_ids"]) for r in rows)
    cache = PrefixCache(CacheConfig(num_blocks=num_blocks or unlimited, block_size=512))
    for r in rows:
        m = cache.match_keys(r["hash_ids"], num_tokens=r["input_length"])
        cache.commit_keys(m.handle)
        cache.release(m.handle)
    cache.check_integrity()
    return cache.stats.block_hit_rate


@pytest.mark.parametrize(
    ("trace", "num_blocks", "expected"),
    [
        ("mooncake_conversation_trace.jsonl.gz", 1_000, 0.0445),
        ("mooncake_conversation_trace.jsonl.gz", 10_000, 0.2116),
        ("mooncake_conversation_trace.jsonl.gz", None, 0.3664),
        ("mooncake_synthetic_trace.jsonl.gz", 10_000, 0.4239),
        ("mooncake_synthetic_trace.jsonl.gz", None, 0.6396),
    ],
)
def test_mooncake_block_hit_rates_match_design(traces_dir, trace, num_blocks, expected):
    """DESIGN.md §7: block-LRU with prefix semantics, file order, no warm-up."""
    path = traces_dir / trace
    assert _replay(path, num_blocks) == pytest.approx(expected, abs=5e-5)
