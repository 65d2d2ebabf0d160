"""Does ``torch.compile`` pay for the model's forward on this CPU? Eager against compiled (inductor, static shapes)
forwards of a preset over a ``DynamicCache`` of ``--context`` tokens, for the two shapes a serving step is made of:
a decode step (``--batch`` rows of one new token) and a prefill chunk (one row of ``--chunk`` new tokens). The cache
is cropped back after every call, so each call sees the same context. Medians of ``--repeats`` calls after warm-up.

    python benchmarks/bench_compile.py [--model small] [--batch 8] [--context 600] [--chunk 128] [--json FILE]

This is the HF forward (SDPA attention), not the engine's paged one (its attention is a C kernel called through
ctypes, which a compiled graph would break around): it answers whether compiling the model's own layers is worth
bucketing the engine's step shapes for.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _meta
from engine.models import load_model


def measure(model: Any, rows: int, context: int, new: int, repeats: int) -> dict[str, float]:
    """Eager and compiled time of one forward of ``rows`` x ``new`` tokens over ``context`` cached ones."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(torch.randint(10, 250, (rows, context), generator=g), past_key_values=cache, use_cache=True)
    ids = torch.randint(10, 250, (rows, new), generator=g)
    pos = torch.arange(context, context + new).expand(rows, new)

    def call(fwd: Any) -> torch.Tensor:
        logits: torch.Tensor = fwd(input_ids=ids, past_key_values=cache, position_ids=pos, use_cache=True).logits
        cache.crop(-new)
        return logits

    def median_s(fwd: Any) -> float:
        times = []
        for _ in range(3):
            call(fwd)
        for _ in range(repeats):
            t = time.perf_counter()
            call(fwd)
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    with torch.no_grad():
        ref = call(model)
        eager = median_s(model)
        t0 = time.perf_counter()
        compiled_model = torch.compile(model, dynamic=False)
        out = call(compiled_model)
        compile_s = time.perf_counter() - t0
        compiled = median_s(compiled_model)
        eager_again = median_s(model)  # the machine may drift: eager before and after
    eager_ms = 1e3 * statistics.mean([eager, eager_again])
    return {
        "rows": rows,
        "new_tokens": new,
        "context": context,
        "eager_ms": eager_ms,
        "compiled_ms": 1e3 * compiled,
        "compiled_over_eager": 1e3 * compiled / eager_ms,
        "compile_s": compile_s,
        "max_abs_logit_diff": (out - ref).abs().max().item(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--batch", type=int, default=8, help="decode rows")
    ap.add_argument("--context", type=int, default=600)
    ap.add_argument("--chunk", type=int, default=128, help="prefill chunk tokens")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=FutureWarning)
    meta = _meta.begin(peers=("transformers",))
    model, _ = load_model(args.model)
    model.eval()
    rows = {
        "decode": measure(model, args.batch, args.context, 1, args.repeats),
        "prefill_chunk": measure(model, 1, args.context, args.chunk, args.repeats),
    }
    print(f"{args.model}, {args.threads} threads, context {args.context} tokens (medians of {args.repeats}):")
    for name, r in rows.items():
        print(
            f"  {name:14s} {r['rows']} x {r['new_tokens']:>3} tokens: eager {r['eager_ms']:.1f} ms, compiled "
            f"{r['compiled_ms']:.1f} ms ({r['compiled_over_eager']:.2f}x; compiling took {r['compile_s']:.0f} s; "
            f"logits differ by {r['max_abs_logit_diff']:.1e})"
        )
    if args.json:
        doc = {"args": vars(args), "rows": rows, "meta": _meta.end(meta)}
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
