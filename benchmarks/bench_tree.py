"""Tree throughput: lookup + commit + release of whole requests through PrefixCache, no model.

(a) A seeded synthetic token workload with realistic sharing (shared system prompts, multi-turn chats that
    resend their growing history, few-shot templates, one-off prompts), block size 16, fed as numpy int32
    arrays, at a capacity that holds everything, at 25% of it, and in a 10x pool pre-filled with 9x
    unrelated cached blocks (the cost of a request must not grow with the number of cached blocks).
(b) The Mooncake traces (scenarios/traces) through match_keys / commit_keys, block size 512.

Throughput counts prompt tokens processed (match + commit + release of each request) per second of wall
time; latency is per request. Workloads are generated before timing. "min µs/req" is the mean over requests
of each request's fastest run (robust to load from other processes: compare checkouts with it).

    python benchmarks/bench_tree.py [--quick] [--json FILE] [--repeat N]
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

import _meta
from prefixcache import CacheConfig, CacheStats, PrefixCache

TRACES = Path(__file__).resolve().parents[1] / "scenarios" / "traces"  # shipped with the repository
VOCAB = 32_000


@dataclass(frozen=True)
class Request:
    prompt: np.ndarray  # int32, what match sees
    full: np.ndarray  # int32, prompt + generated reply, what commit caches


def synthetic_workload(total_tokens: int, seed: int = 0) -> list[Request]:
    """A seeded mix of chats, few-shot templates and one-off prompts of about ``total_tokens`` prompt tokens."""
    rng = np.random.default_rng(seed)

    def toks(n: int) -> np.ndarray:
        return rng.integers(0, VOCAB, int(n), dtype=np.int32)

    systems = [toks(rng.integers(200, 1500)) for _ in range(16)]
    templates = [toks(rng.integers(500, 2500)) for _ in range(12)]
    sessions: list[dict] = []  # live chats: {"history": array, "turns_left": int}
    out: list[Request] = []
    total = 0
    while total < total_tokens:
        kind = rng.random()
        if kind < 0.55:  # a chat turn: open a session or continue one
            if not sessions or (rng.random() < 0.25 and len(sessions) < 64):
                sys = systems[int(rng.zipf(1.5)) % len(systems)]
                sessions.append({"history": sys, "turns_left": int(rng.integers(2, 12))})
            i = int(rng.integers(len(sessions)))
            s = sessions[i]
            prompt = np.concatenate([s["history"], toks(rng.integers(20, 200))])
            full = np.concatenate([prompt, toks(rng.integers(30, 300))])
            s["history"], s["turns_left"] = full, s["turns_left"] - 1
            if s["turns_left"] == 0:
                sessions.pop(i)
        elif kind < 0.85:  # few-shot: a shared template + a fresh question
            t = templates[int(rng.zipf(1.3)) % len(templates)]
            prompt = np.concatenate([t, toks(rng.integers(20, 150))])
            full = np.concatenate([prompt, toks(rng.integers(1, 50))])
        else:  # a one-off prompt
            prompt = toks(rng.integers(100, 2000))
            full = np.concatenate([prompt, toks(rng.integers(1, 200))])
        out.append(Request(prompt, full))
        total += len(prompt)
    return out


def distinct_blocks(reqs: list[Request], bs: int) -> int:
    """Blocks a pool needs to hold every full block of every committed sequence (counted with an unlimited cache)."""
    cache = PrefixCache(CacheConfig(num_blocks=sum(len(r.full) // bs for r in reqs) + 1, block_size=bs))
    for r in reqs:
        m = cache.match(r.prompt)
        cache.commit(m.handle, r.full)
        cache.release(m.handle)
    return cache.num_cached_blocks


def run_tokens(cache: PrefixCache, reqs: list[Request]) -> tuple[float, np.ndarray, int, int]:
    """Replay ``reqs``; returns (seconds, per-request ns, prompt tokens, cached tokens)."""
    lat = np.empty(len(reqs), dtype=np.int64)
    clock = time.perf_counter_ns
    match, commit, release = cache.match, cache.commit, cache.release
    hit0 = cache.stats.cached_tokens
    gc.collect()
    gc.disable()
    try:
        t0 = clock()
        for i, r in enumerate(reqs):
            a = clock()
            m = match(r.prompt)
            commit(m.handle, r.full)
            release(m.handle)
            lat[i] = clock() - a
        secs = (clock() - t0) / 1e9
    finally:
        gc.enable()
    return secs, lat, sum(len(r.prompt) for r in reqs), cache.stats.cached_tokens - hit0


def load_trace(name: str) -> list[tuple[list[int], int]] | None:
    path = TRACES / name
    if not path.exists():
        return None
    rows = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            d = json.loads(line)
            rows.append((d["hash_ids"], int(d["input_length"])))
    return rows


def run_keys(cache: PrefixCache, rows: list[tuple[list[int], int]]) -> tuple[float, np.ndarray, int, int]:
    lat = np.empty(len(rows), dtype=np.int64)
    clock = time.perf_counter_ns
    match, commit, release = cache.match_keys, cache.commit_keys, cache.release
    gc.collect()
    gc.disable()
    try:
        t0 = clock()
        for i, (keys, n) in enumerate(rows):
            a = clock()
            m = match(keys, num_tokens=n)
            commit(m.handle)
            release(m.handle)
            lat[i] = clock() - a
        secs = (clock() - t0) / 1e9
    finally:
        gc.enable()
    return secs, lat, sum(n for _, n in rows), cache.stats.cached_tokens


def row(
    workload: str, cache: PrefixCache, secs: float, lat: np.ndarray, tokens: int, hit: int, floor: np.ndarray, **extra
) -> dict:
    cache.check_integrity()
    return {
        "workload": workload,
        "block_size": cache.block_size,
        "capacity_tokens": cache.config.capacity_tokens,
        "cached_blocks_at_start": extra.pop("cached_at_start", 0),
        "requests": len(lat),
        "prompt_tokens": tokens,
        "mtok_per_s": tokens / secs / 1e6,
        "us_per_request": secs / len(lat) * 1e6,
        "min_us_per_request": float(floor.mean()) / 1e3,  # mean over requests of each one's fastest run
        "p50_us": float(np.percentile(lat, 50)) / 1e3,
        "p99_us": float(np.percentile(lat, 99)) / 1e3,
        "token_hit_rate": hit / tokens if tokens else 0.0,
        "block_hit_rate": cache.stats.block_hit_rate,
        "blocks_evicted": cache.stats.blocks_evicted,
        **extra,
    }


def best_of(repeat: int, make_cache, runner, data) -> tuple[PrefixCache, tuple]:
    """Run ``repeat`` times on fresh caches; keep the run with the median throughput, and add the per-request
    minimum over all runs (every run does the same work, so load from other processes only adds time)."""
    runs = []
    for _ in range(repeat):
        cache = make_cache()
        runs.append((cache, runner(cache, data)))
    floor = np.min(np.stack([r[1][1] for r in runs]), axis=0)
    runs.sort(key=lambda cr: cr[1][0])
    cache, res = runs[len(runs) // 2]
    return cache, (*res, floor)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller workloads (about 0.5M tokens)")
    ap.add_argument("--json", type=Path, help="write the rows (and the run's meta) as JSON to this file")
    ap.add_argument("--repeat", type=int, default=3, help="runs per row; the median-throughput run is kept")
    args = ap.parse_args()
    meta = _meta.begin()
    console = Console(width=None if Console().is_terminal else 170)
    rows: list[dict] = []
    bs = 16
    total = 500_000 if args.quick else 2_500_000
    console.print(f"[dim]generating ~{total:,} prompt tokens (seed 0) ...[/]")
    reqs = synthetic_workload(total)
    need = distinct_blocks(reqs, bs)
    console.print(f"[dim]{len(reqs):,} requests, {need:,} distinct blocks[/]")

    for label, nb in (("synthetic, holds all", need), ("synthetic, 25%", max(1, need // 4))):
        cache, res = best_of(
            args.repeat, lambda nb=nb: PrefixCache(CacheConfig(num_blocks=nb, block_size=bs)), run_tokens, reqs
        )
        rows.append(row(label, cache, *res))

    # 10x pool, 9x of it already cached with unrelated prompts: per-request cost must stay flat.
    rng = np.random.default_rng(1)
    filler = [rng.integers(0, VOCAB, 4096, dtype=np.int32) for _ in range(9 * need * bs // 4096 + 1)]

    def prefilled() -> PrefixCache:
        c = PrefixCache(CacheConfig(num_blocks=10 * need + len(filler) * 4096 // bs, block_size=bs))
        for t in filler:
            m = c.match(t)
            c.commit(m.handle)
            c.release(m.handle)
        c.stats = CacheStats()  # count only the timed workload
        return c

    cache, res = best_of(args.repeat, prefilled, run_tokens, reqs)
    start = len(filler) * (4096 // bs)
    rows.append(row("synthetic, 10x pool prefilled 9x", cache, *res, cached_at_start=start))

    for name, caps in (
        ("mooncake_conversation_trace.jsonl.gz", (1_000, 10_000, None)),
        ("mooncake_synthetic_trace.jsonl.gz", (10_000, None)),
    ):
        trace = load_trace(name)
        if trace is None:
            console.print(f"[yellow]{name} not found under {TRACES}; skipped[/]")
            continue
        if args.quick:
            trace = trace[: len(trace) // 4]
        unlimited = sum(len(k) for k, _ in trace)
        for cap in caps:
            nb = unlimited if cap is None else cap
            cache, res = best_of(
                args.repeat, lambda nb=nb: PrefixCache(CacheConfig(num_blocks=nb, block_size=512)), run_keys, trace
            )
            label = f"{name.split('_')[1]} trace, {'unlimited' if cap is None else f'{cap:,} blocks'}"
            rows.append(row(label, cache, *res))

    table = Table(title=f"PrefixCache tree throughput (match + commit + release; median of {args.repeat})")
    for col in (
        "workload",
        "bs",
        "capacity tok",
        "requests",
        "prompt tok",
        "M tok/s",
        "µs/req",
        "min µs/req",
        "p50 µs",
        "p99 µs",
        "token hit",
        "block hit",
        "evicted",
    ):
        table.add_column(col, justify="left" if col == "workload" else "right")
    for r in rows:
        table.add_row(
            r["workload"],
            str(r["block_size"]),
            f"{r['capacity_tokens']:,}",
            f"{r['requests']:,}",
            f"{r['prompt_tokens']:,}",
            f"{r['mtok_per_s']:.1f}",
            f"{r['us_per_request']:.1f}",
            f"{r['min_us_per_request']:.1f}",
            f"{r['p50_us']:.1f}",
            f"{r['p99_us']:.1f}",
            f"{r['token_hit_rate']:.3f}",
            f"{r['block_hit_rate']:.4f}",
            f"{r['blocks_evicted']:,}",
        )
    console.print(table)
    base, big = rows[0], rows[2]
    console.print(
        f"cost per request with {big['cached_blocks_at_start']:,} extra cached blocks: "
        f"{big['us_per_request'] / base['us_per_request']:.2f}x the 'holds all' run"
    )
    if args.json:
        args.json.write_text(json.dumps({"meta": _meta.end(meta), "rows": rows}, indent=2))
        console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
