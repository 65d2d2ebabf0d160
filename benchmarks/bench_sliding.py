"""Sliding-window layers keep only their windows (``sliding_windows=True``, docs/sliding.md): bytes per cached token
and the hit rate of a multi-tenant chat at a fixed pool, against the same pool keeping every layer whole.

    python benchmarks/bench_sliding.py [--model small-swa] [--prefix 8192] [--system 4000] [--tenants 4]
                                       [--users 1] [--turns 2] [--pool-tokens 8192] [--json FILE]

- Bytes per cached token: one ``--prefix``-token prompt is cached; keeping it servable takes its full layers' blocks
  and the window slots its points hold; while slots are spare its other blocks' windows stay too, idle (taken
  first when slots are needed), reported beside. Today's pool holds every layer of every block (the layout is
  exact, so today's figure is computed from it, not run).
- Multi-tenant chat: ``--tenants`` system prompts of ``--system`` tokens, ``--users`` chats each of ``--turns``
  turns (a 64-token user message, an 8-token greedy reply, the history re-sent), interleaved across tenants, each
  request hinted at its system prompt's end as ``serve`` hints a chat. The pool is the bytes that hold
  ``--pool-tokens`` tokens today (``max_cached_bytes``), both runs. Token hit rate of each; replies of the two runs
  must be equal (each equals the bare model's: tests/test_sliding.py). Windows pay where prefixes are long
  against the window: a point's window (512 tokens of 10 layers on small-swa) costs what 2,560 tokens of the
  full layers do.
- Concurrency (``--concurrent K``): the paged engine given a pool of ``--engine-pool-tokens`` tokens' bytes today
  and K requests of ``--prefix`` distinct tokens each, decoding ``--decode`` tokens (long enough that every
  request could be admitted before the first finishes): the most requests decoding at once (each holding its
  whole context), the most admitted at once, preemptions, and whether the greedy replies of the two runs are equal.
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
from engine.batching.offline import sampling_params
from engine.batching.request import Request
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
    """What the pool holds now: full-layer blocks, window slots held (by points) and idle, and their bytes."""
    rt = pcm.runtime
    dtype, bs = rt.model.dtype, rt.block_size
    layers = frozenset() if rt.window is None else rt.window[1]
    full = bytes_per_token([s for i, s in enumerate(rt.specs) if i not in layers], dtype) * bs
    win = bytes_per_token([s for i, s in enumerate(rt.specs) if i in layers], dtype) * bs
    blocks = pcm.cache.num_cached_blocks
    ws = pcm.cache.windows
    held = 0 if ws is None else ws.num_held
    idle = 0 if ws is None else ws.num_idle
    return {
        "blocks": blocks,
        "window_slots_held": held,
        "window_slots_idle": idle,
        "bytes": blocks * (full if ws is not None else full + win) + held * win,
        "bytes_with_idle": blocks * (full if ws is not None else full + win) + (held + idle) * win,
        "bytes_per_block_all_layers": full + win,
    }


def bytes_per_cached_token(model: Any, prefix: int, seed: int) -> dict[str, Any]:
    """One prefix cached: what keeping it servable takes (its full blocks and the windows its points hold), what it
    occupies while slots are spare (idle windows of its other blocks too), and today's."""
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
        "window_slots_held": held["window_slots_held"],
        "window_slots_idle": held["window_slots_idle"],
        "bytes": held["bytes"],
        "today_bytes": today,
        "bytes_per_token": held["bytes"] / cached_tokens,
        "bytes_per_token_with_idle": held["bytes_with_idle"] / cached_tokens,
        "today_bytes_per_token": today / cached_tokens,
        "ratio": held["bytes"] / today,
        "ratio_with_idle": held["bytes_with_idle"] / today,
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


def concurrency(model: Any, args: argparse.Namespace, windows: bool, budget: int) -> dict[str, Any]:
    """K distinct long prompts through the engine at once: how many are resident together."""
    gen = torch.Generator().manual_seed(args.seed + 1)
    prompts = [_tokens(gen, args.prefix) for _ in range(args.concurrent)]
    pcm = PrefixCachedModel(model, sliding_windows=windows, max_cached_bytes=budget)
    engine = pcm.runtime.engine()
    assert engine is not None, pcm.engine_unsupported_reason
    params = sampling_params(model.generation_config, {"max_new_tokens": args.decode, "do_sample": False}, 0)
    reqs = [Request(f"r{i}", list(p), pcm.runtime.namespace("default"), params) for i, p in enumerate(prompts)]
    for r in reqs:
        engine.submit(r)
    most = decoding = steps = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        while engine.has_work() and time.perf_counter() - t0 < args.max_seconds:
            engine.step()
            steps += 1
            most = max(most, engine.num_running)
            decoding = max(decoding, sum(1 for r in engine.scheduler.running if r.output))
    done = all(r.status.name == "FINISHED" for r in reqs)
    pcm.cache.check_integrity()
    ws = pcm.cache.windows
    return {
        "sliding_windows": windows,
        "pool_blocks": pcm.cache.num_blocks,
        "window_slots": 0 if ws is None else ws.capacity,
        "most_resident": most,  # admitted at once (a request admits with its first chunk's blocks)
        "most_decoding": decoding,  # decoding at once: each holding its whole context
        "preemptions": engine.stats.preemptions,
        "steps": steps,
        "finished": done,
        "seconds": time.perf_counter() - t0,
        "replies": [list(r.output) for r in reqs],
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
    ap.add_argument("--concurrent", type=int, default=5)
    ap.add_argument("--engine-pool-tokens", type=int, default=2 * 8192 + 512)
    ap.add_argument("--decode", type=int, default=224)
    ap.add_argument("--max-seconds", type=float, default=900.0)
    ap.add_argument("--skip", nargs="*", default=[], choices=["memory", "chat", "concurrency"])
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
    path = Path(args.json)
    payload: dict[str, Any] = json.loads(path.read_text()) if args.skip and path.exists() else {}
    payload.update(
        model=args.model,
        window={"kind": rule.kind, "tokens": rule.tokens, "layers": len(layers), "of": len(rt.specs)},
        settings={k: v for k, v in vars(args).items() if k not in ("json", "skip")},
    )
    if "memory" not in args.skip:
        memory = bytes_per_cached_token(model, args.prefix, args.seed)
        print(
            f"bytes per cached token of a {args.prefix}-token prefix: {memory['bytes_per_token']:,.0f} "
            f"(today {memory['today_bytes_per_token']:,.0f}): {memory['ratio']:.3f}x"
        )
        payload["memory"] = memory
    if "chat" not in args.skip:
        whole = chat(model, args, False, budget)
        windows = chat(model, args, True, budget)
        equal = whole["replies"] == windows["replies"]
        ratio = windows["token_hit_rate"] / whole["token_hit_rate"] if whole["token_hit_rate"] else None
        print(
            f"multi-tenant chat at {budget / 2**20:.1f} MiB: token hit rate {windows['token_hit_rate']:.3f} with "
            f"windows, {whole['token_hit_rate']:.3f} whole ({'no hits whole' if ratio is None else f'{ratio:.2f}x'}); "
            f"replies equal: {equal}"
        )
        payload["chat"] = {
            "pool_bytes_budget": budget,
            "whole": {k: v for k, v in whole.items() if k != "replies"},
            "windows": {k: v for k, v in windows.items() if k != "replies"},
            "hit_rate_ratio": ratio,  # None: no hits whole
            "replies_equal": equal,
        }
    if "concurrency" not in args.skip:
        engine_budget = args.engine_pool_tokens * per_token
        c_whole = concurrency(model, args, False, engine_budget)
        c_win = concurrency(model, args, True, engine_budget)
        print(
            f"engine, {args.concurrent} requests of {args.prefix} tokens in {engine_budget / 2**20:.0f} MiB: "
            f"{c_win['most_decoding']} decoding at once with windows, {c_whole['most_decoding']} whole; "
            f"replies equal: {c_win['replies'] == c_whole['replies']}"
        )
        payload["concurrency"] = {
            "pool_bytes_budget": engine_budget,
            "whole": {k: v for k, v in c_whole.items() if k != "replies"},
            "windows": {k: v for k, v in c_win.items() if k != "replies"},
            "resident_ratio": c_win["most_resident"] / max(1, c_whole["most_resident"]),
            "decoding_ratio": c_win["most_decoding"] / max(1, c_whole["most_decoding"]),
            "replies_equal": c_win["replies"] == c_whole["replies"],
        }
    payload["meta"] = _meta.end(meta)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
