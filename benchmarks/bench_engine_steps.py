"""Where the engine's time goes: serve_peers' chat workload driven straight into the engine (no HTTP), step by step.

    python benchmarks/bench_engine_steps.py [--model small] [--clients 8] [--chats 16] [--max-step-tokens 256]
                                            [--block-size 16] [--runs 1] [--workload chat|agent]
                                            [--dtype float32|bfloat16]
                                            [--ab torch-prefill|plain-prefill|l1-prefetch|no-huge-pages|all-rows|
                                                  hf-layers|no-decode-layer|onednn-linears]
                                            [--json FILE]

``--clients`` closed-loop clients play ``--chats`` multi-turn chats (4 tenants with ~300-token system prompts, 8
turns of ~60 tokens, 32-token greedy replies: the workload of ``benchmarks/serve_peers.py``, built by its own
``round_chats``) against ``Engine`` directly: each client submits its next turn as soon as its reply finishes, the
loop steps the engine. Printed: requests/s, TTFT, cached tokens, and the split of the engine's busy time into
scheduling, the forward (and attention inside it), and what follows the forward (log-softmax/sampling, streaming,
committing blocks); the rest of the wall time is this loop's own Python (chat templates, decoding replies). A
roofline (``_roofline.py``) sets the forward's achieved GFLOP/s (FLOPs counted from the model's shapes, the tokens
computed and the attention's (query, key) pairs) against the engine's own packed linears' GFLOP/s at the step's mean
linear shapes and at 2048^3, torch.mm's beside them (JSON ``roofline``), and a floor under the run (JSON ``floor``,
``_roofline.forward_floor``): each step's linears at that 2048^3 peak or one read of every weight, the prompt tokens'
attention at the peak, the decoding tokens' K/V read once at the better of read probes taken before and after the
run, everything else free; with the run's time outside its forwards, the requests/s it would reach there. JSON
``above_floor`` sets the forwards' parts beside the floor's: the linears, the attention kernel's prefill and decode
paths (``EngineStats``' ``prefill_path_s`` / ``_flops``, ``decode_path_s`` / ``_bytes``: their GFLOP/s and GB/s in
place), the rest.
``--workload agent`` plays serve_peers' agent sessions instead (its ``agent_sessions``: ``--chats`` sessions of the
kv-cache-tester trace, up to ``--turns`` turns each, one user message per turn, replies of the trace's lengths capped
at ``--max-tokens``), back to back: the trace's gaps are not slept here.
Compared with ``serve_peers.py --servers pc`` on the same machine, the difference in requests/s is what HTTP, the
event loop and the engine thread cost. ``cores_busy`` is this process's CPU time over the wall time. With --runs N
the whole workload is played N times, each on a fresh model and engine: the JSON's top level is the first run,
``runs`` has every run's requests/s, TTFT and cores busy (the machine's run-to-run noise). glibc keeps freed
memory (``engine.malloc``), as in ``prefixcache serve``. ``--ab X``: each run is followed by one without X, so
its effect is a ratio from one run (JSON ``ab``, ``ab_runs``, ``this_over_ab``): ``plain-prefill``, the attention
kernel built without its prefill path's tunings (``kernel.PREFILL_PLAIN``; the same outputs, bit for bit);
``l1-prefetch``, the kernel asking for keys and values into L1 rather than L2 (``kernel.L1_PREFETCH``; the same bits);
``no-huge-pages``, the KV pool and the small-row weights in 4 KiB pages (``PREFIXCACHE_HUGE_PAGES=off``);
``all-rows``, the last layer's output projection and MLP over every row, not only the rows whose logits are kept
(``PREFIXCACHE_LAST_ROWS=off``); ``hf-layers``, transformers' own decoder-layer forwards instead of the lean ones
(``PREFIXCACHE_LEAN_LAYERS=off``, ``engine.paged.lean``; the same bits); ``no-decode-layer``, decode steps through
the lean layers' module calls instead of ``engine.paged.decode_layer``'s straight C calls
(``PREFIXCACHE_DECODE_LAYER=off``; the same bits); ``onednn-linears``, the packed linears on
oneDNN at every row count (``linear.small_rows_range`` none: no small-row kernel); ``torch-prefill``, prefill rows
through the torch path (gather + SDPA) instead of the kernel's prefill path (``attention.PREFILL_F32`` /
``PREFILL_BF16`` off).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from serve_peers import TRACE, agent_sessions, round_chats  # noqa: E402  (serve_peers.py: its workloads, no HTTP)

import _meta  # noqa: E402
from _roofline import forward_floor, forward_flops, roofline, stream_gbs  # noqa: E402
from engine import PrefixCachedModel  # noqa: E402
from engine.batching.request import Request, RequestResult  # noqa: E402
from engine.batching.sampling import SamplingParams  # noqa: E402
from engine.batching.scheduler import SchedulerConfig  # noqa: E402
from engine.kv_pool import bytes_per_token  # noqa: E402
from engine.malloc import keep_freed_memory  # noqa: E402


class Client:
    """One closed-loop client: plays its chats turn by turn, the history growing with every reply."""

    def __init__(self, chats: list[dict], pcm: PrefixCachedModel, engine: Any, max_tokens: int) -> None:
        self.chats, self.pcm, self.engine, self.max_tokens = list(chats), pcm, engine, max_tokens
        self.chat: dict | None = None
        self.turn = 0
        self.history: list[dict] = []
        self.t0 = 0.0
        self.got_first = False
        self.result: RequestResult | None = None
        self.ttft: list[float] = []
        self.cached: list[int] = []
        self.prompts: list[int] = []
        self.generated = 0  # completion tokens (rows whose logits were taken)
        self.pairs = 0  # (query token, key) pairs attended, per attention layer
        self.decode_pairs = 0  # of those, the decoding tokens' (each fed-back reply token reads its row's K/V)

    def tokens(self, ids: list[int]) -> None:  # the request's sink: called as tokens come
        if not self.got_first:
            self.ttft.append(time.monotonic() - self.t0)
            self.got_first = True

    def finished(self, result: RequestResult) -> None:
        self.result = result

    def submit_next(self) -> bool:
        """Submit the next turn; False when this client's chats are done. A chat's turn adds a user message to its
        history (and the reply after it); an agent session's turn (``prompts``) is one user message of its own."""
        agent = self.chat is not None and "prompts" in self.chat
        if self.chat is None or self.turn >= len(self.chat["prompts" if agent else "users"]):
            if not self.chats:
                return False
            self.chat, self.turn = self.chats.pop(0), 0
            agent = "prompts" in self.chat
            self.history = [] if agent else [{"role": "system", "content": self.chat["system"]}]
        limit = self.max_tokens
        if agent:
            self.history = [{"role": "user", "content": self.chat["prompts"][self.turn]}]
            limit = self.chat["limits"][self.turn]
        else:
            self.history.append({"role": "user", "content": self.chat["users"][self.turn]})
        self.turn += 1
        tok = self.pcm.tokenizer
        ids = list(tok.apply_chat_template(self.history, add_generation_prompt=True, tokenize=True)["input_ids"])
        self.prompts.append(len(ids))
        self.got_first, self.result, self.t0 = False, None, time.monotonic()
        sampling = SamplingParams(max_tokens=limit)
        self.engine.submit(
            Request(f"turn{len(self.prompts)}", ids, self.pcm.runtime.namespace("default"), sampling, sink=self)
        )
        return True

    def collect(self) -> bool:
        """After a step: record a finished reply and submit the next turn. False when done."""
        res = self.result
        if res is None:
            return True
        if res.error is not None:
            raise SystemExit(f"request failed: {res.error}")
        self.cached.append(res.cached_tokens)
        # positions computed: cached .. prompt + output - 2 (the last token is never fed); position p attends p + 1
        end = res.prompt_tokens + res.completion_tokens - 1
        self.pairs += end * (end + 1) // 2 - res.cached_tokens * (res.cached_tokens + 1) // 2
        # the fed-back reply tokens sit at positions prompt .. end - 1 and attend prompt + 1 .. end keys
        self.decode_pairs += max(0, end * (end + 1) // 2 - res.prompt_tokens * (res.prompt_tokens + 1) // 2)
        self.generated += res.completion_tokens
        reply = self.pcm.tokenizer.decode(list(res.output), skip_special_tokens=True).replace("\ufffd", "")
        self.history.append({"role": "assistant", "content": reply})
        return self.submit_next()


def achieved_linear_gflops(result: dict[str, Any], model: Any) -> float:
    """The packed linears' achieved GFLOP/s: their FLOPs (every computed token through every linear below the head:
    ``forward_flops`` without the head's rows or attention's pairs) over their time."""
    flops = forward_flops(model, result["prefill_tokens"] + result["decode_tokens"], 0, 0)
    t = result["forward_split_s"]["linears"]
    return flops / t / 1e9 if t > 0 else 0.0


def run_floor(
    result: dict[str, Any],
    pcm: PrefixCachedModel,
    clients: list[Client],
    step_tokens: list[int],
    forward_s: float,
    wall: float,
    read_before: float,
) -> dict[str, Any]:
    """The run's floor (``_roofline.forward_floor``): its steps' linears at the linears' 2048^3 peak or one read of
    their weights, prefill attention at that peak, its decoding tokens' K/V read once, both reads at the better of a
    probe taken before the run (``read_before``) and one taken now (1 GiB, median of 7 each: this shared host's
    bandwidth moves by half between minutes, and the floor is the fastest the run could have been); the time outside
    the forwards as measured. What the run would reach there, and the floor's share of the forwards' ``forward_s``."""
    decode_pairs = sum(c.decode_pairs for c in clients)
    read_after = stream_gbs()["read"]
    read = max(read_before, read_after)
    per_token = bytes_per_token(pcm.runtime.specs, next(pcm.model.parameters()).dtype)
    decode_kv_bytes = decode_pairs * per_token
    floor = forward_floor(
        pcm.model,
        step_tokens,
        sum(c.generated for c in clients),
        sum(c.pairs for c in clients) - decode_pairs,
        decode_kv_bytes,
        result["roofline"]["linear_gflops_large"],
        read,
    )
    outside = wall - forward_s
    return {
        **floor,
        "read_gbs": read,
        "read_gbs_before": read_before,
        "read_gbs_after": read_after,
        "decode_kv_gb": decode_kv_bytes / 1e9,
        "forward_s": forward_s,
        "floor_over_forward": floor["total_s"] / forward_s,
        "outside_forward_s": outside,
        "requests_per_s_at_floor": result["requests"] / (floor["total_s"] + outside),
    }


def above_floor(result: dict[str, Any], s: Any) -> dict[str, dict[str, float | None]]:
    """The forwards' seconds part by part beside the floor's (``run_floor``): the linears; the C kernel's prefill
    path (its GFLOP/s in place, of the linears' 2048^3 peak the floor prices prompt attention at) and decode path (its
    GB/s of cached K/V, of the read probe); the rest of attention (rows on the torch path, such as a prompt alone in
    its step, and the calls' Python); the rest of the forward (norms, rotary, activations, K/V writes, Python), which
    the floor counts as free. The floor's prompt attention includes the torch path's prompt rows."""
    f, peak = result["floor"], result["roofline"]["linear_gflops_large"]
    pf = s.prefill_path_flops / s.prefill_path_s / 1e9 if s.prefill_path_s else None
    dec = s.decode_path_bytes / s.decode_path_s / 1e9 if s.decode_path_s else None
    return {
        "linears": {"s": s.linears_s, "floor_s": f["linears_s"]},
        "prefill_path": {
            "s": s.prefill_path_s,
            "floor_s": f["prefill_attention_s"],
            "gflops": pf,
            "of_floor_rate": pf / peak if pf is not None else None,
        },
        "decode_path": {
            "s": s.decode_path_s,
            "floor_s": f["decode_kv_s"],
            "gbs": dec,
            "of_floor_rate": dec / f["read_gbs"] if dec is not None else None,
        },
        "attention_else": {"s": s.attention_s - s.prefill_path_s - s.decode_path_s, "floor_s": 0.0},
        "rest_of_forward": {"s": s.forward_s - s.linears_s - s.attention_s, "floor_s": 0.0},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--chats", type=int, default=16)
    ap.add_argument("--tenants", type=int, default=4)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-step-tokens", type=int, default=256)
    ap.add_argument("--max-chunk-tokens", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--pool-tokens", type=int, default=32768)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--runs", type=int, default=1, help="play the workload this many times, each on a fresh engine")
    ap.add_argument("--workload", choices=["chat", "agent"], default="chat")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--ab", choices=sorted(AB), default=None, help="after each run, one without this (see above)")
    args = ap.parse_args()
    meta = _meta.begin()
    # glibc told to keep freed memory, as `prefixcache serve` runs (engine.malloc): without it every prefill
    # chunk's megabyte-sized temporaries are fresh mappings whose pages fault in again (an fp32 agent step's
    # SiLU * up took 5x its time), which the server does not pay
    malloc_kept = keep_freed_memory()
    torch.set_num_threads(os.cpu_count() or 1)
    runs, plain = [], []
    for _ in range(args.runs):
        runs.append(one_run(args))
        gc.collect()  # the run's model, engine and pool (held in reference cycles) freed before the next one's
        if args.ab:
            with AB[args.ab]():
                plain.append(one_run(args))
            gc.collect()
    result = runs[0]
    if args.json:
        payload = {"meta": _meta.end(meta), "args": {k: str(v) for k, v in vars(args).items()}}
        payload |= {"machine": platform.processor(), **result, "cpu_count": os.cpu_count(), "malloc_kept": malloc_kept}
        keys = ("wall_s", "requests_per_s", "ttft_p50_ms", "ttft_p99_ms", "cpu_s", "cores_busy")
        payload["runs"] = [{k: r[k] for k in keys} for r in runs]
        if plain:
            payload["ab"] = args.ab
            payload["ab_runs"] = [{k: r[k] for k in keys} for r in plain]
            payload["this_over_ab"] = {
                k: statistics.median(r[k] for r in runs) / statistics.median(r[k] for r in plain)
                for k in ("requests_per_s", "ttft_p50_ms")
            }
        args.json.write_text(json.dumps(payload, indent=1) + "\n")
    for k in ("requests_per_s", "ttft_p50_ms") if plain else ():
        this_m, plain_m = (statistics.median(r[k] for r in rr) for rr in (runs, plain))
        print(f"{k}: as built {this_m:.3g}, {args.ab} {plain_m:.3g} (medians of {len(runs)}): x{this_m / plain_m:.3f}")


@contextmanager
def kernel_variant(defines: tuple[str, ...], flag: str) -> Iterator[None]:
    """The engine's attention kernel built with ``defines`` (``kernel.load_variant``) inside."""
    from engine.paged import kernel

    if kernel.load_variant(*defines) is None:
        raise SystemExit(f"--ab {flag}: the kernel did not build ({kernel.unavailable_reason()})")
    default = kernel.load
    kernel.load = lambda: kernel.load_variant(*defines)  # type: ignore[assignment]
    try:
        yield
    finally:
        kernel.load = default  # type: ignore[assignment]


def plain_prefill() -> contextlib.AbstractContextManager[None]:
    """The engine's attention kernel built without its prefill path's tunings (``kernel.PREFILL_PLAIN``) inside."""
    from engine.paged import kernel

    return kernel_variant(kernel.PREFILL_PLAIN, "plain-prefill")


def l1_prefetch() -> contextlib.AbstractContextManager[None]:
    """The engine's attention kernel asking for keys and values into L1 (``kernel.L1_PREFETCH``) inside."""
    from engine.paged import kernel

    return kernel_variant(kernel.L1_PREFETCH, "l1-prefetch")


@contextmanager
def env_off(name: str) -> Iterator[None]:
    """Inside, the environment variable ``name`` is ``off`` (new engines read it)."""
    before = os.environ.get(name)
    os.environ[name] = "off"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name)
        else:
            os.environ[name] = before


def no_huge_pages() -> contextlib.AbstractContextManager[None]:
    """Inside, new KV pools and packed weights stay in 4 KiB pages (``PREFIXCACHE_HUGE_PAGES=off``)."""
    from engine import malloc

    return env_off(malloc.HUGE_ENV)


def all_rows() -> contextlib.AbstractContextManager[None]:
    """Inside, new engines' last layers compute every row (``PREFIXCACHE_LAST_ROWS=off``)."""
    from engine.paged import last_rows

    return env_off(last_rows.ENV)


def no_decode_layer() -> contextlib.AbstractContextManager[None]:
    """Inside, new engines' decode steps take the lean layers' module calls (``PREFIXCACHE_DECODE_LAYER=off``)."""
    from engine.paged import lean

    return env_off(lean.DECODE_ENV)


def hf_layers() -> contextlib.AbstractContextManager[None]:
    """Inside, new engines run transformers' own decoder-layer forwards (``PREFIXCACHE_LEAN_LAYERS=off``)."""
    from engine.paged import lean

    return env_off(lean.ENV)


@contextmanager
def onednn_linears() -> Iterator[None]:
    """Inside, new engines' packed linears compute every row count on oneDNN (no small-row kernel)."""
    from engine.paged import linear

    default = linear.small_rows_range
    linear.small_rows_range = lambda lib, dtype: (0, -1)  # type: ignore[assignment]
    try:
        yield
    finally:
        linear.small_rows_range = default  # type: ignore[assignment]


@contextmanager
def torch_prefill() -> Iterator[None]:
    """Inside, prefill rows take the torch path (gather + SDPA), not the kernel's prefill path."""
    from engine.paged import attention

    before = attention.PREFILL_F32, attention.PREFILL_BF16
    attention.PREFILL_F32 = attention.PREFILL_BF16 = False
    try:
        yield
    finally:
        attention.PREFILL_F32, attention.PREFILL_BF16 = before


AB = {
    "torch-prefill": torch_prefill,
    "plain-prefill": plain_prefill,
    "l1-prefetch": l1_prefetch,
    "no-huge-pages": no_huge_pages,
    "all-rows": all_rows,
    "hf-layers": hf_layers,
    "no-decode-layer": no_decode_layer,
    "onednn-linears": onednn_linears,
}


def one_run(args: argparse.Namespace) -> dict[str, Any]:
    """Play the workload once on a fresh model and engine; print and return its figures."""
    config = SchedulerConfig(max_step_tokens=args.max_step_tokens, max_chunk_tokens=args.max_chunk_tokens)
    pcm = PrefixCachedModel.from_pretrained(
        args.model,
        max_cached_tokens=args.pool_tokens,
        block_size=args.block_size,
        engine_config=config,
        dtype=getattr(torch, args.dtype),
    )
    engine = pcm.engine()
    if engine is None:
        raise SystemExit(f"the engine cannot run this model: {pcm.engine_unsupported_reason}")
    if args.workload == "agent":
        trace = argparse.Namespace(
            trace=TRACE, project=ROOT, block_tokens=2, max_prompt_tokens=3500, max_tokens=args.max_tokens,
            gap_scale=0.0, max_gap_s=0.0,
        )  # fmt: skip
        chats = agent_sessions(trace, args.seed, args.chats, args.turns)
    else:
        chats = round_chats(args.seed, args.chats, args.tenants, args.turns, 300, 60)
    clients = [Client(chats[i :: args.clients], pcm, engine, args.max_tokens) for i in range(args.clients)]
    read_before = stream_gbs()["read"]  # the floor reads at the better of this and a probe after the run
    gc.collect()
    t0, cpu0 = time.monotonic(), time.process_time()
    active = [c for c in clients if c.submit_next()]
    blocks = runs = 0  # the decoding requests' block tables after each step: blocks, and runs of consecutive ids
    step_tokens: list[int] = []  # tokens each step computed (the floor prices each step's linears)
    while active:
        with pcm.lock:
            before = engine.stats.step_tokens
            engine.step()
            if engine.stats.step_tokens > before:
                step_tokens.append(engine.stats.step_tokens - before)
            for req in engine.scheduler.running:
                if req.computed >= len(req.prompt) and len(req.table) > 1:
                    blocks += len(req.table)
                    runs += 1 + sum(b != a + 1 for a, b in zip(req.table, req.table[1:]))
        active = [c for c in active if c.collect()]
    wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
    pcm.cache.check_integrity()
    s = engine.stats
    ttft = sorted(t for c in clients for t in c.ttft)
    done = len(ttft)
    result = {
        "requests": done,
        "wall_s": wall,
        "requests_per_s": done / wall,
        "ttft_p50_ms": 1000 * ttft[done // 2],
        "ttft_p99_ms": 1000 * ttft[min(done - 1, int(done * 0.99))],
        "mean_prompt_tokens": statistics.mean(p for c in clients for p in c.prompts),
        "mean_cached_tokens": statistics.mean(x for c in clients for x in c.cached),
        "steps": s.steps,
        "tokens_per_step": s.step_tokens / s.steps,
        "requests_per_step": s.step_requests / s.steps,
        "prefill_tokens": s.prefill_tokens,
        "decode_tokens": s.decode_tokens,
        "preemptions": s.preemptions,
        # how the decoding rows' blocks lie in the pool: the mean length of a run of consecutive block ids in their
        # tables (the decode path reads a run as one stream; bench_decode_roofline.py times such runs)
        "decode_block_run": blocks / runs if runs else None,
        "cpu_s": cpu,
        "cores_busy": cpu / wall,
        "roofline": roofline(
            pcm.model,
            s.forward_s,
            s.step_tokens,
            s.steps,
            sum(c.generated for c in clients),
            sum(c.pairs for c in clients),
        ),
        "time_s": {
            "schedule": s.schedule_s,
            "forward_without_attention": s.forward_s - s.attention_s,
            "attention": s.attention_s,
            "after_forward": s.finish_s,
            "outside_step": wall - s.busy_s,
        },
        # the forward split three ways: the packed linears, attention over the pool, and everything else (norms,
        # rotary, activations, writing K/V, embedding, the modeling code's Python)
        "forward_split_s": {
            "linears": s.linears_s,
            "attention": s.attention_s,
            "other": s.forward_s - s.linears_s - s.attention_s,
        },
    }
    roof = result["roofline"]
    roof["linears_gflops"] = achieved_linear_gflops(result, pcm.model)
    roof["linears_fraction_of_large_peak"] = roof["linears_gflops"] / roof["linear_gflops_large"]
    result["floor"] = run_floor(result, pcm, clients, step_tokens, s.forward_s, wall, read_before)
    result["above_floor"] = above_floor(result, s)
    console = Console()
    console.print(
        f"{done} requests in {wall:.1f} s: {result['requests_per_s']:.2f} req/s; TTFT p50 {result['ttft_p50_ms']:.0f} "
        f"/ p99 {result['ttft_p99_ms']:.0f} ms; prompt {result['mean_prompt_tokens']:.0f} tokens, cached "
        f"{result['mean_cached_tokens']:.0f}; {s.steps} steps of {result['tokens_per_step']:.1f} tokens, "
        f"{result['requests_per_step']:.1f} requests; {result['cores_busy']:.2f} cores busy"
    )
    table = Table(title=f"where the time goes ({args.model}, {args.clients} clients, no HTTP)")
    for col in ("part", "seconds", "share of wall", "ms per step"):
        table.add_column(col, justify="left" if col == "part" else "right")
    for part, sec in result["time_s"].items():
        table.add_row(part.replace("_", " "), f"{sec:.1f}", f"{100 * sec / wall:.1f}%", f"{1000 * sec / s.steps:.2f}")
    console.print(table)
    split = result["forward_split_s"]
    console.print(
        "the forward per step: "
        + ", ".join(f"{k} {1000 * v / s.steps:.2f} ms" for k, v in split.items())
        + f" (the linears at {result['roofline']['linears_gflops']:.0f} GFLOP/s)"
    )
    if result["decode_block_run"] is not None:
        console.print(
            f"decoding rows' blocks: runs of {result['decode_block_run']:.1f} consecutive pool blocks on average"
        )
    f = result["floor"]
    console.print(
        f"floor: linears {f['linears_s']:.1f} s ({f['steps_bound_by_weights']:.0f} steps bound by reading the weights) "
        f"+ prefill attention {f['prefill_attention_s']:.1f} s at "
        f"{result['roofline']['linear_gflops_large']:.0f} GFLOP/s, decoding K/V {f['decode_kv_gb']:.0f} GB at "
        f"{f['read_gbs']:.1f} GB/s "
        f"{f['decode_kv_s']:.1f} s = {f['total_s']:.1f} s against the forwards' {f['forward_s']:.1f} s "
        f"({100 * f['floor_over_forward']:.0f}%); with the {f['outside_forward_s']:.1f} s outside them, "
        f"{f['requests_per_s_at_floor']:.2f} req/s at the floor"
    )
    parts = Table(title="the forwards part by part against the floor (the kernel's paths at their rates in place)")
    for col in ("part", "seconds", "floor, s", "rate in place", "of the floor's rate"):
        parts.add_column(col, justify="left" if col == "part" else "right")
    for part, v in result["above_floor"].items():
        rate, unit = (v.get("gflops"), "GFLOP/s") if "gflops" in v else (v.get("gbs"), "GB/s")
        parts.add_row(
            part.replace("_", " "),
            f"{v['s']:.1f}",
            f"{v['floor_s']:.1f}",
            f"{rate:.1f} {unit}" if rate is not None else "",
            f"{100 * v['of_floor_rate']:.0f}%" if v.get("of_floor_rate") is not None else "",
        )
    console.print(parts)
    r = result["roofline"]
    roof = Table(title="roofline: the forward's GFLOP/s against the engine's linears here (torch.mm's in brackets)")
    for col in (
        "forward GFLOP",
        "achieved GFLOP/s",
        f"linears' peak at m={r['mean_tokens_per_step']}",
        "share",
        "linears' peak 2048^3",
        "share",
    ):
        roof.add_column(col, justify="right")
    roof.add_row(
        f"{r['forward_gflop']:.2f}",
        f"{r['forward_gflops']:.1f}",
        f"{r['linear_gflops_at_step_shapes']:.1f} ({r['mm_gflops_at_step_shapes']:.1f})",
        f"{100 * r['fraction_of_step_shape_peak']:.0f}%",
        f"{r['linear_gflops_large']:.1f} ({r['mm_gflops_large']:.1f})",
        f"{100 * r['fraction_of_large_peak']:.0f}%",
    )
    console.print(roof)
    return result


if __name__ == "__main__":
    main()
