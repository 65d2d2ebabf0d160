"""The offline batch API: ``PrefixCachedModel.generate_batch`` against transformers' ``generate_batch``.

    python benchmarks/bench_batch_api.py [--prompts 64] [--prefix 1024] [--suffix 64] [--new 32] [--runs 3]
                                         [--model small] [--json FILE] [--quick]

Every prompt is one shared ``--prefix`` of random tokens plus a suffix of its own; each generates ``--new``
tokens greedily. Three ways, each from a cold start (nothing cached) in every run:
- ``prefixcache``: ``PrefixCachedModel.generate_batch`` (the engine: continuous batching over the pool, the prefix
  computed once and shared by every request's block table);
- ``transformers_sharing``: ``model.generate_batch`` with ``ContinuousBatchingConfig(allow_block_sharing=True)``
  (its prefix sharing), pages of ``--page`` tokens (transformers' default 256, and 16 with ``--page 16``);
- ``transformers_no_sharing``: the same without block sharing (``--no-sharing-too``).
Throughput is generated tokens per second of wall time (whole call); the greedy outputs of every request must be
equal across the methods (and equal to the bare model's ``generate`` for ``--check`` of them). Medians over runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _meta
from engine import PrefixCachedModel
from engine.models import load_model


def workload(n: int, prefix: int, suffix: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, 256, (prefix,), generator=gen).tolist()
    return [shared + torch.randint(0, 256, (suffix,), generator=gen).tolist() for _ in range(n)]


def _shared_prefix(prompts: list[list[int]]) -> int:
    first = prompts[0]
    n = min(map(len, prompts))
    for p in prompts[1:]:
        n = next((i for i in range(n) if p[i] != first[i]), n)
    return n


def run_prefixcache(model, prompts: list[list[int]], new: int, block: int) -> tuple[float, list[list[int]], dict]:
    prefix = _shared_prefix(prompts)
    pool_tokens = prefix + len(prompts) * (max(map(len, prompts)) - prefix + new + 2 * block)  # every request's own
    pcm = PrefixCachedModel(model, max_cached_tokens=pool_tokens, block_size=block)
    pcm.engine()  # build (and probe) outside the timer, as transformers builds its manager outside its own
    t0 = time.perf_counter()
    out = pcm.generate_batch(prompts, max_new_tokens=new, do_sample=False)
    wall = time.perf_counter() - t0
    gens = [out[f"req_{i}"].generated_tokens for i in range(len(prompts))]
    eng = pcm.engine()
    assert eng is not None
    info = {
        "cached_tokens": sum(o.cached_tokens for o in out.values()),
        "engine": eng.stats.as_dict(),
        "blocks_used": pcm.cache.num_cached_blocks,
    }
    return wall, gens, info


def run_transformers(
    model, prompts: list[list[int]], new: int, sharing: bool, page: int, batch_tokens: int
) -> tuple[float, list[list[int]], dict]:
    from transformers import ContinuousBatchingConfig, GenerationConfig

    # pages for every request at once, the shared prefix's full pages counted once when shared; transformers counts
    # this allocation inside generate_batch, so it is sized to the workload, as prefixcache's pool is
    prefix = _shared_prefix(prompts) if sharing else 0
    own = max(map(len, prompts)) + new - (prefix // page) * page
    config = ContinuousBatchingConfig(
        page_size=page,
        num_blocks=prefix // page + len(prompts) * -(-own // page) + 8,
        max_memory_percent=0.9,
        max_batch_tokens=batch_tokens,  # left to itself it sizes a step for the whole RAM and refuses to start
        allow_block_sharing=sharing,
    )
    gc = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    t0 = time.perf_counter()
    out = model.generate_batch(prompts, generation_config=gc, continuous_batching_config=config, progress_bar=False)
    wall = time.perf_counter() - t0
    by_prompt: dict[int, list[int]] = {}
    for res in out.values():  # request ids are "req_<i>"
        i = int(str(res.request_id).split("_")[1])
        by_prompt[i] = list(res.generated_tokens)
    info = {"page_size": page, "block_sharing": sharing, "max_batch_tokens": batch_tokens}
    return wall, [by_prompt[i] for i in range(len(prompts))], info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prefix", type=int, default=1024)
    ap.add_argument("--suffix", type=int, default=64)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--block", type=int, default=16, help="prefixcache block size")
    ap.add_argument("--page", type=int, default=256, help="transformers' page size (its default is 256)")
    ap.add_argument("--tf-batch-tokens", type=int, default=256, help="transformers' max_batch_tokens (ours: 256)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--no-sharing-too", action="store_true", help="also transformers without block sharing")
    ap.add_argument("--check", type=int, default=2, help="requests also checked against the bare model's generate")
    ap.add_argument("--quick", action="store_true", help="tiny model, 8 prompts, 1 run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.quick:
        args.model, args.prompts, args.prefix, args.suffix, args.new, args.runs = "tiny", 8, 128, 16, 8, 1
    torch.set_num_threads(os.cpu_count() or 1)
    model, _ = load_model(args.model)
    model.generation_config.eos_token_id = None  # every request generates exactly --new tokens
    prompts = workload(args.prompts, args.prefix, args.suffix, model.config.vocab_size, args.seed)
    methods: dict[str, Any] = {"prefixcache": lambda: run_prefixcache(model, prompts, args.new, args.block)}
    methods["transformers_sharing"] = lambda: run_transformers(
        model, prompts, args.new, True, args.page, args.tf_batch_tokens
    )
    if args.no_sharing_too:
        methods["transformers_no_sharing"] = lambda: run_transformers(
            model, prompts, args.new, False, args.page, args.tf_batch_tokens
        )
    walls: dict[str, list[float]] = {m: [] for m in methods}
    outputs: dict[str, list[list[int]]] = {}
    info: dict[str, Any] = {}
    meta = _meta.begin(peers=("transformers",))
    load_before = os.getloadavg()
    for r in range(args.runs):
        for name, fn in methods.items():  # interleaved, so drifting load hits every method alike
            wall, gens, extra = fn()
            walls[name].append(wall)
            outputs.setdefault(name, gens)
            if outputs[name] != gens:
                raise SystemExit(f"{name}: run {r} produced other tokens than its run 0")
            info[name] = extra
    ref = outputs["prefixcache"]
    same = {m: sum(a == b for a, b in zip(ref, g)) for m, g in outputs.items()}
    bare_ok = 0
    for i in range(min(args.check, len(prompts))):
        ids = torch.tensor([prompts[i]])
        bare = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new, do_sample=False)
        bare_ok += bare[0, len(prompts[i]) :].tolist() == ref[i]
    tokens = args.prompts * args.new
    med = {m: statistics.median(w) for m, w in walls.items()}
    table = Table(
        title=f"{args.prompts} prompts = {args.prefix} shared + {args.suffix} own tokens, {args.new} new each ({args.model})"
    )
    for col in (
        "method",
        "wall s (median)",
        "runs",
        "generated tok/s",
        "vs transformers_sharing",
        "same outputs as prefixcache",
    ):
        table.add_column(col, justify="right" if col != "method" else "left")
    for m in methods:
        table.add_row(
            m,
            f"{med[m]:.2f}",
            " ".join(f"{w:.2f}" for w in walls[m]),
            f"{tokens / med[m]:.1f}",
            f"{med['transformers_sharing'] / med[m]:.2f}x",
            f"{same[m]}/{args.prompts}",
        )
    Console().print(table)
    print(f"bare model generate agrees on {bare_ok}/{min(args.check, len(prompts))} checked requests")
    result = {
        "meta": _meta.end(meta),
        "args": vars(args) | {"json": str(args.json) if args.json else None},
        "wall_s": walls,
        "median_s": med,
        "generated_tokens": tokens,
        "throughput_tok_s": {m: tokens / med[m] for m in med},
        "speedup_vs_transformers_sharing": {m: med["transformers_sharing"] / med[m] for m in med},
        "same_outputs_as_prefixcache": same,
        "bare_model_agrees": [bare_ok, min(args.check, len(prompts))],
        "info": info,
        "host": {
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "load_before": load_before,
            "load_after": os.getloadavg(),
        },
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
