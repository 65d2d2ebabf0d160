"""bf16 decoding rows (and prefill chunks): the C kernel over the bf16 pool, or torch's SDPA of one query or of the
query twice, for speed and for exactness.

    python benchmarks/bench_bf16_decode.py [--model small] [--contexts 512 2048 4096] [--prompts 300 1000 1700 2500]
                                           [--steps 32] [--json FILE]

In a step of several rows a bf16 decoding row goes through the C kernel (``engine.paged.attention.KERNEL_BF16``),
which follows torch's flash-attention arithmetic; a row alone in its step runs torch's SDPA of its one query (the
bare model's call). Without the kernel, a row beside others runs SDPA on its query twice (``TWO_QUERIES_BF16``):
torch's CPU flash attention takes a slow path for a single bf16 query. This measures, in one run:

- ``sdpa``: one layer's attention of one row (the model's heads and head dim): SDPA of one query, of the query
  twice, and the kernel, medians of 31 calls per context, and how many outputs of the last two differ from the
  first's and by how much;
- ``logits``: the engine's logits against the bare bf16 model's own decoding (a ``DynamicCache``, one token at a
  time) over ``--steps`` greedy steps after each prompt of ``--prompts`` random tokens: the row alone in its step,
  and beside a second row by SDPA of one query, of the query twice, and by the kernel; the largest |difference|
  relative to the largest |logit|, and the steps whose argmax differs. Beside a second row the linears compute two
  rows at once, which already moves the logits by bf16 rounding; the question is whether the attention adds to it.
  The prompt's own logits (every position) are compared too: prefilled alone (SDPA, the bare model's call), or
  beside the second prompt in one step, by SDPA or by the kernel's bf16 prefill path (``PREFILL_BF16``); and the
  same for the fp32 model (``prompt_logits_f32``: beside the second prompt by SDPA or the fp32 prefill path);
- ``step``: one engine step of 7 decoding rows of 2,000 tokens and a 249-token prefill chunk (its prompt 3,000
  tokens): ms per step, bf16 by each path (the kernel with its prefill path, the kernel with the chunk by SDPA,
  SDPA twice, SDPA once), and fp32 (the C kernel with its prefill path, or with the chunk by SDPA), medians of 6
  steps.

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
from collections.abc import Iterator
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
from engine.kv_pool import KVPool, LayerSpec  # noqa: E402
from engine.malloc import keep_freed_memory  # noqa: E402
from engine.models import build_preset  # noqa: E402
from engine.paged import attention  # noqa: E402
from engine.paged.attention import Row, StepBatch, paged_attention, use_batch  # noqa: E402
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
    """One row's attention per context: SDPA of one query, of the query twice, and the C kernel (the row twice in
    one call, time halved; K/V in a bf16 pool), with how many outputs of the last two differ from the first's."""
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
        bs = 16
        pool = KVPool([LayerSpec((heads, dim), (heads, dim))], -(-ctx // bs), bs, dtype=torch.bfloat16, device="cpu")
        pair = pool.layer(0)
        assert pair is not None
        for side, src in zip(pair, (k, v)):
            side.view(heads, -1, dim)[:, :ctx] = src[0]
        table = list(range(-(-ctx // bs)))
        batch = StepBatch.make(pool, [Row(0, 1, ctx, table), Row(1, 1, ctx, table)])
        assert batch.kernel_rows == [0, 1], "the C kernel did not build here (no C compiler?)"
        batch.layer = 0

        def kern() -> torch.Tensor:
            with use_batch(batch):
                return paged_attention(torch.nn.Identity(), two, None, None, None)[0][0, :1].transpose(0, 1)[None]

        kernel_out = kern()
        rows.append(
            {
                "context": ctx,
                "one_query_ms": _median_ms(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)),
                "two_queries_ms": _median_ms(
                    lambda: F.scaled_dot_product_attention(torch.cat([q, q], dim=2), k, v, attn_mask=mask.expand(2, -1))
                ),
                "kernel_ms": _median_ms(kern) / 2,
                "outputs": one_out.numel(),
                "outputs_differing": int((one_out != two_out).sum()),
                "max_abs_diff": float((one_out.float() - two_out.float()).abs().max()),
                "kernel_outputs_differing": int((one_out != kernel_out).sum()),
                "kernel_max_abs_diff": float((one_out.float() - kernel_out.float()).abs().max()),
                "max_abs_output": float(one_out.float().abs().max()),
            }
        )
    return rows


def two_prompts(
    model_name: str, dtype: torch.dtype, prompts: list[int], steps: int
) -> tuple[Any, PagedRunner, int, Iterator[tuple[int, torch.Tensor, torch.Tensor]]]:
    """The preset in ``dtype``, a paged runner over a pool for two rows of each prompt plus ``steps``, its block
    size, and per prompt length (n, its tokens, a second prompt's)."""
    model, _ = build_preset(model_name, dtype=dtype)
    pcm = PrefixCachedModel(model, max_cached_tokens=2 * (max(prompts) + steps + 32))
    assert pcm.pool is not None
    vocab = int(model.config.vocab_size)
    gen = torch.Generator().manual_seed(0)
    pairs = (
        (
            n,
            torch.randint(3, min(vocab, 259), (n,), generator=gen),
            torch.randint(3, min(vocab, 259), (n,), generator=gen),
        )
        for n in prompts
    )
    return model, PagedRunner(model, pcm.pool), pcm.pool.block_size, pairs


def logits(model_name: str, prompts: list[int], steps: int) -> list[dict[str, Any]]:
    """The engine's decoding logits against the bare bf16 model's, alone and beside a second row."""
    model, runner, bs, pairs = two_prompts(model_name, torch.bfloat16, prompts, steps)
    out = []
    for n, ids, other in pairs:
        nb = -(-(n + steps + 1) // bs)
        mine, theirs = list(range(nb)), list(range(nb, 2 * nb))
        for case, beside, two, kern, prefill in (
            ("alone", False, True, True, "alone"),
            ("beside, one query", True, False, False, "alone"),
            ("beside, twice", True, True, False, "alone"),
            ("beside, kernel", True, True, True, "alone"),
            ("beside, kernel; prefill beside, SDPA", True, True, True, "sdpa"),
            ("beside, kernel; prefill beside, kernel", True, True, True, "kernel"),
        ):
            attention.TWO_QUERIES_BF16, attention.KERNEL_BF16 = two, kern
            attention.PREFILL_BF16 = prefill == "kernel"
            try:
                worst, flips = 0.0, 0
                with torch.inference_mode():
                    every = torch.arange(n)  # the logits of all the prompt's positions
                    if prefill == "alone":
                        first = runner.forward(runner.batch([Row(0, n, n, mine)]), ids, every).float()
                        if beside:
                            runner.forward(runner.batch([Row(0, n, n, theirs)]), other, torch.tensor([n - 1]))
                    else:  # both prompts in one step: the SDPA path or the kernel's prefill path
                        both = runner.batch([Row(0, n, n, mine), Row(n, n, n, theirs)])
                        assert both.prefill_rows == ([0, 1] if prefill == "kernel" else []), both.prefill_rows
                        first = runner.forward(both, torch.cat([ids, other]), every).float()
                    ref_out = model(input_ids=ids[None], use_cache=True)
                    cache, ref = ref_out.past_key_values, ref_out.logits[0, -1]
                    ref_all = ref_out.logits[0].float()
                    p_worst = float(((first - ref_all).abs().amax(dim=1) / ref_all.abs().amax(dim=1)).max())
                    p_flips = int((first.argmax(dim=1) != ref_all.argmax(dim=1)).sum())
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
                attention.TWO_QUERIES_BF16, attention.KERNEL_BF16, attention.PREFILL_BF16 = True, True, True
            out.append(
                {
                    "prompt": n,
                    "case": case,
                    "max_rel_diff": worst,
                    "argmax_differs": flips,
                    "steps": steps,
                    "prefill_max_rel_diff": p_worst,
                    "prefill_argmax_differs": p_flips,
                }
            )
            print(
                f"  logits: prompt {n:5d} {case:40s} prefill: max rel diff {p_worst:.2e}, argmax differs {p_flips}/{n};"
                f" decoding: max rel diff {worst:.2e}, argmax differs {flips}/{steps}"
            )
    return out


def prompt_logits_f32(model_name: str, prompts: list[int]) -> list[dict[str, Any]]:
    """fp32: every position's logits of a prompt prefilled beside a second one in one step, by SDPA or by the
    kernel's fp32 prefill path (``PREFILL_F32``), against the bare fp32 model's."""
    model, runner, bs, pairs = two_prompts(model_name, torch.float32, prompts, 0)
    out = []
    for n, ids, other in pairs:
        nb = -(-(n + 1) // bs)
        with torch.inference_mode():
            ref = model(input_ids=ids[None]).logits[0].float()
            for prefill in ("sdpa", "kernel"):
                attention.PREFILL_F32 = prefill == "kernel"
                try:
                    both = runner.batch([Row(0, n, n, list(range(nb))), Row(n, n, n, list(range(nb, 2 * nb)))])
                    assert both.prefill_rows == ([0, 1] if prefill == "kernel" else []), both.prefill_rows
                    got = runner.forward(both, torch.cat([ids, other]), torch.arange(n)).float()
                finally:
                    attention.PREFILL_F32 = True
                worst = float(((got - ref).abs().amax(dim=1) / ref.abs().amax(dim=1)).max())
                flips = int((got.argmax(dim=1) != ref.argmax(dim=1)).sum())
                out.append({"prompt": n, "prefill": prefill, "max_rel_diff": worst, "argmax_differs": flips})
                print(
                    f"  fp32 prompt logits: prompt {n:5d} beside another, by {prefill:6s}: max rel diff {worst:.2e}, "
                    f"argmax differs {flips}/{n}"
                )
    return out


STEP_MODES = {
    "kernel": "the C kernel",
    "kernel, SDPA prefill": "the C kernel, the prefill chunk by SDPA",
    "twice": "SDPA, the query twice",
    "one": "SDPA, one query",
}


def step(model_name: str) -> list[dict[str, Any]]:
    """ms per engine step: 7 decoding rows of 2,000 tokens beside a prefill chunk (medians of 6 steps)."""
    out = []
    modes = [("bfloat16", m) for m in STEP_MODES] + [("float32", "kernel"), ("float32", "kernel, SDPA prefill")]
    for dtype, mode in modes:
        attention.TWO_QUERIES_BF16, attention.KERNEL_BF16 = mode != "one", mode.startswith("kernel")
        attention.PREFILL_BF16 = attention.PREFILL_F32 = mode == "kernel"
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
            attention.TWO_QUERIES_BF16, attention.KERNEL_BF16, attention.PREFILL_BF16 = True, True, True
            attention.PREFILL_F32 = True
        ms = statistics.median(times) * 1e3
        out.append({"dtype": dtype, "decode_rows": mode, "step_ms": ms})
        print(f"  step: {dtype}, decoding rows by {STEP_MODES[mode]}: {ms:.1f} ms")
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
            f"  {r['context']:5d} keys: SDPA one query {r['one_query_ms']:.3f} ms, twice {r['two_queries_ms']:.3f} ms "
            f"({r['outputs_differing']}/{r['outputs']} outputs differ, max {r['max_abs_diff']:.1e}); kernel "
            f"{r['kernel_ms']:.3f} ms ({r['kernel_outputs_differing']}/{r['outputs']} differ, max "
            f"{r['kernel_max_abs_diff']:.1e}; largest |output| {r['max_abs_output']:.1e})"
        )
    result["logits"] = logits(args.model, args.prompts, args.steps)
    result["prompt_logits_f32"] = f32 = prompt_logits_f32(args.model, args.prompts)
    for how in ("sdpa", "kernel"):  # fp32 prompts beside another: the largest difference, the argmax flips
        result[f"f32_prefill_{how}"] = {
            "max_rel_diff": max(r["max_rel_diff"] for r in f32 if r["prefill"] == how),
            "argmax_differs": sum(r["argmax_differs"] for r in f32 if r["prefill"] == how),
        }
    result["step"] = step(args.model)
    cases = {
        "alone": "alone",
        "beside_one": "beside, one query",
        "beside_twice": "beside, twice",
        "beside_kernel": "beside, kernel",
        "prefill_beside_sdpa": "beside, kernel; prefill beside, SDPA",
        "prefill_beside_kernel": "beside, kernel; prefill beside, kernel",
    }
    for what in ("argmax_differs", "prefill_argmax_differs"):  # per case, the positions whose argmax differs
        result[what] = {key: sum(r[what] for r in result["logits"] if r["case"] == case) for key, case in cases.items()}
    for what, name in (("max_rel_diff", "logits_worst"), ("prefill_max_rel_diff", "prefill_logits_worst")):
        result[name] = {  # per case, the largest relative difference over all prompts
            key: max(r[what] for r in result["logits"] if r["case"] == case) for key, case in cases.items()
        }
    result["prefill_positions"] = sum(args.prompts)
    result = {"meta": _meta.end(meta), **result}
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
