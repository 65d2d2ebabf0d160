"""Time to first token with a shared 2,048-token prefix: uncached vs PrefixCachedModel vs ideal vs generate_batch.

    python benchmarks/bench_ttft.py [--runs 3] [--quick] [--json FILE] [--model small] [--device cpu|cuda]
                                    [--dtype fp32|bf16] [--prefix 2048] [--suffix 64]

Every request is prefix + a NEVER-SEEN suffix, max_new_tokens=1. TTFT is taken when generate's streamer receives
the first new token; "whole call" also counts what follows it (for the wrapper: commit + scatter of the new
blocks). Within a run every figure is a median over ``--repeats`` requests and every ratio compares figures of
the same run (cached / ideal / generate-with-ready-cache are interleaved, as are uncached / miss). The whole
run is repeated ``--runs`` times: the table and the JSON give the median and the spread (min-max) across runs
of every figure, ratios included, with the machine's load average before and after.
- uncached:   ``model.generate`` on the full prompt.
- cached:     ``PrefixCachedModel.generate`` after one warm-up request that cached the prefix.
- ideal:      a bare forward of the suffix with a ready DynamicCache of the prefix (built outside the timer).
- generate with a ready cache: ``model.generate`` given that ready cache (what generate's own work adds).
- miss:       the wrapper vs ``model.generate`` on never-seen prompts of the same length (interleaved).
- generate_batch: transformers' continuous batching with block sharing (prefix caching), the same requests one
  after another through one persistent manager; the warm-up request there generates 2 tokens so that its blocks
  are stored at all (a 1-token request never stores its blocks in that engine). Its own phase, not interleaved.
- gather: ``KVPool.gather`` of the prefix's blocks.
- weights check: the wrapper's per-call check that the model's weights did not change (``engine.weights``).
- decode: a hit plus ``--decode`` generated tokens, wrapper vs ``model.generate`` with a ready DynamicCache.
- batch: a left-padded batch (a 256-token system prompt + 64, 88, ... tokens per row, 16 new tokens each), raw
  ``model.generate`` vs the wrapper on a miss vs the wrapper with the system prompt cached.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import transformers

import _meta
from engine import PrefixCachedModel, hf_cache
from engine.models import load_model
from engine.replay import TTFTStreamer
from engine.weights import WeightsSnapshot, describe_change

BLOCK = 16
BATCH_SYSTEM_TOKENS = 256
BATCH_NEW_TOKENS = 16


def batch_row_tokens(rows: int) -> list[int]:
    """New tokens after the system prompt in each row of the batch figure: 64, 88, 112, ..."""
    return [64 + 24 * i for i in range(rows)]


class Timer:
    """Wall-clock timing that waits for the device (CUDA kernels run asynchronously)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def time(self, fn: Callable[[], Any]) -> float:
        self.sync()
        t = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - t

    def first_token(self, call: Callable[[TTFTStreamer], Any]) -> tuple[float, float]:
        """(time to the first new token, time of the whole call) of ``call(streamer)``; the streamer receives
        tokens on the CPU, so its clock already waits for the device."""
        streamer = TTFTStreamer()
        self.sync()
        t = time.perf_counter()
        call(streamer)
        self.sync()
        end = time.perf_counter()
        assert streamer.first is not None
        return streamer.first - t, end - t

    def median(self, fn: Callable[[], Any], repeats: int) -> float:
        return statistics.median(self.time(fn) for _ in range(repeats))


def _medians(pairs: list[tuple[float, float]]) -> tuple[float, float]:
    return statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)


def bench_generate_batch(model, prefix: list[int], suffixes: list[list[int]], timer: Timer) -> dict:
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
            times = [timer.time(lambda s=s: serve(prefix + s, 1)) for s in suffixes[1:]]
        finally:
            manager.stop(block=True)
    finally:
        cb_cache.PagedAttentionCache.search_prefix_match = original
        if hasattr(model, "destroy_cached_continuous_batching_manager"):
            model.destroy_cached_continuous_batching_manager()
    return {"ttft_s": statistics.median(times), "matched_tokens": matched[1:]}


def one_run(model, args, repeats: int, seed: int, timer: Timer, console: Console) -> tuple[dict[str, float], dict]:
    """Every figure of one run (seconds and same-run ratios), plus facts that are not figures."""
    device = model.device
    vocab = min(model.config.vocab_size, 256)
    g = torch.Generator().manual_seed(seed)

    def toks(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    def tensor(ids: list[int]) -> torch.Tensor:
        return torch.tensor([ids], device=device)

    prefix = toks(args.prefix)
    suffixes = [toks(args.suffix) for _ in range(2 * repeats + 1)]
    pcm = PrefixCachedModel(model, max_cached_tokens=16 * (args.prefix + args.suffix), block_size=BLOCK)

    def gen(m, ids: list[int], streamer=None):
        with torch.inference_mode():
            return m.generate(tensor(ids), max_new_tokens=1, do_sample=False, streamer=streamer)

    def first(m, ids: list[int]) -> tuple[float, float]:
        return timer.first_token(lambda st: gen(m, ids, st))

    gen(model, toks(32))  # warm kernels
    # uncached vs wrapper on never-seen prompts (interleaved): also the miss overhead
    raw, miss = [], []
    for _ in range(repeats):
        raw.append(first(model, toks(args.prefix + args.suffix)))
        miss.append(first(pcm, toks(args.prefix + args.suffix)))
    (ttft_uncached, call_uncached), (ttft_miss, call_miss) = _medians(raw), _medians(miss)

    # cached vs ideal vs generate-with-ready-cache, interleaved; every request has a never-seen suffix
    pcm.generate(tensor(prefix + suffixes[0]), max_new_tokens=1)  # warm: caches the prefix
    kw = hf_cache.cache_kwarg(model)
    with torch.inference_mode():
        full = hf_cache.fresh_cache(model)
        model(input_ids=tensor(prefix), use_cache=True, **{kw: full})
        prefix_kv = [(k.clone(), v.clone()) for k, v in hf_cache.read_kv(full, 0, args.prefix)]
    del full

    def ready_cache():
        return hf_cache.fresh_cache(model, [(k.clone(), v.clone()) for k, v in prefix_kv])

    cached, ideal, ready_gen = [], [], []
    for i in range(repeats):
        s_cached, s_ideal, s_gen = suffixes[1 + i], suffixes[1 + repeats + i], toks(args.suffix)
        cached.append(first(pcm, prefix + s_cached))
        assert pcm.last_request_stats[0].cached_tokens == args.prefix, pcm.last_request_stats
        with torch.inference_mode():
            ready, ids = ready_cache(), tensor(s_ideal)
            ideal.append(
                timer.time(lambda: model(input_ids=ids, use_cache=True, **{kw: ready}).logits[:, -1].argmax(-1))
            )
            ready, ids = ready_cache(), tensor(prefix + s_gen)
            ready_gen.append(
                timer.first_token(
                    lambda st: model.generate(ids, max_new_tokens=1, do_sample=False, streamer=st, **{kw: ready})
                )
            )
    (ttft_cached, call_cached), (ttft_ready_gen, call_ready_gen) = _medians(cached), _medians(ready_gen)
    ttft_ideal = statistics.median(ideal)

    # gather cost of the prefix's blocks; the per-call weights check
    with pcm.cache.lookup(torch.tensor(prefix + toks(args.suffix)), pcm.runtime.namespace("default")) as m:
        assert m.cached_tokens == args.prefix
        gather_s = timer.median(lambda: pcm.pool.gather(m.block_ids), max(5, repeats))
    pcm.cache.check_integrity()
    snap = WeightsSnapshot.take(model)
    weights_check_s = timer.median(lambda: describe_change(model, snap, WeightsSnapshot.take(model)), 50)

    figures: dict[str, float] = {
        "ttft_uncached_s": ttft_uncached,
        "ttft_miss_s": ttft_miss,
        "ttft_cached_s": ttft_cached,
        "ttft_ideal_s": ttft_ideal,
        "ttft_generate_ready_cache_s": ttft_ready_gen,
        "call_uncached_s": call_uncached,
        "call_miss_s": call_miss,
        "call_cached_s": call_cached,
        "call_generate_ready_cache_s": call_ready_gen,
        "gather_s": gather_s,
        "weights_check_s": weights_check_s,
        "speedup": ttft_uncached / ttft_cached,
        "uncached_over_ideal": ttft_uncached / ttft_ideal,
        "miss_over_ideal": ttft_miss / ttft_ideal,
        "cached_over_ideal": ttft_cached / ttft_ideal,
        "generate_ready_cache_over_ideal": ttft_ready_gen / ttft_ideal,
        "miss_overhead_ratio": ttft_miss / ttft_uncached,
        "call_miss_overhead_ratio": call_miss / call_uncached,
        "weights_check_over_cached": weights_check_s / ttft_cached,
    }
    facts: dict[str, Any] = {}

    # decoding after a hit: the wrapper appends into its gather buffer; a plain DynamicCache concatenates
    if args.decode > 0:
        dec_cached, dec_ready = [], []
        for _ in range(max(3, repeats // 2)):
            ids = tensor(prefix + toks(args.suffix))
            with torch.inference_mode():
                dec_cached.append(
                    timer.time(
                        lambda: pcm.generate(
                            ids, max_new_tokens=args.decode, do_sample=False, min_new_tokens=args.decode
                        )
                    )
                )
                ready, ids = ready_cache(), tensor(prefix + toks(args.suffix))
                dec_ready.append(
                    timer.time(
                        lambda: model.generate(
                            ids, max_new_tokens=args.decode, do_sample=False, min_new_tokens=args.decode, **{kw: ready}
                        )
                    )
                )
        figures["call_cached_decode_s"] = statistics.median(dec_cached)
        figures["call_generate_ready_cache_decode_s"] = statistics.median(dec_ready)
        figures["decode_ready_cache_over_cached"] = statistics.median(dec_ready) / statistics.median(dec_cached)

    # a left-padded batch: rows of different lengths behind one shared system prompt, 16 new tokens each
    if args.batch > 0:
        system = toks(BATCH_SYSTEM_TOKENS)

        def padded_batch(shared: bool):
            rows = [(system if shared else toks(BATCH_SYSTEM_TOKENS)) + toks(n) for n in batch_row_tokens(args.batch)]
            width = max(map(len, rows))
            ids = torch.zeros((len(rows), width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, r in enumerate(rows):
                ids[i, width - len(r) :] = torch.tensor(r)
                mask[i, width - len(r) :] = 1
            return ids.to(device), mask.to(device)

        def run_batch(m, shared: bool) -> float:
            ids, mask = padded_batch(shared)
            with torch.inference_mode():
                return timer.time(
                    lambda: m.generate(
                        ids,
                        attention_mask=mask,
                        max_new_tokens=BATCH_NEW_TOKENS,
                        min_new_tokens=BATCH_NEW_TOKENS,
                        do_sample=False,
                        pad_token_id=0,
                    )
                )

        pcm.generate(tensor(system + toks(8)), max_new_tokens=1)  # the system prompt is cached
        b_raw, b_miss, b_hit = [], [], []
        for _ in range(max(3, repeats // 2)):
            b_raw.append(run_batch(model, True))
            b_miss.append(run_batch(pcm, False))
            b_hit.append(run_batch(pcm, True))
        raw_s, miss_s, hit_s = statistics.median(b_raw), statistics.median(b_miss), statistics.median(b_hit)
        figures.update(
            batch_call_raw_s=raw_s,
            batch_call_miss_s=miss_s,
            batch_call_hit_s=hit_s,
            batch_miss_over_raw=miss_s / raw_s,
            batch_hit_over_raw=hit_s / raw_s,
        )

    if not (args.quick or args.no_generate_batch):
        try:
            gb = bench_generate_batch(model, prefix, suffixes[: repeats + 1], timer)
            figures["ttft_generate_batch_s"] = gb["ttft_s"]
            figures["generate_batch_over_ideal"] = gb["ttft_s"] / ttft_ideal
            facts["generate_batch_matched_tokens"] = gb["matched_tokens"]
        except Exception as exc:  # report, don't fail the whole benchmark
            console.print(f"[red]generate_batch failed: {exc!r}[/]")
            facts["generate_batch_error"] = repr(exc)
    return figures, facts


def spread(values: list[float]) -> dict:
    """Median, min, max and every value of one figure across runs."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


# (label, figure, kind): kind "ms" prints seconds as ms, "x" a ratio; the rows README quotes
TABLE = [
    ("uncached model.generate, TTFT", "ttft_uncached_s", "ms"),
    ("PrefixCachedModel, miss (never-seen prompt), TTFT", "ttft_miss_s", "ms"),
    ("PrefixCachedModel, prefix hit, TTFT", "ttft_cached_s", "ms"),
    ("ideal: bare forward with a ready DynamicCache", "ttft_ideal_s", "ms"),
    ("model.generate with a ready DynamicCache, TTFT", "ttft_generate_ready_cache_s", "ms"),
    ("generate_batch + block sharing, TTFT", "ttft_generate_batch_s", "ms"),
    ("gather of the prefix's KV from the pool", "gather_s", "ms"),
    ("weights check per call", "weights_check_s", "ms"),
    ("uncached / ideal", "uncached_over_ideal", "x"),
    ("miss / ideal", "miss_over_ideal", "x"),
    ("hit / ideal", "cached_over_ideal", "x"),
    ("generate with a ready cache / ideal", "generate_ready_cache_over_ideal", "x"),
    ("generate_batch / ideal", "generate_batch_over_ideal", "x"),
    ("hit speedup vs uncached", "speedup", "x"),
    ("miss / uncached (TTFT)", "miss_overhead_ratio", "x"),
    ("miss / uncached (whole call)", "call_miss_overhead_ratio", "x"),
    ("weights check / hit TTFT", "weights_check_over_cached", "x"),
    ("decode: hit + N tokens, wrapper, whole call", "call_cached_decode_s", "ms"),
    ("decode: generate with a ready DynamicCache", "call_generate_ready_cache_decode_s", "ms"),
    ("decode: ready DynamicCache / wrapper", "decode_ready_cache_over_cached", "x"),
    ("batch: raw model.generate, whole call", "batch_call_raw_s", "ms"),
    ("batch: wrapper, miss", "batch_call_miss_s", "ms"),
    ("batch: wrapper, system prompt cached", "batch_call_hit_s", "ms"),
    ("batch: miss / raw", "batch_miss_over_raw", "x"),
    ("batch: system prompt cached / raw", "batch_hit_over_raw", "x"),
]


def _cpu_name() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _fmt(value: float, kind: str) -> str:
    return f"{value * 1e3:,.1f}" if kind == "ms" else f"{value:.2f}x" if value >= 0.1 else f"{value:.4f}x"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small", help="preset or local model dir (default: small, ~110M)")
    ap.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:1, ...")
    ap.add_argument("--dtype", default="fp32", help="fp32 (default), bf16, fp16")
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--suffix", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=None, help="requests per variant and run (default 7, --quick 3)")
    ap.add_argument("--runs", type=int, default=None, help="whole runs, for the spread (default 3, --quick 1)")
    ap.add_argument("--quick", action="store_true", help="fewer repeats, one run, skip generate_batch")
    ap.add_argument("--no-generate-batch", action="store_true")
    ap.add_argument(
        "--batch", type=int, default=8, help="also time a left-padded batch of this many rows, raw vs wrapper (0: skip)"
    )
    ap.add_argument(
        "--decode", type=int, default=32, help="also time whole calls generating this many tokens after a hit (0: skip)"
    )
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    meta = _meta.begin(peers=("transformers",))
    repeats = args.repeats or (3 if args.quick else 7)
    runs = args.runs or (1 if args.quick else 3)
    console = Console(width=130)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit(f"bench_ttft: --device {args.device}, but torch {torch.__version__} sees no CUDA device")
    torch.manual_seed(0)
    model, _ = load_model(args.model, dtype=args.dtype, device=device)
    n_params = sum(p.numel() for p in model.parameters())
    timer = Timer(device)
    load_before = os.getloadavg()
    console.print(
        f"[bold]{args.model}[/]: {n_params / 1e6:.1f}M params, {model.dtype}, {device}, {torch.get_num_threads()} "
        f"threads, prompt = {args.prefix} shared + {args.suffix} new tokens, {repeats} repeats x {runs} runs; "
        f"load average {load_before[0]:.2f} on {os.cpu_count()} CPUs"
    )
    per_run: list[dict[str, float]] = []
    facts: list[dict] = []
    for run in range(runs):
        t = time.perf_counter()
        figures, f = one_run(model, args, repeats, run, timer, console)
        per_run.append(figures)
        facts.append(f)
        console.print(
            f"run {run + 1}/{runs}: {time.perf_counter() - t:.0f} s; hit {figures['ttft_cached_s'] * 1e3:.0f} ms, "
            f"uncached {figures['ttft_uncached_s'] * 1e3:.0f} ms, load average {os.getloadavg()[0]:.2f}"
        )
    names = [k for k in per_run[0] if all(k in r for r in per_run)]
    summary = {k: spread([r[k] for r in per_run]) for k in names}

    title = f"{args.model}, {args.prefix} shared + {args.suffix} new tokens, max_new_tokens=1: median of {runs} runs"
    table = Table(title=title)
    for col in ("figure", "median", "min", "max"):
        table.add_column(col, justify="left" if col == "figure" else "right")
    for label, key, kind in TABLE:
        if key in summary:
            s = summary[key]
            unit = " (ms)" if kind == "ms" else ""
            table.add_row(label + unit, _fmt(s["median"], kind), _fmt(s["min"], kind), _fmt(s["max"], kind))
    console.print(table)
    if args.decode > 0:
        console.print(f"decode rows: a hit, then {args.decode} generated tokens")
    if args.batch > 0:
        console.print(
            f"batch rows: {args.batch} left-padded rows, a {BATCH_SYSTEM_TOKENS}-token system prompt + "
            f"{batch_row_tokens(args.batch)[0]}..{batch_row_tokens(args.batch)[-1]} tokens, {BATCH_NEW_TOKENS} new "
            "tokens each"
        )
    load_after = os.getloadavg()
    console.print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} ({os.cpu_count()} CPUs)")
    result = {
        "meta": _meta.end(meta),
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "settings": {
            "model": args.model,
            "params": n_params,
            "dtype": str(model.dtype).removeprefix("torch."),
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name(),
            "threads": torch.get_num_threads(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
            "prefix_tokens": args.prefix,
            "suffix_tokens": args.suffix,
            "max_new_tokens": 1,
            "block_size": BLOCK,
            "repeats": repeats,
            "runs": runs,
            "decode_tokens": args.decode,
            "batch_rows": args.batch,
            "batch_system_tokens": BATCH_SYSTEM_TOKENS,
            "batch_row_new_prompt_tokens": batch_row_tokens(args.batch),
            "batch_new_tokens": BATCH_NEW_TOKENS,
        },
        "load_average": {"before": list(load_before), "after": list(load_after)},
        "figures": summary,
        "runs": facts,
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
