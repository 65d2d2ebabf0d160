"""Wrap a Hugging Face causal LM in PrefixCachedModel and watch the second call hit the cache.

Two questions share a long system prompt (about 1,400 tokens). The first call computes it and caches it; the
second is served the shared part from the cache and prefills only its own question, so its time to first token
drops. The output tokens are the same as the bare model's.

    python examples/wrap_hf_model.py               # the built-in `small` preset (about 10 s on 2 CPU cores)
    python examples/wrap_hf_model.py --model tiny  # the tiny preset: seconds, but too small to show a speed-up
    python examples/wrap_hf_model.py --model path/to/local/hf/model
"""

from __future__ import annotations

import argparse
import time

import torch

from engine import PrefixCachedModel
from engine.models import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", help="a preset (tiny, small) or a local model folder")
    parser.add_argument("--pool-tokens", type=int, default=8192, help="KV pool size in tokens")
    args = parser.parse_args()

    model, tokenizer = load_model(args.model)  # presets: random weights and a byte-level tokenizer, no download

    # The pool is allocated here, on the model's device: bytes per token x tokens. Bytes per token are
    # 2 (K and V) x layers x KV heads x head dim x bytes per element: 73,728 for `small` in fp32, so the
    # default 8,192 tokens take 604 MB. (200,000 tokens would take 14.7 GB.)
    pcm = PrefixCachedModel(model, max_cached_tokens=args.pool_tokens)
    print(f"pool: {pcm.cache_stats()['pool_bytes']:,} bytes for {args.pool_tokens:,} tokens")

    warm = tokenizer("warm-up", return_tensors="pt").input_ids  # a process's first forward is slow: not timed
    model.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=1, do_sample=False)

    # The tiny preset holds 2,048 positions, small 4,096: the prompt stays well under both.
    system = "You are a helpful assistant. Answer in one short paragraph and say what you are unsure of. " * 15
    questions = ["What does a KV cache store?", "Why does a shared system prompt make prefill cheaper?"]
    for question in questions:
        ids = tokenizer(system + question, return_tensors="pt").input_ids
        start = time.perf_counter()
        out = pcm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False)
        ttft_ms = (time.perf_counter() - start) * 1000  # one new token: the time to the first token
        row = pcm.last_request_stats[0]
        print(f"prompt {row.prompt_tokens:,} tokens, {row.cached_tokens:,} from cache, TTFT {ttft_ms:,.0f} ms")
        bare = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False)
        assert torch.equal(out, bare), "the cached output differs from the bare model's"

    stats = pcm.cache_stats()
    print(f"cache: {stats['cached_tokens']:,} of {stats['prompt_tokens']:,} prompt tokens served from cache")


if __name__ == "__main__":
    main()
