"""What the check at load costs (``engine.path_check``: the contiguous cached path run end to end against the bare
model, before a model's first cached call), per preset, beside what wrapping costs in all.

    python benchmarks/bench_load_check.py                  # tiny, small, tiny-hybrid, small-hybrid (about a minute)
    python benchmarks/bench_load_check.py --one-b          # also a 1.1B-parameter Llama-shaped random model

Each model is wrapped ``--repeats`` times (``ModelRuntime``, as ``PrefixCachedModel`` does); the table shows the
median seconds of the check and of the whole wrap (the check, the hybrid probes, the pool). Writes
benchmarks/results/bench_load_check.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _meta

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "bench_load_check.json"
PRESETS = ("tiny", "small", "tiny-hybrid", "small-hybrid")


def one_b() -> object:
    """A 1.1B-parameter Llama-shaped model (TinyLlama's dimensions) with seeded random weights."""
    import torch
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    with torch.device("cpu"):
        return transformers.LlamaForCausalLM(cfg).eval()


def measure(model: object, repeats: int) -> dict[str, float]:
    from engine.runtime import ModelRuntime

    checks, wraps = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        rt = ModelRuntime(model)  # type: ignore[arg-type]
        wraps.append(time.perf_counter() - t0)
        checks.append(rt.load_check_seconds)
        assert rt.load_check_reason is None, rt.load_check_reason
        del rt
    return {"check_s": statistics.median(checks), "wrap_s": statistics.median(wraps), "repeats": repeats}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--one-b", action="store_true", help="also a 1.1B-parameter model (float32: 4.4 GB)")
    ap.add_argument("--json", type=Path, default=OUT)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    from engine.models import load_model

    meta = _meta.begin()
    rows = []
    for name in PRESETS:
        model, _ = load_model(name)
        params = sum(p.numel() for p in model.parameters())
        rows.append({"model": name, "parameters": params, **measure(model, args.repeats)})
        print(f"{name:14s} {params / 1e6:8.1f}M  check {rows[-1]['check_s']:.3f} s  wrap {rows[-1]['wrap_s']:.3f} s")
    if args.one_b:
        model = one_b()
        params = sum(p.numel() for p in model.parameters())  # type: ignore[attr-defined]
        rows.append({"model": "llama-1.1b", "parameters": params, **measure(model, 1)})
        print(
            f"{'llama-1.1b':14s} {params / 1e6:8.1f}M  check {rows[-1]['check_s']:.3f} s  wrap {rows[-1]['wrap_s']:.3f} s"
        )
    out = {"meta": _meta.end(meta), "rows": rows}
    args.json.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
