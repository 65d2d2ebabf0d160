"""Every architecture: a request sequence through the wrapper matches the unwrapped model exactly.

Runs on ``PREFIXCACHE_TEST_DEVICE`` (default cpu; see engine_testutil)."""

from __future__ import annotations

import pytest
import torch
from engine_testutil import ARCHS, BS, DEVICE, compare, expected_cached, left_pad, rand_tokens, tiny_model

from engine import PrefixCachedModel

NEW = 4  # max_new_tokens; the last generated token has no KV, so prompt + NEW - 1 tokens get committed

# generate itself must change no parameter or buffer: a false "weights changed" would drop the cache every call
pytestmark = pytest.mark.filterwarnings("error::engine.StaleCacheWarning")


def _check(pcm) -> None:
    pcm.cache.check_integrity()
    assert pcm.cache.num_active_requests == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_request_sequence_matches_unwrapped(arch):
    model = tiny_model(arch, device=DEVICE)
    pcm = PrefixCachedModel(model, max_cached_tokens=4096, block_size=BS)
    g = torch.Generator().manual_seed(1)
    a = rand_tokens(g, 18)
    committed: list[list[int]] = []

    def one(prompt: list[int], hand: int) -> list[int]:
        want = expected_cached(prompt, committed)
        assert want == hand, "the brute-force oracle and the hand count disagree"
        out = compare(pcm, model, torch.tensor([prompt]))
        assert pcm.last_request_stats[0].prompt_tokens == len(prompt)
        assert pcm.last_request_stats[0].cached_tokens == hand
        seq = out.sequences[0].tolist()
        committed.append(seq[: len(prompt) + NEW - 1])
        _check(pcm)
        return seq

    first = one(a, 0)  # cold miss; commits 18 + 3 = 21 tokens -> 5 blocks
    assert pcm.last_request_stats[0].inserted_blocks == 5
    one(a[:13] + rand_tokens(g, 7), 12)  # partial hit: 3 full blocks shared
    one(a[:16] + rand_tokens(g, 8), 16)  # hit ends exactly on a block boundary
    one(a[:16], 12)  # whole prompt cached: the last block is recomputed so there are logits
    # second turn: the history (prompt + the whole reply) is cached except its last partial block
    history = first[: len(a) + NEW]
    one(history + rand_tokens(g, 5), 20)

    # a left-padded batch, each row served from its own prefix
    rows = [a + rand_tokens(g, 4), rand_tokens(g, 10), a[:9] + rand_tokens(g, 3)]
    hands = [16, 0, 8]
    for row, hand in zip(rows, hands):
        assert expected_cached(row, committed) == hand
    ids, mask = left_pad(rows)
    compare(pcm, model, ids, mask)
    assert [s.cached_tokens for s in pcm.last_request_stats] == hands
    assert [s.prompt_tokens for s in pcm.last_request_stats] == [len(r) for r in rows]
    _check(pcm)
    stats = pcm.cache_stats()
    assert stats["lookups"] == 8
    assert stats["cached_tokens"] == 0 + 12 + 16 + 12 + 20 + sum(hands)


@pytest.mark.parametrize("arch", ARCHS)
def test_small_pool_evicts_and_stays_exact(arch):
    model = tiny_model(arch, device=DEVICE)
    # 6 blocks (window groups off: the block arithmetic below is the full layers')
    pcm = PrefixCachedModel(model, max_cached_tokens=6 * BS, block_size=BS, sliding_windows=False)
    g = torch.Generator().manual_seed(2)
    a, b = rand_tokens(g, 18), rand_tokens(g, 18)
    compare(pcm, model, torch.tensor([a]))  # 5 blocks in, 1 free
    assert pcm.cache_stats()["blocks_used"] == 5
    compare(pcm, model, torch.tensor([b]))  # needs 5: evicts a's last 4 (LRU tail first)
    assert pcm.last_request_stats[0].cached_tokens == 0
    assert pcm.cache_stats()["blocks_evicted"] == 4
    compare(pcm, model, torch.tensor([a]))  # only a's first block survived
    assert pcm.last_request_stats[0].cached_tokens == BS
    assert pcm.cache_stats()["blocks_evicted"] == 8  # a's 4 blocks came back by evicting b's tail
    compare(pcm, model, torch.tensor([b]))
    assert pcm.last_request_stats[0].cached_tokens == BS
    _check(pcm)


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_greedy_tokens_match(arch):
    model = tiny_model(arch, dtype=torch.bfloat16, device=DEVICE)
    pcm = PrefixCachedModel(model, max_cached_tokens=1024, block_size=BS)
    assert pcm.pool.dtype == torch.bfloat16
    g = torch.Generator().manual_seed(3)
    a = rand_tokens(g, 21)
    for prompt in (a, a[:14] + rand_tokens(g, 6), a):
        ids = torch.tensor([prompt], device=model.device)
        ref = model.generate(ids, max_new_tokens=6)
        out = pcm.generate(ids, max_new_tokens=6)
        assert torch.equal(out, ref)
    assert pcm.last_request_stats[0].cached_tokens == 20
    _check(pcm)
