"""Hit-rate curves: the one-pass LRU curve against separate replays, the kv-tester trace's full curve, and
the Mooncake paper's Figure 9 points.

(a) Mooncake traces (file order, no warm-up): the full LRU curve (every capacity, node numbering included)
    against 3 single-capacity replays through PrefixCache (1,000 / 10,000 blocks / unlimited); medians of
    --repeat runs in the same process; the curve's values at those capacities must equal the replays'.
(b) kv-cache-tester trace, sessions interleaved by timestamp (and, for comparison, file order): load, stable
    sort, node numbering, full LRU curve; plus the optimal bound at a few capacities.
(c) Mooncake synthetic trace, token-weighted, blocks of 512: LRU (and the optimal bound) at 1M/2M/3M/10M
    tokens beside the paper's Figure 9 (about 14%, 23%, 31%, 58%).

    python benchmarks/bench_curves.py [--quick] [--repeat N] [--json FILE] [--kvtester FILE [--check-kvtester-replay]]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

import _meta
from prefixcache.sim.lru_curve import lru_curve
from prefixcache.sim.node_trace import canonical_blocks
from prefixcache.sim.optimal import next_uses, optimal_hits
from prefixcache.sim.policy import Capacity
from prefixcache.sim.replay import replay as run_replay
from prefixcache.sim.requests import from_trace
from prefixcache.workload.order import ordered
from prefixcache.workload.trace import load_trace

TRACES = Path(__file__).resolve().parents[1] / "scenarios" / "traces"
MOONCAKE = ("mooncake_conversation_trace.jsonl.gz", "mooncake_synthetic_trace.jsonl.gz")
FIG9 = ((1_000_000, 0.14), (2_000_000, 0.23), (3_000_000, 0.31), (10_000_000, 0.58))  # tokens, paper's rate

console = Console(width=160)


def timed(fn, repeat: int):
    times, out = [], None
    for _ in range(repeat):
        gc.collect()
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def replay(trace, capacity: int) -> tuple[int, int]:
    """Hit blocks and hit tokens of one replay through the shared loop (prefixcache.sim.replay)."""
    t = run_replay(from_trace(trace), Capacity(capacity), causes=False).totals()  # as the curve: hits only
    return t["hit_blocks"], t["cached_tokens"]


def bench_mooncake(repeat: int) -> list[dict]:
    rows = []
    for name in MOONCAKE:
        tr = load_trace(TRACES / name)
        t_curve, curve = timed(lambda: lru_curve(canonical_blocks(tr)), repeat)
        W = curve.max_capacity
        caps = (1_000, 10_000, W)
        t_replays = 0.0
        for c in caps:
            t, (hb, ht) = timed(lambda: replay(tr, c), repeat)
            t_replays += t
            assert (curve.hits(c), curve.hits(c, "tokens")) == (hb, ht), f"{name}: curve != replay at {c} blocks"
        rows.append(
            {
                "trace": name,
                "requests": len(tr),
                "block_refs": tr.num_blocks,
                "working_set": W,
                "curve_s": t_curve,
                "three_replays_s": t_replays,
                "ratio": t_replays / t_curve,
                "rate_1000": curve.hit_rate(1000),
                "rate_10000": curve.hit_rate(10_000),
                "rate_unlimited": curve.hit_rate(W),
            }
        )
    return rows


def bench_kvtester(path: Path, check_replay: bool) -> list[dict]:
    rows = []
    t = time.perf_counter()
    raw = load_trace(path)
    t_load = time.perf_counter() - t
    for order in ("timestamp", "file"):
        t0 = time.perf_counter()
        tr = ordered(raw, order)
        t_sort = time.perf_counter() - t0
        t1 = time.perf_counter()
        nt = canonical_blocks(tr)
        t_nodes = time.perf_counter() - t1
        t2 = time.perf_counter()
        curve = lru_curve(nt)
        t_curve = time.perf_counter() - t2
        t3 = time.perf_counter()
        nu = next_uses(nt)
        opt = {c: optimal_hits(nt, c, nu=nu).hit_blocks / curve.total_blocks for c in (10_000, 100_000, 1_000_000)}
        t_opt = time.perf_counter() - t3
        row = {
            "order": order,
            "requests": len(tr),
            "block_refs": tr.num_blocks,
            "working_set": nt.num_nodes,
            "load_s": t_load,
            "sort_s": t_sort,
            "nodes_s": t_nodes,
            "curve_s": t_curve,
            "total_s": t_load + t_sort + t_nodes + t_curve,
            "optimal_3_caps_s": t_opt,
            "lru": {c: curve.hit_rate(c) for c in (1_000, 10_000, 100_000, 1_000_000, nt.num_nodes)},
            "optimal": opt,
        }
        if check_replay and order == "timestamp":
            t4 = time.perf_counter()
            hb, _ = replay(tr, 100_000)
            row["replay_100000_s"] = time.perf_counter() - t4
            assert hb == curve.hits(100_000), "kv-tester: curve != replay at 100,000 blocks"
        rows.append(row)
        del tr, nt, curve
    return rows


def bench_fig9() -> list[dict]:
    tr = load_trace(TRACES / "mooncake_synthetic_trace.jsonl.gz")
    nt = canonical_blocks(tr)
    curve = lru_curve(nt)
    nu = next_uses(nt)
    unl_t = curve.hits(nt.num_nodes, "tokens")
    rows = []
    for tokens, paper in FIG9:
        c = tokens // tr.block_size
        o = optimal_hits(nt, c, nu=nu, unlimited_tokens=unl_t)
        rows.append(
            {
                "tokens": tokens,
                "blocks": c,
                "paper": paper,
                "lru": curve.hit_rate(c, "tokens"),
                "optimal_bound": o.hit_tokens / curve.total_tokens,
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="Mooncake parts only (skip the 94M-reference trace)")
    ap.add_argument(
        "--check-kvtester-replay",
        action="store_true",
        help="also replay the interleaved kv-tester trace at 100,000 blocks and compare (slow)",
    )
    ap.add_argument("--json", type=Path)
    ap.add_argument("--kvtester", type=Path, help="the kv-cache-tester trace (.jsonl.gz; not shipped) for part (b)")
    args = ap.parse_args()
    meta = _meta.begin()
    out: dict = {}

    out["mooncake"] = rows = bench_mooncake(args.repeat)
    t = Table(
        title=f"(a) Full LRU curve vs 3 single-capacity replays (1,000 / 10,000 / unlimited blocks), "
        f"median of {args.repeat}",
        title_justify="left",
    )
    for h in (
        "trace",
        "requests",
        "block refs",
        "curve s",
        "3 replays s",
        "replays / curve",
        "hit@1k",
        "hit@10k",
        "hit@unl",
    ):
        t.add_column(h, justify="left" if h == "trace" else "right")
    for r in rows:
        t.add_row(
            r["trace"],
            f"{r['requests']:,}",
            f"{r['block_refs']:,}",
            f"{r['curve_s']:.3f}",
            f"{r['three_replays_s']:.3f}",
            f"{r['ratio']:.1f}x",
            f"{r['rate_1000']:.4f}",
            f"{r['rate_10000']:.4f}",
            f"{r['rate_unlimited']:.4f}",
        )
    console.print(t)

    out["fig9"] = rows = bench_fig9()
    t = Table(
        title="(c) Mooncake synthetic trace, token-weighted, blocks of 512: ours vs the paper's Figure 9",
        title_justify="left",
    )
    for h in ("capacity (tokens)", "blocks", "paper (Fig. 9)", "LRU (ours)", "optimal bound"):
        t.add_column(h, justify="right")
    for r in rows:
        t.add_row(
            f"{r['tokens']:,}", f"{r['blocks']:,}", f"~{r['paper']:.0%}", f"{r['lru']:.1%}", f"{r['optimal_bound']:.1%}"
        )
    console.print(t)

    if not args.quick and args.kvtester is not None:
        out["kvtester"] = rows = bench_kvtester(args.kvtester, args.check_kvtester_replay)
        t = Table(
            title="(b) kv-cache-tester trace: full LRU curve (seconds), block-weighted hit rates", title_justify="left"
        )
        for h in (
            "order",
            "block refs",
            "load",
            "sort",
            "nodes",
            "curve",
            "total",
            "LRU@10k",
            "LRU@100k",
            "LRU@1M",
            "unlimited",
            "opt@10k",
            "opt@100k",
            "opt@1M",
            "opt 3 caps s",
        ):
            t.add_column(h, justify="right")
        for r in rows:
            W = r["working_set"]
            t.add_row(
                r["order"],
                f"{r['block_refs']:,}",
                f"{r['load_s']:.1f}",
                f"{r['sort_s']:.1f}",
                f"{r['nodes_s']:.1f}",
                f"{r['curve_s']:.1f}",
                f"{r['total_s']:.1f}",
                f"{r['lru'][10_000]:.4f}",
                f"{r['lru'][100_000]:.4f}",
                f"{r['lru'][1_000_000]:.4f}",
                f"{r['lru'][W]:.4f}",
                f"{r['optimal'][10_000]:.4f}",
                f"{r['optimal'][100_000]:.4f}",
                f"{r['optimal'][1_000_000]:.4f}",
                f"{r['optimal_3_caps_s']:.1f}",
            )
        console.print(t)
        for r in rows:
            if "replay_100000_s" in r:
                console.print(
                    f"kv-tester interleaved: replay at 100,000 blocks took {r['replay_100000_s']:.1f} s "
                    "and equals the curve"
                )
    if args.json:
        args.json.write_text(json.dumps({"meta": _meta.end(meta), **out}, indent=1, default=str))
        console.print(f"JSON written to {args.json}")


if __name__ == "__main__":
    main()
