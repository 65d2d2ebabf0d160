"""One engine step with a prefill chunk: the last layer over the kept rows only, against every row.

    python benchmarks/bench_last_rows.py [--model small] [--dtypes float32 bfloat16] [--prefill 16 64 256]
                                         [--decoding 7] [--context 1500] [--rounds 12] [--json FILE]

A step of ``--decoding`` rows decoding over ``--context`` tokens beside one prompt chunk of P new tokens after a cached
prefix of the same length, as the agent shape's steps are, through the engine's own forward (packed linears, fused
ops, the paged kernel). Its logits are kept at the decoding rows and at the chunk's last token, so
``engine.paged.last_rows`` computes the last layer's output projection and MLP over ``--decoding`` + 1 rows instead
of ``--decoding`` + P. Each round times the step both ways in turn (the pruned layer, then every row:
``runner.last_rows`` set aside); the table has the medians of ``--rounds``, their ratio, and the largest difference
between the two ways' logits (relative to the logits' scale) with whether every row's greedy token agrees.
Writes JSON (``benchmarks/results/last_rows.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import _meta  # noqa: E402


def measure(args: argparse.Namespace, dtype_name: str) -> list[dict[str, Any]]:
    """Per prefill length: both ways' median ms, their ratio, and how far their logits differ."""
    import torch

    from engine import PrefixCachedModel
    from engine.paged.attention import Row

    dtype = getattr(torch, dtype_name)
    bs = 16
    longest = max(args.prefill)
    pool_tokens = (args.decoding + 1) * (args.context + longest + 2 * bs)
    pcm = PrefixCachedModel.from_pretrained(args.model, max_cached_tokens=pool_tokens, block_size=bs, dtype=dtype)
    engine = pcm.engine()
    if engine is None:
        raise SystemExit(f"the engine cannot run this model: {pcm.engine_unsupported_reason}")
    runner = engine.runner
    pruned = runner.last_rows
    if pruned is None or pruned.reason is not None:
        raise SystemExit(f"the last layer computes every row here: {None if pruned is None else pruned.reason}")
    gen = torch.Generator().manual_seed(0)
    vocab = int(pcm.model.config.vocab_size)
    out: list[dict[str, Any]] = []
    for p in args.prefill:
        rows, at, nb = [], 0, 0
        for _ in range(args.decoding):
            n = -(-args.context // bs)
            rows.append(Row(at, 1, args.context, list(range(nb, nb + n))))
            at, nb = at + 1, nb + n
        n = -(-(args.context + p) // bs)
        rows.append(Row(at, p, args.context + p, list(range(nb, nb + n))))
        at += p
        ids = torch.randint(3, vocab, (at,), generator=gen)
        keep = torch.tensor([*range(args.decoding), at - 1])
        batch = runner.batch(rows)

        def step(last: Any) -> tuple[float, torch.Tensor]:
            runner.last_rows = last
            with engine.fast_paths(several_rows=True):
                t0 = time.perf_counter()
                logits = runner.forward(batch, ids, keep)
                return time.perf_counter() - t0, logits.float()

        try:
            step(pruned), step(None)  # warm: oneDNN's primitives for these shapes
            times: dict[str, list[float]] = {"kept_rows": [], "all_rows": []}
            for _ in range(args.rounds):
                t, a = step(pruned)
                times["kept_rows"].append(t)
                t, b = step(None)
                times["all_rows"].append(t)
        finally:
            runner.last_rows = pruned
        kept, every = (statistics.median(v) * 1000 for v in times.values())
        diff = float((a - b).abs().max() / b.abs().max().clamp_min(1.0))
        same = bool(torch.equal(a.argmax(-1), b.argmax(-1)))
        out.append(
            {"dtype": dtype_name, "prefill": p, "rows": at, "kept": len(keep), "kept_rows_ms": kept,
             "all_rows_ms": every, "all_over_kept": every / kept, "max_logit_diff": diff, "greedy_same": same,
             "kept_rows_runs_ms": [x * 1000 for x in times["kept_rows"]],
             "all_rows_runs_ms": [x * 1000 for x in times["all_rows"]]}
        )  # fmt: skip
        print(
            f"{dtype_name} prefill {p}: kept rows {kept:.1f} ms, every row {every:.1f} ms "
            f"(x{every / kept:.3f}); logits differ by {diff:.2g}, greedy {'same' if same else 'DIFFERENT'}",
            flush=True,
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small")
    ap.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"], default=["float32", "bfloat16"])
    ap.add_argument("--prefill", nargs="+", type=int, default=[16, 64, 256])
    ap.add_argument("--decoding", type=int, default=7, help="rows decoding beside the chunk")
    ap.add_argument("--context", type=int, default=1500, help="tokens each decoding row (and the chunk's prefix) holds")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "last_rows.json")
    args = ap.parse_args()
    if min(args.prefill) < 2 or args.decoding < 0 or args.context < 1 or args.rounds < 1:
        raise SystemExit("--prefill needs 2 tokens or more, --context and --rounds at least 1, --decoding >= 0")
    import torch

    from engine.malloc import keep_freed_memory

    keep_freed_memory()  # as prefixcache serve runs
    torch.set_num_threads(os.cpu_count() or 1)
    meta = _meta.begin()
    results = [r for d in args.dtypes for r in measure(args, d)]
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"one step: {args.decoding} decoding rows over {args.context} tokens + a prompt chunk")
    for col in ("dtype", "chunk tokens", "rows", "kept", "kept rows ms", "every row ms", "ratio", "logit diff"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(
            r["dtype"], str(r["prefill"]), str(r["rows"]), str(r["kept"]), f"{r['kept_rows_ms']:.1f}",
            f"{r['all_rows_ms']:.1f}", f"{r['all_over_kept']:.3f}", f"{r['max_logit_diff']:.2g}",
        )  # fmt: skip
    Console().print(table)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    payload = {"meta": _meta.end(meta), "args": {k: str(v) for k, v in vars(args).items()}, "results": results}
    args.json.write_text(json.dumps(payload, indent=1) + "\n")
    if not all(r["greedy_same"] for r in results):
        raise SystemExit("the two ways' greedy tokens differ")


if __name__ == "__main__":
    main()
