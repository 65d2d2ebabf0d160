"""The engine's counters of the attention kernel's two paths (``EngineStats.decode_path_*``, ``prefill_path_*``,
``/metrics``' ``prefixcache_engine_*_path_*``): the K/V bytes and FLOPs they report equal a brute-force count over
every query of every step the engine ran, and their seconds lie inside attention's."""

from __future__ import annotations

import pytest
import torch
from engine_testutil import rand_tokens, tiny_model

from engine import hf_cache
from engine.batching.engine import Engine
from engine.batching.request import Request
from engine.batching.sampling import SamplingParams
from engine.batching.scheduler import SchedulerConfig
from engine.kv_pool import KVPool
from engine.paged import kernel
from prefixcache import CacheConfig, PrefixCache

LIB = kernel.load()
pytestmark = pytest.mark.skipif(
    LIB is None or not kernel.prefill_available(LIB, torch.float32), reason="no C kernel with its prefill path here"
)


def keys_seen(kv_len: int, q_len: int, window: int | None) -> int:
    """(query, key) pairs of a row's new tokens, one query at a time."""
    n = 0
    for p in range(kv_len - q_len, kv_len):
        n += sum(1 for k in range(p + 1) if window is None or p - k < window)
    return n


@pytest.mark.parametrize("window", [None, 6])  # tiny_model's Mistral has a sliding window of 6
def test_path_counters_equal_a_count_over_every_query(window):
    m = tiny_model("llama" if window is None else "mistral_window", hidden=64)  # head dim 16, as the prefill path needs
    pool = KVPool(hf_cache.probe_specs(m), 64, 4, dtype=torch.float32, device="cpu")
    cache = PrefixCache(CacheConfig(num_blocks=64, block_size=4))
    engine = Engine(m, cache, pool, config=SchedulerConfig(max_chunk_tokens=12))
    batches = []
    make = engine.runner.batch
    engine.runner.batch = lambda rows: batches.append(make(rows)) or batches[-1]  # type: ignore[method-assign]
    gen = torch.Generator().manual_seed(5)
    for i, n in enumerate((30, 3, 9)):  # a prompt in chunks of 12, one the decode path takes, one the prefill path
        engine.submit(Request(f"r{i}", rand_tokens(gen, n), "ns", SamplingParams(max_tokens=5)))
    while engine.step():
        engine.cache.check_integrity()
    cfg = m.config
    hkv, hq, layers = cfg.num_key_value_heads, cfg.num_attention_heads, cfg.num_hidden_layers
    dim = cfg.hidden_size // hq
    dec_bytes = pf_flops = 0
    took_prefill = took_decode = False
    for b in batches:
        assert not b.torch_rows or len(b.rows) == 1  # only a lone row leaves the kernel
        for i in b.kernel_rows:
            r = b.rows[i]
            dec_bytes += layers * keys_seen(r.kv_len, r.q_len, window) * 2 * hkv * dim * 4
            took_decode = True
        for i in b.prefill_rows:
            r = b.rows[i]
            pf_flops += layers * keys_seen(r.kv_len, r.q_len, window) * 4 * hq * dim
            took_prefill = True
    assert took_decode and took_prefill
    s = engine.stats
    assert s.decode_path_bytes == dec_bytes and s.prefill_path_flops == pf_flops
    assert s.decode_path_s > 0 and s.prefill_path_s > 0
    assert s.decode_path_s + s.prefill_path_s <= s.attention_s <= s.forward_s
