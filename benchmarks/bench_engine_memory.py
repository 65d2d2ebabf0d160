"""KV memory of 8 running requests that share a 2,048-token prefix: the engine against the batched generate.

    python benchmarks/bench_engine_memory.py [--rows 8] [--prefix 2048] [--suffix 64] [--new 32] [--model small]
                                             [--json FILE]

Both start with the prefix cached (one warm-up request), then run the rows together:
- ``engine``: ``PrefixCachedModel.generate_batch`` (continuous batching; the pool IS the running requests' KV: every
  row's block table starts with the same cached prefix blocks, each row owns only its suffix and output blocks);
- ``batched generate``: ``PrefixCachedModel.generate`` on the left-padded batch (what ``prefixcache serve`` ran
  before the engine: every row's prefix gathered from the pool into a per-row buffer, [rows, heads, width, dim]
  per layer and side).
Reported per method, each in a fresh process: the KV bytes the running rows hold beyond the pool (per-row buffers),
the distinct pool blocks they reference at the peak step and what per-row copies of those tables would take, and
the process's peak resident memory over its resident memory before the rows ran (VmHWM - VmRSS, /proc).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _meta


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> None:
    """Reset VmHWM to the current RSS (Linux: write 5 to clear_refs)."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def _setup(args: argparse.Namespace) -> tuple[Any, list[list[int]], int]:
    """A wrapper on a fresh model with the shared prefix cached, the rows, and KV bytes per token."""
    import torch

    from engine import PrefixCachedModel
    from engine.kv_pool import bytes_per_token
    from engine.models import load_model

    torch.set_num_threads(os.cpu_count() or 1)
    model, _ = load_model(args.model)
    model.generation_config.eos_token_id = None
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, 256, (args.prefix,), generator=gen).tolist()
    rows = [prefix + torch.randint(0, 256, (args.suffix,), generator=gen).tolist() for _ in range(args.rows)]
    pool_tokens = (args.prefix + args.rows * (args.suffix + args.new)) * 2
    pcm = PrefixCachedModel(model, max_cached_tokens=pool_tokens, block_size=16)
    pcm.generate(torch.tensor([prefix + [1]]), max_new_tokens=1, do_sample=False)  # the prefix is cached
    return pcm, rows, bytes_per_token(pcm.runtime.specs, model.dtype)


def child_engine(args: argparse.Namespace) -> dict[str, Any]:
    from engine.batching.offline import generate_requests

    pcm, rows, per_token = _setup(args)
    per_block = per_token * pcm.block_size
    eng = pcm.engine()
    assert eng is not None
    rss0 = _status("VmRSS")
    _reset_peak()
    reqs = [r for _, r in generate_requests(rows, [_params(args.new)] * len(rows), pcm.runtime.namespace("default"), 1)]
    with pcm.lock:
        for r in reqs:
            eng.submit(r)
        peak_distinct = peak_tables = 0
        while eng.has_work():
            eng.step()
            tables = [r.table for r in eng.scheduler.running]
            distinct = len({b for t in tables for b in t})
            if distinct > peak_distinct:
                peak_distinct, peak_tables = distinct, sum(len(t) for t in tables)
    return {
        "method": "engine",
        "pool_bytes": pcm.pool.nbytes,
        "kv_bytes_per_token": per_token,
        "extra_kv_bytes": 0,
        "peak_distinct_blocks": peak_distinct,
        "peak_distinct_bytes": peak_distinct * per_block,
        "per_row_copies_bytes": peak_tables * per_block,
        "peak_rss_growth": _status("VmHWM") - rss0,
        "cached_tokens": [r.cached_tokens for r in reqs],
    }


def _params(new: int):
    from engine.batching.sampling import SamplingParams

    return SamplingParams(max_tokens=new)


def child_batched(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    pcm, rows, per_token = _setup(args)
    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = 1
    rss0 = _status("VmRSS")
    _reset_peak()
    res = pcm.generate(ids, attention_mask=mask, max_new_tokens=args.new, do_sample=False)
    assert res.shape[1] == width + args.new
    buffers = sum(t.numel() * t.element_size() for pair in pcm.pool._scratch for t in pair if t is not None)
    return {
        "method": "batched generate",
        "pool_bytes": pcm.pool.nbytes,
        "kv_bytes_per_token": per_token,
        "extra_kv_bytes": buffers,
        "per_row_copies_bytes": len(rows) * (width + args.new) * per_token,
        "peak_rss_growth": _status("VmHWM") - rss0,
        "cached_tokens": [r.cached_tokens for r in pcm.last_request_stats],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--suffix", type=int, default=64)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--child", choices=["engine", "batched"], default=None)
    args = ap.parse_args()
    if args.child == "engine":
        print(json.dumps(child_engine(args)))
        return
    if args.child == "batched":
        print(json.dumps(child_batched(args)))
        return
    meta = _meta.begin()
    results = []
    for which in ("engine", "batched"):
        cmd = [sys.executable, __file__, "--child", which, "--model", args.model, "--rows", str(args.rows)]
        cmd += ["--prefix", str(args.prefix), "--suffix", str(args.suffix), "--new", str(args.new)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    mib = 1 << 20
    print(
        f"{args.rows} rows sharing a {args.prefix}-token prefix (+{args.suffix} own, {args.new} new), {args.model}:\n"
    )
    print(
        "| method | pool | KV held beyond the pool | per-row copies would be | distinct pool blocks in use | peak RSS growth |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        distinct = f"{r['peak_distinct_bytes'] / mib:,.0f} MiB" if "peak_distinct_bytes" in r else "-"
        print(
            f"| {r['method']} | {r['pool_bytes'] / mib:,.0f} MiB | {r['extra_kv_bytes'] / mib:,.0f} MiB | "
            f"{r['per_row_copies_bytes'] / mib:,.0f} MiB | {distinct} | {r['peak_rss_growth'] / mib:,.0f} MiB |"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {"meta": _meta.end(meta), "args": vars(args) | {"json": str(args.json)}, "results": results}
        args.json.write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
