"""Prefill attention over a long cached prefix: the paged C kernel's two paths against gather + SDPA, with and without
``engine.malloc.keep_freed_memory``.

    python benchmarks/bench_agent_attention.py [--dtype float32|bfloat16] [--heads 12] [--head-dim 64]
                                               [--contexts 512 1536 3072] [--queries 1 4 8 16 64 256] [--json FILE]

An agent's request re-sends a long transcript whose K/V is cached and computes a short new chunk over it: one row
of q new tokens attending kv cached + new ones. ``engine.paged.attention`` runs such a row through the C kernel in
place in the pool, by its decode path (one query at a time) or, in a step of several rows, by its prefill path
(tiles of 32 queries, where the compiler targets AVX-512; bf16 with AVX512-BF16 dot products) for rows of
``PREFILL_MIN_QUERIES`` (bf16) or ``PREFILL_MIN_QUERIES_F32`` (fp32) new tokens or more; otherwise it gathers the
row's K/V out of the pool and runs SDPA (a lone row's prefill). This times one layer's attention of one row all
three ways (the ``small`` preset's shape by default: 12 heads of 64; each kernel path for the one row here), median
of 15 calls, in two child processes: glibc's default malloc, and the one ``prefixcache serve`` sets (freed memory
kept: the gather's buffers stop faulting their pages in each call). ``kernel_ms`` is the path a step of several
rows takes; its outputs are compared with SDPA's.

One layer's K/V of these contexts stays in this CPU's caches between calls. ``builds`` times the prefill path where
it is not: one row per layer over a pool of ``--pool-layers`` layers (the longest context; blocks in order, and
scattered), this build against the kernel built without the prefill path's tunings (``kernel.PREFILL_PLAIN``: no
half tiles, prefetch, groups of tiles, constant key offsets or blocked values), in turn, median of 9; the two builds'
outputs must be the same bits.
Writes JSON (``benchmarks/results/agent_attention.json``; ``agent_attention_bf16.json`` for bfloat16).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import _meta  # noqa: E402


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    """This process's timings: per (context, queries), kernel and torch-path ms and their largest difference."""
    import torch

    from engine.kv_pool import KVPool, LayerSpec
    from engine.malloc import keep_freed_memory
    from engine.paged import attention as att
    from engine.paged import kernel

    if keep_freed_memory() != (os.environ.get("PREFIXCACHE_MALLOC") != "default"):
        raise SystemExit("keep_freed_memory() did not apply here (not glibc?)")
    lib = kernel.load()
    if lib is None:
        raise SystemExit("the paged C kernel did not build here (no C compiler?)")
    dtype = getattr(torch, args.dtype)
    bf16 = dtype == torch.bfloat16
    prefill_built = kernel.prefill_available(lib, dtype)
    if bf16 and not prefill_built:
        raise SystemExit("the kernel's bf16 prefill path is not built here (no AVX512-BF16)")
    if bf16:  # the kernel for one row too (the engine: in steps of several rows; a lone row keeps SDPA)
        att._kernel_dtype = lambda dtype, rows: True
    least = att.PREFILL_MIN_QUERIES if bf16 else att.PREFILL_MIN_QUERIES_F32  # where a step of several rows switches
    torch.manual_seed(0)
    h, d, bs = args.heads, args.head_dim, 16
    top = max(args.contexts)
    blocks = -(-top // bs)
    pool = KVPool([LayerSpec((h, d), (h, d))], num_blocks=blocks, block_size=bs, dtype=dtype, device="cpu")
    pair = pool.layer(0)
    assert pair is not None
    for side in pair:
        side.normal_()
    default_max, default_from, default_8lane = att.KERNEL_MAX_QUERIES, att._prefill_from, att.PREFILL_MAX_QUERIES_8LANE

    def once(q: torch.Tensor, kv: int, path: str) -> tuple[float, torch.Tensor]:
        """One row of q's new tokens over kv keys through ``path``: the kernel's "decode" or "prefill" path (as the
        engine runs them in a step of several rows, here for the one row), or "torch" (gather + SDPA)."""
        row = att.Row(0, q.shape[2], kv, list(range(-(-kv // bs))))
        att.KERNEL_MAX_QUERIES = 10**9  # the decode path for a row of any length (the engine: at most default_max)
        att._prefill_from = lambda lib, dtype, rows: 1 if path == "prefill" else math.inf
        att.PREFILL_MAX_QUERIES_8LANE = 10**9  # the prefill path's 8-lane build too, for rows of any length
        try:
            batch = att.StepBatch.make(pool, [row], use_kernel=path != "torch")
            assert bool(batch.prefill_rows) == (path == "prefill") and bool(batch.kernel_rows) == (path == "decode")
        finally:
            att.KERNEL_MAX_QUERIES, att._prefill_from = default_max, default_from
            att.PREFILL_MAX_QUERIES_8LANE = default_8lane
        batch.layer = 0
        token = att._current.set(batch)
        try:
            times = []
            for _ in range(15):
                t0 = time.perf_counter()
                out, _ = att.paged_attention(torch.nn.Identity(), q, q, q, None, scaling=d**-0.5)
                times.append(time.perf_counter() - t0)
        finally:
            att._current.reset(token)
        return statistics.median(times) * 1e3, out

    for path in ("torch", "decode", "prefill") if prefill_built else ("torch", "decode"):  # first calls: set-up
        once(torch.randn(1, h, 4, d, dtype=dtype), min(args.contexts), path)
    rows = []
    for kv in args.contexts:
        for n in args.queries:
            if n > kv:
                continue
            q = torch.randn(1, h, n, d, generator=torch.Generator().manual_seed(n)).to(dtype)
            d_ms, d_out = once(q, kv, "decode")
            p_ms, p_out = once(q, kv, "prefill") if prefill_built else (None, None)
            t_ms, t_out = once(q, kv, "torch")
            most = att.PREFILL_MAX_QUERIES_8LANE if prefill_built and kernel.prefill_8lane(lib) else math.inf
            path = "prefill" if prefill_built and least <= n <= most else "decode"
            if path == "decode" and n > att.KERNEL_MAX_QUERIES:
                path = "torch"  # past the 8-lane prefill path's rows: the engine gathers and runs SDPA
            k_ms, k_out = {"prefill": (p_ms, p_out), "decode": (d_ms, d_out), "torch": (t_ms, t_out)}[path]
            assert k_ms is not None and k_out is not None
            differ = k_out != t_out
            rows.append(
                {
                    "context": kv,
                    "queries": n,
                    "kernel_ms": k_ms,  # the path a step of several rows takes for this row
                    "decode_ms": d_ms,
                    "prefill_ms": p_ms,
                    "torch_ms": t_ms,
                    "kernel_over_torch": k_ms / t_ms,
                    "path": path,
                    "max_abs_diff": float((k_out.float() - t_out.float()).abs().max()),
                    "max_abs_output": float(t_out.float().abs().max()),
                    "outputs_differing": int(differ.sum()),
                    "outputs": differ.numel(),
                }
            )
    return rows


def builds(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Per (queries, block order): the prefill path's ms per layer over a pool out of cache, this build and the plain
    one (``kernel.PREFILL_PLAIN``), timed in turn."""
    import ctypes

    import torch

    from engine.kv_pool import KVPool, LayerSpec
    from engine.paged import attention as att
    from engine.paged import kernel

    dtype = getattr(torch, args.dtype)
    libs = {"this": kernel.load(), "plain": kernel.load_variant(*kernel.PREFILL_PLAIN)}
    if any(lib is None or not kernel.prefill_available(lib, dtype) for lib in libs.values()):
        return []
    least = att.PREFILL_MIN_QUERIES if dtype == torch.bfloat16 else att.PREFILL_MIN_QUERIES_F32
    h, d, bs, kv, layers = args.heads, args.head_dim, 16, max(args.contexts), args.pool_layers
    gen = torch.Generator().manual_seed(0)
    nb = -(-kv // bs)
    pool = KVPool([LayerSpec((h, d), (h, d))] * layers, nb + 16, bs, dtype=dtype, device="cpu")
    sides = []
    for i in range(layers):
        pair = pool.layer(i)
        assert pair is not None
        for side in pair:
            side.normal_(generator=gen)
        sides.append(pair)
    orders = {"in order": torch.arange(nb), "scattered": torch.randperm(nb + 16, generator=gen)[:nb]}
    per = int(libs["this"].paged_prefill_scratch(d, att.KERNEL_SPLIT)) * 2
    scratch = ctypes.create_string_buffer(per)
    out_rows = []
    for n in [q for q in args.queries if least <= q <= kv]:
        q = torch.randn((n, h, d), generator=gen).to(dtype).float()
        q_start, q_len, kv_len = (torch.tensor([v], dtype=torch.int32) for v in (0, n, kv))
        for order, ids in orders.items():
            table = ids.to(torch.int32).view(1, nb).contiguous()
            times: dict[str, list[float]] = {k: [] for k in libs}
            outs = {k: torch.empty((n, h, d)) for k in libs}
            for _ in range(9):
                for k, lib in libs.items():
                    fn = lib.paged_prefill_bf16 if dtype == torch.bfloat16 else lib.paged_prefill_f32
                    t0 = time.perf_counter()
                    for kp, vp in sides:
                        rc = fn(
                            q.data_ptr(), q.stride(0), q.stride(1), kp.data_ptr(), vp.data_ptr(), kp.shape[1], bs, d,
                            h, h, table.data_ptr(), nb, q_start.data_ptr(), q_len.data_ptr(), kv_len.data_ptr(), 1,
                            d**-0.5, 0.0, 0, att.KERNEL_SPLIT, outs[k].data_ptr(), 2, scratch, per,
                        )  # fmt: skip
                        assert rc == 0
                    times[k].append((time.perf_counter() - t0) / layers * 1e3)
            if not torch.equal(outs["this"], outs["plain"]):
                raise SystemExit(f"the two builds' outputs differ ({n} queries, {order})")
            this, plain = statistics.median(times["this"]), statistics.median(times["plain"])
            out_rows.append(
                {"context": kv, "queries": n, "order": order, "ms": this, "ms_plain": plain, "ratio": this / plain}
            )
    return out_rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 1536, 3072])
    ap.add_argument("--queries", type=int, nargs="+", default=[1, 4, 8, 16, 64, 256])
    ap.add_argument("--pool-layers", type=int, default=12, help="builds: layers of the pool out of cache")
    ap.add_argument("--json", default=None, help="default benchmarks/results/agent_attention[_bf16].json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child-builds", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.pool_layers < 1:
        raise SystemExit("--pool-layers must be >= 1")
    if args.child or args.child_builds:
        print(json.dumps(builds(args) if args.child_builds else measure(args)))
        return
    meta = _meta.begin()
    by: dict[str, list[dict[str, Any]]] = {}
    if args.json is None:
        name = "agent_attention_bf16.json" if args.dtype == "bfloat16" else "agent_attention.json"
        args.json = str(ROOT / "benchmarks" / "results" / name)
    argv = [sys.executable, __file__, "--child", "--heads", str(args.heads), "--head-dim", str(args.head_dim)]
    argv += ["--dtype", args.dtype]
    argv += ["--contexts", *map(str, args.contexts), "--queries", *map(str, args.queries)]
    argv += ["--pool-layers", str(args.pool_layers)]
    for mode in ("default", "kept"):
        env = {k: v for k, v in os.environ.items() if k != "PREFIXCACHE_MALLOC"}
        if mode == "default":
            env["PREFIXCACHE_MALLOC"] = "default"
        done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SystemExit(f"the {mode}-malloc child failed:\n{done.stderr[-2000:]}")
        by[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    done = subprocess.run([*argv[:2], "--child-builds", *argv[3:]], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the builds child failed:\n{done.stderr[-2000:]}")
    built = json.loads(done.stdout.strip().splitlines()[-1])
    print(
        f"{args.dtype}:\n| context | queries | decode path ms | prefill path ms | the engine's path | gather + SDPA ms "
        "(malloc default) | gather + SDPA ms (freed memory kept) | outputs differing |"
    )
    print("| ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |")
    for a, b in zip(by["default"], by["kept"], strict=True):
        pf = "-" if b["prefill_ms"] is None else f"{b['prefill_ms']:.2f}"
        print(
            f"| {a['context']} | {a['queries']} | {b['decode_ms']:.2f} | {pf} | {b['path']} | {a['torch_ms']:.2f} "
            f"| {b['torch_ms']:.2f} | {b['outputs_differing']}/{b['outputs']} |"
        )
    if built:
        print(
            f"\nthe prefill path over {args.pool_layers} layers out of cache, ms per layer: this build / without the "
            "prefill path's tunings\n| context | queries | blocks | this build | plain | ratio |\n"
            "| ---: | ---: | --- | ---: | ---: | ---: |"
        )
        for r in built:
            print(
                f"| {r['context']} | {r['queries']} | {r['order']} | {r['ms']:.3f} | {r['ms_plain']:.3f} "
                f"| {r['ratio']:.2f} |"
            )
    payload = {
        "settings": {k: v for k, v in vars(args).items() if k not in ("child", "child_builds")},
        "malloc_default": by["default"],
        "malloc_kept": by["kept"],
        "builds": built,
        "max_abs_diff": max(r["max_abs_diff"] for rows in by.values() for r in rows),
        "meta": _meta.end(meta),
    }
    Path(args.json).write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
