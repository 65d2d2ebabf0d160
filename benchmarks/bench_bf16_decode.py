"""bf16 decoding rows on the engine's torch path: one query or the same query twice, for speed and for exactness.

    python benchmarks/bench_bf16_decode.py [--model small] [--contexts 512 2048 4096] [--prompts 300 1000 1700 2500]
                                           [--steps 32] [--json FILE]

A bf16 decoding row's attention runs torch's SDPA over the row's gathered K/V (the C kernel is fp32 only). Torch's
CPU flash attention takes a slow path for a single bf16 query; the same query twice takes the fast one with the
same arithmetic but for the order of some fp32 sums (``engine.paged.attention.TWO_QUERIES_BF16``, used in steps of
several rows only). This measures, in one run:

- ``sdpa``: one layer's SDPA of one row (the model's heads and head dim), one query against the query twice, median
  of 31 calls per context, and how many outputs differ and by how much;
- ``logits``: the engine's logits against the bare bf16 model's own decoding (a ``DynamicCache``, one token at a
  time) over ``--steps`` greedy steps after each prompt of ``--prompts`` random tokens: the row alone in its step,
  beside a second row with one query (``TWO_QUERIES_BF16`` off) and with the query twice (on); the largest
  |difference| relative to the largest |logit|, and the steps whose argmax differs. Beside a second row the linears
  compute two rows at once, which already moves the logits by bf16 rounding; the question is whether the query
  twice adds to that;
- ``step``: one engine step of 7 decoding rows of 2,000 tokens and a 249-token prefill chunk (its prompt 3,000
  tokens): ms per step, bf16 with the query twice and once, and fp32 (the C kernel), medians of 6 steps.

Writes JSON (``benchmarks/results/bf16_decode.json``).
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
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import _meta  # noqa: E402
from engine import PrefixCachedModel  # noqa: E402
from engine.batching.offline import sampling_params  # noqa: E402
from engine.batching.request import Request  # noqa: E402
from engine.malloc import keep_freed_memory  # noqa: E402
from engine.models import build_preset  # noqa: E402
from engine.paged import attention  # noqa: E402
from engine.paged.attention import Row  # noqa: E402
from engine.paged.runner import PagedRunner  # noqa: E402


def _median_ms(fn: Any, n: int = 31) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def sdpa(heads: int, dim: int, contexts: list[int]) -> list[dict[str, Any]]:
    """One row's SDPA, one query against the query twice, per context."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for ctx in contexts:
        q = torch.randn((1, heads, 1, dim), generator=gen).bfloat16()
        k = (torch.randn((1, heads, ctx, dim), generator=gen) * 2).bfloat16()
        v = torch.randn((1, heads, ctx, dim), generator=gen).bfloat16()
        mask = torch.ones((1, ctx), dtype=torch.bool)
        two = torch.cat([q, q], dim=2)
        one_out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        two_out = F.scaled_dot_product_attention(two, k, v, attn_mask=mask.expand(2, -1))[:, :, :1]
        rows.append(
            {
                "context": ctx,
                "one_query_ms": _median_ms(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)),
                "two_queries_ms": _median_ms(
                    lambda: F.scaled_dot_product_attention(torch.cat([q, q], dim=2), k, v, attn_mask=mask.expand(2, -1))
                ),
                "outputs": one_out.numel(),
                "outputs_differing": int((one_out != two_out).sum()),
                "max_abs_diff": float((one_out.float() - two_out.float()).abs().max()),
            }
        )
    return rows


def logits(model_name: str, prompts: list[int], steps: int) -> list[dict[str, Any]]:
    """The engine's decoding logits against the bare bf16 model's, alone and beside a second row."""
    model, _ = build_preset(model_name, dtype=torch.bfloat16)
    pcm = PrefixCachedModel(model, max_cached_tokens=2 * (max(prompts) + steps + 32))
    runner = PagedRunner(model, pcm.pool)
    vocab = int(model.config.vocab_size)
    gen = torch.Generator().manual_seed(0)
    out = []
    for n in prompts:
        ids = torch.randint(3, min(vocab, 259), (n,), generator=gen)
        other = torch.randint(3, min(vocab, 259), (n,), generator=gen)
        nb = -(-(n + steps + 1) // pcm.pool.block_size)
        mine, theirs = list(range(nb)), list(range(nb, 2 * nb))
        for case, beside, two in (
            ("alone", False, True),
            ("beside, one query", True, False),
            ("beside, twice", True, True),
        ):
            attention.TWO_QUERIES_BF16 = two
            try:
                worst, flips = 0.0, 0
                with torch.inference_mode():
                    runner.forward(runner.batch([Row(0, n, n, mine)]), ids, torch.tensor([n - 1]))
                    if beside:
                        runner.forward(runner.batch([Row(0, n, n, theirs)]), other, torch.tensor([n - 1]))
                    ref_out = model(input_ids=ids[None], use_cache=True)
                    cache, ref = ref_out.past_key_values, ref_out.logits[0, -1]
                    tok = int(ref.argmax())
                    for i in range(steps):
                        rows = [Row(0, 1, n + i + 1, mine)] + ([Row(1, 1, n + i + 1, theirs)] if beside else [])
                        feed = torch.tensor([tok, 5][: len(rows)])
                        got = runner.forward(runner.batch(rows), feed, torch.tensor([0]))[0].float()
                        step = model(input_ids=torch.tensor([[tok]]), past_key_values=cache, use_cache=True)
                        cache, ref = step.past_key_values, step.logits[0, -1].float()
                        worst = max(worst, float((got - ref).abs().max() / ref.abs().max()))
                        flips += int(got.argmax()) != int(ref.argmax())
                        tok = int(ref.argmax())  # both follow the bare model's tokens
            finally:
                attention.TWO_QUERIES_BF16 = True
            out.append({"prompt": n, "case": case, "max_rel_diff": worst, "argmax_differs": flips, "steps": steps})
            print(f"  logits: prompt {n:5d} {case:18s} max rel diff {worst:.2e}, argmax differs {flips}/{steps}")
    return out


def step(model_name: str) -> list[dict[str, Any]]:
    """ms per engine step: 7 decoding rows of 2,000 tokens beside a prefill chunk (medians of 6 steps)."""
    out = []
    for dtype, two in (("bfloat16", True), ("bfloat16", False), ("float32", True)):
        attention.TWO_QUERIES_BF16 = two
        try:
            pcm = PrefixCachedModel.from_pretrained(model_name, dtype=getattr(torch, dtype), max_cached_tokens=40_000)
            engine = pcm.runtime.engine()
            assert engine is not None, pcm.engine_unsupported_reason
            gen = torch.Generator().manual_seed(0)
            params = dataclasses.replace(
                sampling_params(pcm.model.generation_config, {"max_new_tokens": 400, "do_sample": False}, 0),
                ignore_eos=True,
            )
            ns = pcm.runtime.namespace("default")
            rows = [
                Request(f"d{i}", torch.randint(3, 259, (2000,), generator=gen).tolist(), ns, params) for i in range(7)
            ]
            for r in rows:
                engine.submit(r)
            times = []
            with torch.inference_mode():
                while not all(r.output for r in rows):
                    engine.step()
                engine.submit(Request("p", torch.randint(3, 259, (3000,), generator=gen).tolist(), ns, params))
                engine.step()
                for _ in range(6):
                    before = engine.stats.forward_s
                    engine.step()
                    times.append(engine.stats.forward_s - before)
        finally:
            attention.TWO_QUERIES_BF16 = True
        ms = statistics.median(times) * 1e3
        out.append({"dtype": dtype, "two_queries": two if dtype == "bfloat16" else None, "step_ms": ms})
        print(f"  step: {dtype} {'query twice' if two else 'one query'}: {ms:.1f} ms")
        del pcm, engine
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 4096])
    ap.add_argument("--prompts", type=int, nargs="+", default=[300, 1000, 1700, 2500])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--json", default=str(ROOT / "benchmarks/results/bf16_decode.json"))
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    keep_freed_memory()
    model, _ = build_preset(args.model)
    heads, dim = model.config.num_attention_heads, model.config.hidden_size // model.config.num_attention_heads
    del model
    meta = _meta.begin()
    result: dict[str, Any] = {"args": vars(args)}
    result["sdpa"] = sdpa(heads, dim, args.contexts)
    for r in result["sdpa"]:
        print(
            f"  sdpa: {r['context']:5d} keys: one query {r['one_query_ms']:.3f} ms, twice {r['two_queries_ms']:.3f} ms; "
            f"{r['outputs_differing']}/{r['outputs']} outputs differ (max {r['max_abs_diff']:.1e})"
        )
    result["logits"] = logits(args.model, args.prompts, args.steps)
    result["step"] = step(args.model)
    result["logits_worst"] = {  # per case, the largest relative difference over all prompts
        key: max(r["max_rel_diff"] for r in result["logits"] if r["case"] == case)
        for key, case in (("alone", "alone"), ("beside_one", "beside, one query"), ("beside_twice", "beside, twice"))
    }
    result = {"meta": _meta.end(meta), **result}
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
