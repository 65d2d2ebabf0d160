"""Model-free replay speed: `prefixcache simulate`'s engine on the real traces (no model).

(a) both Mooncake traces (block 512) at 3 capacities each: load once, one replay per capacity;
    target: under 10 s in total.
(b) the kv-cache-tester trace (49k requests, 94M block references, block 64) at one capacity, loading
    (gunzip + json.loads per line) included; target: under 2 minutes.

Reports wall seconds, requests and block references per second, and the hit rates. Traces live in
../shared/data/traces (a sibling of the repo root); missing ones are skipped.

    python benchmarks/bench_simulate.py [--json FILE] [--skip-kvtester] [--kvtester-blocks N]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from prefixcache.sim.replay import simulate_trace
from prefixcache.workload.trace import load_trace

TRACES = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "traces"
MOONCAKE = {
    "mooncake_conversation_trace.jsonl": (1_000, 10_000, None),
    "mooncake_synthetic_trace.jsonl": (1_000, 10_000, None),
}
KVTESTER = "kvtester_claude_code_710sessions.jsonl.gz"


def bench_trace(name: str, capacities: tuple, rows: list[dict]) -> float:
    """Load ``name`` and replay it at each capacity; appends one row per replay; returns total seconds."""
    t0 = time.perf_counter()
    trace = load_trace(TRACES / name)
    load_s = time.perf_counter() - t0
    unique = None
    for k, cap in enumerate(capacities):
        t = time.perf_counter()
        if cap is None:
            unique = unique or trace.unique_blocks()
        res = simulate_trace(trace, cap or unique, unlimited=cap is None)
        s = time.perf_counter() - t
        tot = res.totals()
        rows.append(
            {
                "trace": name,
                "requests": len(trace),
                "block_refs": trace.num_blocks,
                "block_size": trace.block_size,
                "capacity_blocks": cap,
                "pool_blocks": cap or unique,
                "load_s": load_s if k == 0 else 0.0,
                "replay_s": s,
                "refs_per_s": trace.num_blocks / s,
                "requests_per_s": len(trace) / s,
                "token_hit_rate": tot["token_hit_rate"],
                "block_hit_rate": tot["block_hit_rate"],
            }
        )
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, help="write the results as JSON")
    ap.add_argument("--skip-kvtester", action="store_true", help="only the Mooncake traces")
    ap.add_argument("--kvtester-blocks", type=int, default=100_000, help="capacity for the kv-tester replay")
    args = ap.parse_args()
    rows: list[dict] = []
    summary: dict = {}
    present = [n for n in MOONCAKE if (TRACES / n).is_file()]
    if present:
        summary["mooncake_total_s"] = sum(bench_trace(n, MOONCAKE[n], rows) for n in present)
        summary["mooncake_target_s"] = 10.0
    if not args.skip_kvtester and (TRACES / KVTESTER).is_file():
        summary["kvtester_total_s"] = bench_trace(KVTESTER, (args.kvtester_blocks,), rows)
        summary["kvtester_target_s"] = 120.0
    table = Table(title="simulate: model-free replay through PrefixCache (LRU, file order, no warm-up)")
    for col in (
        "trace",
        "capacity (blocks)",
        "requests",
        "block refs",
        "load s",
        "replay s",
        "M refs/s",
        "token hit",
        "block hit",
    ):
        table.add_column(col, justify="left" if col == "trace" else "right")
    for r in rows:
        table.add_row(
            r["trace"].split(".")[0].replace("_trace", "").replace("_claude_code_710sessions", ""),
            "unlimited" if r["capacity_blocks"] is None else f"{r['capacity_blocks']:,}",
            f"{r['requests']:,}",
            f"{r['block_refs']:,}",
            f"{r['load_s']:.2f}",
            f"{r['replay_s']:.2f}",
            f"{r['refs_per_s'] / 1e6:.2f}",
            f"{r['token_hit_rate']:.4f}",
            f"{r['block_hit_rate']:.4f}",
        )
    console = Console()
    if not console.is_terminal:
        console = Console(width=130)
    console.print(table)
    for key, label in (
        ("mooncake", "both Mooncake traces, 3 capacities each, loading included"),
        ("kvtester", "kv-cache-tester trace, one capacity, loading included"),
    ):
        if f"{key}_total_s" in summary:
            s, target = summary[f"{key}_total_s"], summary[f"{key}_target_s"]
            console.print(f"{label}: {s:.1f} s (target < {target:.0f} s) {'OK' if s < target else 'OVER'}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, **summary}, indent=1) + "\n")


if __name__ == "__main__":
    main()
