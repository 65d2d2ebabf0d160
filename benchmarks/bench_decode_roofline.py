"""Decode steps against this machine's memory bandwidth: how close the engine's decode comes to the roofline.

    python benchmarks/bench_decode_roofline.py [--model small] [--rows 8] [--context 1024] [--steps 24]
                                               [--dtypes float32 bfloat16] [--json FILE]

A decode step reads every weight of the model once and each row's cached K/V; at batch sizes a server runs, that
traffic, not the arithmetic, bounds it. This measures, in one run:

- the achievable bandwidth, STREAM-style (``_roofline.stream_gbs``: a sum over and a copy of a 1 GiB array, on
  torch's threads), before and after the decode runs: the better of the two (the shared host's bandwidth drifts);
- in the serving process's malloc (``engine.malloc``), per dtype, ``--rows`` requests of ``--context`` distinct tokens through the engine until all decode, then
  ``--steps`` decode-only steps: the forward's time per step, the bytes it must read (``_roofline.decode_bytes``:
  weights + K/V), and their ratio as GB/s and as a fraction of the measured read bandwidth; and the step's parts:
  attention over the pool (``EngineStats.attention_s``: the K/V write and the kernel) against the K/V bytes, the
  packed linears (timed around each call) against the weights' bytes, and the rest (the modeling code's other ops,
  sampling, bookkeeping).

No peer runs here: vLLM's step rate on the same shape comes from ``benchmarks/serve_peers.py`` (its README says
how). Writes JSON (``benchmarks/results/decode_roofline.json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _meta
from _roofline import decode_bytes, stream_gbs
from engine import PrefixCachedModel
from engine.batching.offline import sampling_params
from engine.batching.request import Request
from engine.kv_pool import bytes_per_token
from engine.malloc import keep_freed_memory
from engine.paged import kernel, linear


def decode(args: argparse.Namespace, dtype: str) -> dict[str, Any]:
    """``--rows`` requests decoding together: the forward's seconds per decode step and the bytes it reads."""
    torch_dtype = getattr(torch, dtype)
    tokens = args.rows * (args.context + args.steps + 64)
    pcm = PrefixCachedModel.from_pretrained(args.model, dtype=torch_dtype, max_cached_tokens=tokens)
    model = pcm.model
    engine = pcm.runtime.engine()
    assert engine is not None, pcm.engine_unsupported_reason
    gen = torch.Generator().manual_seed(0)
    new = args.steps + 4
    params = dataclasses.replace(  # every row decodes all its steps
        sampling_params(model.generation_config, {"max_new_tokens": new, "do_sample": False}, 0), ignore_eos=True
    )
    ns = pcm.runtime.namespace("default")
    reqs = [
        Request(f"r{i}", torch.randint(3, 259, (args.context,), generator=gen).tolist(), ns, params)
        for i in range(args.rows)
    ]
    for r in reqs:
        engine.submit(r)
    spent = {"linears": 0.0}
    packed = linear._packed_forward

    def timed(weight: torch.Tensor, bias: torch.Tensor | None) -> Any:  # the packed linears, timed
        forward = packed(weight, bias)

        def run(x: torch.Tensor) -> torch.Tensor:
            t0 = time.perf_counter()
            y = forward(x)
            spent["linears"] += time.perf_counter() - t0
            return y

        return run

    linear._packed_forward = timed
    try:
        with torch.inference_mode():
            while not all(r.output for r in reqs):  # prefill until every row decodes
                engine.step()
            engine.step()  # one decode step of all rows as a warm-up
            times, kv_tokens, attn, lin = [], [], [], []
            for _ in range(args.steps):
                before, att0, lin0 = engine.stats.forward_s, engine.stats.attention_s, spent["linears"]
                kv_tokens.append(sum(r.computed for r in reqs))
                engine.step()
                times.append(engine.stats.forward_s - before)
                attn.append(engine.stats.attention_s - att0)
                lin.append(spent["linears"] - lin0)
    finally:
        linear._packed_forward = packed
    per_token = bytes_per_token(pcm.runtime.specs, torch_dtype)
    moved = [decode_bytes(model, kv, per_token)["total"] for kv in kv_tokens]
    gbs = [b / t / 1e9 for b, t in zip(moved, times)]
    parts = decode_bytes(model, int(statistics.median(kv_tokens)), per_token)
    attn_s, lin_s = statistics.median(attn), statistics.median(lin)
    return {
        "dtype": dtype,
        "rows": args.rows,
        "context": args.context,
        "c_kernel": bool(engine.runner.use_kernel and kernel.load() is not None),  # else the torch path
        "step_ms": 1e3 * statistics.median(times),
        # the step's parts: attention over the pool (the K/V write included) and the linears (the weights), medians
        "attention_ms": 1e3 * attn_s,
        "attention_gbs": parts["kv"] / attn_s / 1e9,
        "linears_ms": 1e3 * lin_s,
        "linears_gbs": parts["weights"] / lin_s / 1e9,
        "rest_ms": 1e3 * (statistics.median(times) - attn_s - lin_s),
        "weights_bytes": parts["weights"],
        "kv_bytes": parts["kv"],
        "bytes_per_step": parts["total"],
        "gbs": statistics.median(gbs),
        "tokens_per_s": args.rows / statistics.median(times),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--json", default=str(Path(__file__).parent / "results" / "decode_roofline.json"))
    args = ap.parse_args()
    meta = _meta.begin()
    malloc_kept = keep_freed_memory()  # as `prefixcache serve` runs (engine.malloc)
    warnings.simplefilter("ignore")
    before = stream_gbs()
    print(f"memory bandwidth here: read {before['read']:.1f} GB/s, copy {before['copy']:.1f} GB/s")
    rows = []
    for dtype in args.dtypes:
        t0 = time.perf_counter()
        rows.append(decode(args, dtype))
        print(f"{dtype}: {rows[-1]['step_ms']:.1f} ms per step ({time.perf_counter() - t0:.0f} s)")
    after = stream_gbs()
    # the shared host's bandwidth drifts within a run: the best of the two samples is what it can deliver
    bandwidth = {k: max(before[k], after[k]) for k in ("read", "copy")} | {"before": before, "after": after}
    print(f"memory bandwidth after: read {after['read']:.1f} GB/s, copy {after['copy']:.1f} GB/s")
    for r in rows:
        r["fraction_of_read_bandwidth"] = r["gbs"] / bandwidth["read"]
        for part in ("attention", "linears"):
            r[f"{part}_fraction"] = r[f"{part}_gbs"] / bandwidth["read"]
        print(
            f"{r['dtype']}: {r['step_ms']:.1f} ms per decode step of {args.rows} rows x {args.context} tokens, "
            f"{r['bytes_per_step'] / 1e6:.0f} MB read ({r['weights_bytes'] / 1e6:.0f} weights + "
            f"{r['kv_bytes'] / 1e6:.0f} K/V): {r['gbs']:.1f} GB/s = {r['fraction_of_read_bandwidth']:.0%} of the "
            f"read bandwidth ({bandwidth['read']:.1f} GB/s, the better of before and after); of which attention "
            f"{r['attention_ms']:.1f} ms ({r['attention_fraction']:.0%} of it on the K/V), linears {r['linears_ms']:.1f} "
            f"ms ({r['linears_fraction']:.0%} on the weights), the rest {r['rest_ms']:.1f} ms"
        )
    payload = {
        "model": args.model,
        "bandwidth": bandwidth,
        "decode": rows,
        "settings": vars(args),
        "malloc_kept": malloc_kept,
    }
    payload["meta"] = _meta.end(meta)
    Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
