"""Time to first token with a shared 2,048-token prefix: uncached vs PrefixCachedModel vs ideal vs generate_batch.

    python benchmarks/bench_ttft.py [--quick] [--json FILE] [--model small] [--prefix 2048] [--suffix 64]

Every request is prefix + a NEVER-SEEN suffix, max_new_tokens=1. TTFT is taken when generate's streamer receives
the first new token; "whole call" also counts what follows it (for the wrapper: commit + scatter of the new
blocks). Medians over repeats; all ratios come from the same run (cached / ideal / generate-with-ready-cache
are interleaved, as are uncached / miss).
- uncached:   ``model.generate`` on the full prompt.
- cached:     ``PrefixCachedModel.generate`` after one warm-up request that cached the prefix.
- ideal:      a bare forward of the suffix with a ready DynamicCache of the prefix (built outside the timer).
- generate with a ready cache: ``model.generate`` given that ready cache (what generate's own work adds).
- miss:       the wrapper vs ``model.generate`` on never-seen prompts of the same length (interleaved).
- generate_batch: transformers' continuous batching with block sharing (prefix caching), the same requests one
  after another through one persistent manager; the warm-up request there generates 2 tokens so that its blocks
  are stored at all (a 1-token request never stores its blocks in that engine).
- gather: ``KVPool.gather`` of the prefix's blocks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import (
    PrefixCachedModel,
    hf_cache,
)
from engine.models import load_model
from engine.replay import TTFTStreamer


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _timed_first_token(call) -> tuple[float, float]:
    """(time to the first new token, time of the whole call) of ``call(streamer)``."""
    streamer = TTFTStreamer()
    t = time.perf_counter()
    call(streamer)
    end = time.perf_counter()
    return streamer.first - t, end - t


def _medians(pairs: list[tuple[float, float]]) -> tuple[float, float]:
    return statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)


def bench_generate_batch(model, prefix: list[int], suffixes: list[list[int]]) -> dict:
    """Sequential requests through one persistent continuous-batching manager with block sharing."""
    import logging

    from transformers import ContinuousBatchingConfig
    from transformers.generation.continuous_batching import cache as cb_cache

    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    matched: list[int] = []
    original = cb_cache.PagedAttentionCache.search_prefix_match

    def spy(self, request_id, prompt_ids):
        n = original(self, request_id, prompt_ids)
        matched.append(n)
        return n

    cb_cache.PagedAttentionCache.search_prefix_match = spy
    try:
        config = ContinuousBatchingConfig(allow_block_sharing=True)
        manager = model.init_continuous_batching(continuous_batching_config=config)
        manager.start()
        try:

            def serve(ids: list[int], new: int) -> None:
                rid = manager.add_request(input_ids=ids, max_new_tokens=new)
                while True:
                    res = manager.get_result(request_id=rid, timeout=60)
                    if res is None:
                        raise RuntimeError("generate_batch manager returned no result within 60 s")
                    if res.is_finished():
                        return

            serve(prefix + suffixes[0], 2)  # warm-up: stores the prefix's blocks
            times = [_timed(lambda s=s: serve(prefix + s, 1)) for s in suffixes[1:]]
        finally:
            manager.stop(block=True)
    finally:
        cb_cache.PagedAttentionCache.search_prefix_match = original
        if hasattr(model, "destroy_cached_continuous_batching_manager"):
            model.destroy_cached_continuous_batching_manager()
    return {"ttft_s": statistics.median(times), "matched_tokens": matched[1:]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small", help="preset or local model dir (default: small, ~110M)")
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--suffix", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=None, help="requests per variant (default 7, --quick 3)")
    ap.add_argument("--quick", action="store_true", help="fewer repeats, skip generate_batch")
    ap.add_argument("--no-generate-batch", action="store_true")
    ap.add_argument(
        "--batch", type=int, default=8, help="also time a left-padded batch of this many rows, raw vs wrapper (0: skip)"
    )
    ap.add_argument(
        "--decode", type=int, default=32, help="also time whole calls generating this many tokens after a hit (0: skip)"
    )
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    repeats = args.repeats or (3 if args.quick else 7)
    console = Console(width=130)
    torch.manual_seed(0)
    model, _ = load_model(args.model)
    n_params = sum(p.numel() for p in model.parameters())
    vocab = min(model.config.vocab_size, 256)
    g = torch.Generator().manual_seed(0)

    def toks(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    prefix = toks(args.prefix)
    suffixes = [toks(args.suffix) for _ in range(2 * repeats + 1)]
    block = 16
    pcm = PrefixCachedModel(model, max_cached_tokens=16 * (args.prefix + args.suffix), block_size=block)

    def gen(m, ids: list[int], streamer=None):
        with torch.inference_mode():
            return m.generate(torch.tensor([ids]), max_new_tokens=1, do_sample=False, streamer=streamer)

    def first(m, ids: list[int]) -> tuple[float, float]:
        return _timed_first_token(lambda st: gen(m, ids, st))

    console.print(
        f"[bold]{args.model}[/]: {n_params / 1e6:.1f}M params, {torch.get_num_threads()} threads, "
        f"prompt = {args.prefix} shared + {args.suffix} new tokens, {repeats} repeats"
    )
    gen(model, toks(32))  # warm kernels
    # uncached vs wrapper on never-seen prompts (interleaved): also the miss overhead
    raw, miss = [], []
    for _ in range(repeats):
        raw.append(first(model, toks(args.prefix + args.suffix)))
        miss.append(first(pcm, toks(args.prefix + args.suffix)))
    (ttft_uncached, call_uncached), (ttft_miss, call_miss) = _medians(raw), _medians(miss)

    # cached vs ideal vs generate-with-ready-cache, interleaved; every request has a never-seen suffix
    pcm.generate(torch.tensor([prefix + suffixes[0]]), max_new_tokens=1)  # warm: caches the prefix
    kw = hf_cache.cache_kwarg(model)
    with torch.inference_mode():
        full = hf_cache.fresh_cache(model)
        model(input_ids=torch.tensor([prefix]), use_cache=True, **{kw: full})
        prefix_kv = [(k.clone(), v.clone()) for k, v in hf_cache.read_kv(full, 0, args.prefix)]
    del full
    cached, ideal, ready_gen = [], [], []
    for i in range(repeats):
        s_cached, s_ideal, s_gen = suffixes[1 + i], suffixes[1 + repeats + i], toks(args.suffix)
        cached.append(first(pcm, prefix + s_cached))
        assert pcm.last_request_stats[0].cached_tokens == args.prefix, pcm.last_request_stats
        with torch.inference_mode():
            ready = hf_cache.fresh_cache(model, [(k.clone(), v.clone()) for k, v in prefix_kv])
            ids = torch.tensor([s_ideal])
            ideal.append(_timed(lambda: model(input_ids=ids, use_cache=True, **{kw: ready}).logits[:, -1].argmax(-1)))
            ready = hf_cache.fresh_cache(model, [(k.clone(), v.clone()) for k, v in prefix_kv])
            ids = torch.tensor([prefix + s_gen])
            ready_gen.append(
                _timed_first_token(
                    lambda st: model.generate(ids, max_new_tokens=1, do_sample=False, streamer=st, **{kw: ready})
                )
            )
    (ttft_cached, call_cached), (ttft_ready_gen, call_ready_gen) = _medians(cached), _medians(ready_gen)
    ttft_ideal = statistics.median(ideal)

    # gather cost of the prefix's blocks
    with pcm.cache.lookup(torch.tensor(prefix + toks(args.suffix)), f"{pcm.fingerprint}:default") as m:
        assert m.cached_tokens == args.prefix
        gather_s = _median_time(lambda: pcm.pool.gather(m.block_ids), max(5, repeats))
    pcm.cache.check_integrity()

    # decoding after a hit: the wrapper appends into its gather buffer; a plain DynamicCache concatenates
    decode = {}
    if args.decode > 0:
        dec_cached, dec_ready = [], []
        for _ in range(max(3, repeats // 2)):
            ids = torch.tensor([prefix + toks(args.suffix)])
            with torch.inference_mode():
                dec_cached.append(
                    _timed(
                        lambda: pcm.generate(
                            ids, max_new_tokens=args.decode, do_sample=False, min_new_tokens=args.decode
                        )
                    )
                )
                ready = hf_cache.fresh_cache(model, [(k.clone(), v.clone()) for k, v in prefix_kv])
                ids = torch.tensor([prefix + toks(args.suffix)])
                dec_ready.append(
                    _timed(
                        lambda: model.generate(
                            ids, max_new_tokens=args.decode, do_sample=False, min_new_tokens=args.decode, **{kw: ready}
                        )
                    )
                )
        decode = {
            "decode_tokens": args.decode,
            "call_cached_decode_s": statistics.median(dec_cached),
            "call_generate_ready_cache_decode_s": statistics.median(dec_ready),
        }

    # a left-padded batch: rows of different lengths behind one shared system prompt, 16 new tokens each
    batch = {}
    if args.batch > 0:
        system = toks(256)

        def padded_batch(shared: bool):
            rows = [(system if shared else toks(256)) + toks(64 + 24 * i) for i in range(args.batch)]
            width = max(map(len, rows))
            ids = torch.zeros((len(rows), width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, r in enumerate(rows):
                ids[i, width - len(r) :] = torch.tensor(r)
                mask[i, width - len(r) :] = 1
            return ids, mask

        def run_batch(m, shared: bool) -> float:
            ids, mask = padded_batch(shared)
            with torch.inference_mode():
                return _timed(
                    lambda: m.generate(
                        ids, attention_mask=mask, max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0
                    )
                )

        pcm.generate(torch.tensor([system + toks(8)]), max_new_tokens=1)  # the system prompt is cached
        b_raw, b_miss, b_hit = [], [], []
        for _ in range(max(3, repeats // 2)):
            b_raw.append(run_batch(model, True))
            b_miss.append(run_batch(pcm, False))
            b_hit.append(run_batch(pcm, True))
        batch = {
            "batch_rows": args.batch,
            "batch_call_raw_s": statistics.median(b_raw),
            "batch_call_miss_s": statistics.median(b_miss),
            "batch_call_hit_s": statistics.median(b_hit),
        }

    gb = None
    if not (args.quick or args.no_generate_batch):
        try:
            gb = bench_generate_batch(model, prefix, suffixes[: repeats + 1])
        except Exception as exc:  # report, don't fail the whole benchmark
            console.print(f"[red]generate_batch failed: {exc!r}[/]")

    result = {
        "model": args.model,
        "params": n_params,
        "prefix_tokens": args.prefix,
        "suffix_tokens": args.suffix,
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "ttft_uncached_s": ttft_uncached,
        "ttft_cached_s": ttft_cached,
        "ttft_ideal_s": ttft_ideal,
        "ttft_miss_s": ttft_miss,
        "ttft_generate_ready_cache_s": ttft_ready_gen,
        "call_uncached_s": call_uncached,
        "call_cached_s": call_cached,
        "call_miss_s": call_miss,
        "call_generate_ready_cache_s": call_ready_gen,
        "call_miss_overhead_ratio": call_miss / call_uncached,
        "miss_overhead_ratio": ttft_miss / ttft_uncached,
        "cached_over_ideal": ttft_cached / ttft_ideal,
        "speedup": ttft_uncached / ttft_cached,
        "gather_s": gather_s,
        "gather_tokens": args.prefix,
        "ttft_generate_batch_s": gb["ttft_s"] if gb else None,
        "generate_batch_matched_tokens": gb["matched_tokens"] if gb else None,
        **decode,
        **batch,
    }
    table = Table(title=f"TTFT, {args.prefix} shared + {args.suffix} new tokens, max_new_tokens=1 (medians)")
    for col in ("variant", "TTFT (ms)", "whole call (ms)", "TTFT vs ideal", "speedup vs uncached"):
        table.add_column(col, justify="right" if col != "variant" else "left")

    def row(name: str, t: float, call: float | None) -> None:
        table.add_row(
            name,
            f"{t * 1e3:.1f}",
            "" if call is None else f"{call * 1e3:.1f}",
            f"{t / ttft_ideal:.2f}x",
            f"{ttft_uncached / t:.2f}x",
        )

    row("uncached model.generate", ttft_uncached, call_uncached)
    row("PrefixCachedModel, miss (never-seen prompt)", ttft_miss, call_miss)
    row("PrefixCachedModel, prefix hit", ttft_cached, call_cached)
    row("ideal: bare forward, ready cache", ttft_ideal, None)
    row("model.generate with a ready cache", ttft_ready_gen, call_ready_gen)
    if gb:
        row(
            f"generate_batch + block sharing (hit {gb['matched_tokens'][0] if gb['matched_tokens'] else 0} tok)",
            gb["ttft_s"],
            gb["ttft_s"],
        )
    table.add_row(f"gather {args.prefix} tokens of KV", f"{gather_s * 1e3:.1f}", "", "", "")
    console.print(table)
    if decode:
        c, r = decode["call_cached_decode_s"], decode["call_generate_ready_cache_decode_s"]
        console.print(
            f"hit + {args.decode} generated tokens, whole call: PrefixCachedModel {c * 1e3:.0f} ms, "
            f"model.generate with a ready DynamicCache {r * 1e3:.0f} ms ({r / c:.2f}x)"
        )
    if batch:
        raw_s = batch["batch_call_raw_s"]
        console.print(
            f"batch of {args.batch} left-padded rows (256-token system prompt + 64..{64 + 24 * (args.batch - 1)} "
            f"tokens, 16 new), whole call: raw model.generate {raw_s * 1e3:.0f} ms, wrapper miss "
            f"{batch['batch_call_miss_s'] * 1e3:.0f} ms ({batch['batch_call_miss_s'] / raw_s:.2f}x), wrapper "
            f"with the system prompt cached {batch['batch_call_hit_s'] * 1e3:.0f} ms "
            f"({batch['batch_call_hit_s'] / raw_s:.2f}x)"
        )
    console.print(
        f"miss overhead ratio {result['miss_overhead_ratio']:.3f} (target <= 1.03); "
        f"cached / ideal {result['cached_over_ideal']:.3f} (target <= 1.25)"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
        console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
