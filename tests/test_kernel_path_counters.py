"""The engine's counters of the attention kernel's two paths (``EngineStats.decode_path_*``, ``prefill_path_*``,
``/metrics``' ``prefixcache_engine_*_path_*``): the K/V bytes and FLOPs they report equal a brute-force count over
every query of every step the engine ran, and their seconds lie inside attention's."""

from __future__ import annotations

import pytest
import torch
import transformers as T
from engine_testutil import VOCAB, rand_tokens

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


def model(window: int | None) -> torch.nn.Module:
    """A tiny random Llama (or Mistral with a sliding window) whose head dim (16) the prefill path takes."""
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.1,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    if window is None:
        m = T.LlamaForCausalLM(T.LlamaConfig(**common))
    else:
        m = T.MistralForCausalLM(T.MistralConfig(sliding_window=window, **common))
    return m.eval()


def keys_seen(kv_len: int, q_len: int, window: int | None) -> int:
    """(query, key) pairs of a row's new tokens, one query at a time."""
    n = 0
    for p in range(kv_len - q_len, kv_len):
        n += sum(1 for k in range(p + 1) if window is None or p - k < window)
    return n


@pytest.mark.parametrize("window", [None, 6])
def test_path_counters_equal_a_count_over_every_query(window):
    m = model(window)
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
    hkv, hq, dim, layers = cfg.num_key_value_heads, cfg.num_attention_heads, 16, cfg.num_hidden_layers
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
    assert 0 < s.decode_path_s and 0 < s.prefill_path_s
    assert s.decode_path_s + s.prefill_path_s <= s.attention_s <= s.forward_s
