"""Sliding-window layers keep only their windows (``sliding_windows=True``, docs/sliding.md): bytes per cached token
and the hit rate of a multi-tenant chat at a fixed pool, against the same pool keeping every layer whole.

    python benchmarks/bench_sliding.py [--model small-swa] [--prefix 8192] [--system 4000] [--tenants 4]
                                       [--users 1] [--turns 2] [--pool-tokens 8192] [--json FILE]

- Bytes per cached token: one ``--prefix``-token prompt is cached; the pool then holds its full layers' blocks and
  the window slots of the points it kept. Today's pool holds every layer of every block (the layout is exact, so
  today's figure is computed from it, not run).
- Multi-tenant chat: ``--tenants`` system prompts of ``--system`` tokens, ``--users`` chats each of ``--turns``
  turns (a 64-token user message, an 8-token greedy reply, the history re-sent), interleaved across tenants, each
  request hinted at its system prompt's end as ``serve`` hints a chat. The pool is the bytes that hold
  ``--pool-tokens`` tokens today (``max_cached_bytes``), both runs. Token hit rate of each; replies of the two runs
  must be equal (each equals the bare model's: tests/test_sliding.py). Windows pay where prefixes are long
  against the window: a point's window (512 tokens of 10 layers on small-swa) costs what 2,560 tokens of the
  full layers do.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _meta
from engine import PrefixCachedModel
from engine.kv_pool import bytes_per_token
from engine.models import load_model


def _tokens(gen: torch.Generator, n: int) -> list[int]:
    return torch.randint(3, 259, (n,), generator=gen).tolist()


def _generate(pcm: PrefixCachedModel, prompt: list[int], hint: int, new: int) -> tuple[list[int], int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = pcm.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            snapshot_hints=[hint] if hint else None,
        )
    return out[0, len(prompt) :].tolist(), pcm.last_request_stats[0].cached_tokens


def held_bytes(pcm: PrefixCachedModel) -> dict[str, Any]:
    """What the pool holds now: full-layer blocks, window slots, and their bytes."""
    rt = pcm.runtime
    dtype, bs = rt.model.dtype, rt.block_size
    layers = frozenset() if rt.window is None else rt.window[1]
    full = bytes_per_token([s for i, s in enumerate(rt.specs) if i not in layers], dtype) * bs
    win = bytes_per_token([s for i, s in enumerate(rt.specs) if i in layers], dtype) * bs
    blocks = pcm.cache.num_cached_blocks
    ws = pcm.cache.windows
    slots = 0 if ws is None else ws.capacity - ws.num_free
    return {
        "blocks": blocks,
        "window_slots": slots,
        "bytes": blocks * (full if ws is not None else full + win) + slots * win,
        "bytes_per_block_all_layers": full + win,
    }


def bytes_per_cached_token(model: Any, prefix: int, seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    prompt = _tokens(gen, prefix)
    pcm = PrefixCachedModel(model, sliding_windows=True, max_cached_tokens=2 * prefix)
    t0 = time.perf_counter()
    _generate(pcm, prompt, 0, 1)
    held = held_bytes(pcm)
    cached_tokens = held["blocks"] * pcm.block_size
    today = held["blocks"] * held["bytes_per_block_all_layers"]
    return {
        "prefix_tokens": prefix,
        "cached_tokens": cached_tokens,
        "window_slots": held["window_slots"],
        "bytes": held["bytes"],
        "today_bytes": today,
        "bytes_per_token": held["bytes"] / cached_tokens,
        "today_bytes_per_token": today / cached_tokens,
        "ratio": held["bytes"] / today,
        "seconds": time.perf_counter() - t0,
    }


def chat(model: Any, args: argparse.Namespace, windows: bool, budget: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(args.seed)
    systems = [_tokens(gen, args.system) for _ in range(args.tenants)]
    users = [(t, u) for u in range(args.users) for t in range(args.tenants)]
    messages = {(t, u): [_tokens(gen, 64) for _ in range(args.turns)] for t, u in users}
    pcm = PrefixCachedModel(model, sliding_windows=windows, max_cached_bytes=budget)
    history: dict[tuple[int, int], list[int]] = {k: list(systems[k[0]]) for k in users}
    replies: list[list[int]] = []
    prompt_tokens = cached = 0
    t0 = time.perf_counter()
    for turn in range(args.turns):
        for key in users:
            prompt = history[key] + messages[key][turn]
            reply, hit = _generate(pcm, prompt, args.system, 8)
            replies.append(reply)
            history[key] = prompt + reply
            prompt_tokens += len(prompt)
            cached += hit
            print(
                f"  {'windows' if windows else 'whole  '} turn {turn} tenant {key[0]} user {key[1]}: "
                f"{hit}/{len(prompt)} cached",
                file=sys.stderr,
            )
    pcm.cache.check_integrity()
    return {
        "sliding_windows": windows,
        "pool_blocks": pcm.cache.num_blocks,
        "window_slots": 0 if pcm.cache.windows is None else pcm.cache.windows.capacity,
        "pool_bytes": pcm.pool.nbytes,
        "requests": len(replies),
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached,
        "token_hit_rate": cached / prompt_tokens,
        "seconds": time.perf_counter() - t0,
        "replies": replies,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small-swa")
    ap.add_argument("--prefix", type=int, default=8192)
    ap.add_argument("--system", type=int, default=4000)
    ap.add_argument("--tenants", type=int, default=4)
    ap.add_argument("--users", type=int, default=1)
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--pool-tokens", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=str(Path(__file__).parent / "results" / "sliding.json"))
    args = ap.parse_args()
    meta = _meta.begin(peers=("transformers",))
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model, _ = load_model(args.model)
    rt = PrefixCachedModel(model, sliding_windows=True, max_cached_tokens=1024).runtime
    if rt.window is None:
        raise SystemExit(f"{args.model} has no sliding-window or chunked layers")
    rule, layers = rt.window
    per_token = bytes_per_token(rt.specs, model.dtype)
    budget = args.pool_tokens * per_token
    memory = bytes_per_cached_token(model, args.prefix, args.seed)
    print(
        f"bytes per cached token of a {args.prefix}-token prefix: {memory['bytes_per_token']:,.0f} "
        f"(today {memory['today_bytes_per_token']:,.0f}): {memory['ratio']:.3f}x"
    )
    whole = chat(model, args, False, budget)
    windows = chat(model, args, True, budget)
    equal = whole["replies"] == windows["replies"]
    ratio = (
        windows["token_hit_rate"] / whole["token_hit_rate"] if whole["token_hit_rate"] else None
    )  # None: 0 hits whole
    print(
        f"multi-tenant chat at {budget / 2**20:.1f} MiB: token hit rate {windows['token_hit_rate']:.3f} with windows, "
        f"{whole['token_hit_rate']:.3f} whole ({'no hits whole' if ratio is None else f'{ratio:.2f}x'}); "
        f"replies equal: {equal}"
    )
    payload = {
        "model": args.model,
        "window": {"kind": rule.kind, "tokens": rule.tokens, "layers": len(layers), "of": len(rt.specs)},
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "memory": memory,
        "chat": {
            "pool_bytes_budget": budget,
            "whole": {k: v for k, v in whole.items() if k != "replies"},
            "windows": {k: v for k, v in windows.items() if k != "replies"},
            "hit_rate_ratio": ratio,
            "replies_equal": equal,
        },
        "meta": _meta.end(meta),
    }
    Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
