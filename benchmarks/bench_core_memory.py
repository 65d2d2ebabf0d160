"""Memory of the cache core: what a cache costs is what it holds, never its configured capacity.

Each figure is measured in a fresh subprocess (peak RSS from getrusage of that child alone):

(a) ``prefixcache simulate scenarios/chat.yaml -c 1G``: peak RSS of the whole command (target < 300 MB);
(b) the same scenario at ``--capacity-blocks 1000000000000``: served or refused in one line, never a traceback;
(c) 40,000 requests, each in a new namespace, through one PrefixCache of 512 blocks: RSS growth after a
    warm-up (target < 5 MB);
(d) constructing ``PrefixCache(CacheConfig(num_blocks=2**40))`` and serving one request: seconds and RSS growth.

Uses whatever ``prefixcache`` is importable from a neutral directory (set PYTHONPATH to compare checkouts).

    python benchmarks/bench_core_memory.py [--json FILE] [--timeout S]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from rich.console import Console
from rich.table import Table

import _meta

ROOT = Path(__file__).resolve().parents[1]

# Runs argv[1:] as its own child and prints that child's peak RSS (KiB) and exit status as JSON.
PEAK = textwrap.dedent(
    """
    import json, resource, subprocess, sys, time
    t = time.perf_counter()
    p = subprocess.run(sys.argv[1:], capture_output=True, text=True)
    out = (p.stdout + p.stderr).strip().splitlines()
    print(json.dumps({"rc": p.returncode, "peak_kib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,
                      "seconds": time.perf_counter() - t, "lines": len(out),
                      "traceback": any(line.startswith("Traceback") for line in out),
                      "last": out[-1] if out else ""}))
    """
)

NAMESPACES = textwrap.dedent(
    """
    import gc, json, sys
    import numpy as np
    from prefixcache import CacheConfig, PrefixCache

    def rss_kib():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))

    n = int(sys.argv[1])
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 32000, 200, dtype=np.int32) for _ in range(64)]
    cache = PrefixCache(CacheConfig(num_blocks=512, block_size=16))

    def serve(i):
        m = cache.match(prompts[i % 64], namespace=f"tenant-{i}")
        cache.commit(m.handle)
        cache.release(m.handle)

    for i in range(5000):  # warm-up: the pool fills and every structure reaches its steady size
        serve(i)
    gc.collect()
    before = rss_kib()
    for i in range(5000, 5000 + n):
        serve(i)
    gc.collect()
    after = rss_kib()
    cache.check_integrity()
    print(json.dumps({"before_kib": before, "after_kib": after, "roots": len(cache.tree.roots),
                      "cached_blocks": cache.num_cached_blocks}))
    """
)

HUGE_POOL = textwrap.dedent(
    """
    import json, time
    def rss_kib():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    from prefixcache import CacheConfig, PrefixCache
    before = rss_kib()
    t = time.perf_counter()
    cache = PrefixCache(CacheConfig(num_blocks=2**40, block_size=16))
    made = time.perf_counter() - t
    with cache.lookup(list(range(1000))) as m:
        r = cache.commit(m.handle)
    cache.check_integrity()
    print(json.dumps({"construct_s": made, "rss_growth_kib": rss_kib() - before, "served_blocks": r.cached_blocks,
                      "free_blocks": cache.num_free_blocks}))
    """
)


def run_json(args: list[str], timeout: float) -> dict:
    """Run a child that prints one JSON line; a timeout or crash comes back as {"error": ...}."""
    try:
        # A neutral working directory: ``python -c`` puts it first on sys.path, ahead of PYTHONPATH.
        p = subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=tempfile.gettempdir())
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = p.stdout.strip().splitlines()
    if p.returncode or not lines:
        tail = (p.stderr.strip().splitlines() or ["?"])[-1]
        return {"error": f"exit {p.returncode}: {tail}"}
    return json.loads(lines[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="write the rows (and the run's meta) as JSON to this file")
    ap.add_argument("--timeout", type=float, default=300, help="seconds allowed per measurement")
    ap.add_argument("--requests", type=int, default=40_000, help="requests in new namespaces for (c)")
    args = ap.parse_args()
    meta = _meta.begin()
    console = Console(width=None if Console().is_terminal else 150)
    py = sys.executable
    cli = [py, "-c", "from prefixcache.cli import main; main()"]
    rows: list[dict] = []

    for label, extra in (
        ("simulate chat.yaml -c 1G", ["-c", "1G"]),
        ("simulate chat.yaml --capacity-blocks 10**12", ["--capacity-blocks", "1000000000000"]),
    ):
        r = run_json([py, "-c", PEAK, *cli, "simulate", str(ROOT / "scenarios" / "chat.yaml"), *extra], args.timeout)
        value = f"{r['peak_kib'] / 1024:.0f} MB peak RSS" if "peak_kib" in r else r["error"]
        note = ""
        if "rc" in r:
            rc = r["rc"]
            note = "served" if rc == 0 else f"killed by signal {-rc}" if rc < 0 else f"refused (exit {rc}): {r['last']}"
            note += f", {r['seconds']:.1f} s" + (", TRACEBACK" if r["traceback"] else "")
        rows.append({"measure": label, "value": value, "note": note, **r})

    r = run_json([py, "-c", NAMESPACES, str(args.requests)], args.timeout)
    if "error" in r:
        rows.append({"measure": f"{args.requests:,} requests in new namespaces", "value": r["error"], "note": ""})
    else:
        growth = (r["after_kib"] - r["before_kib"]) / 1024
        rows.append(
            {
                "measure": f"{args.requests:,} requests in new namespaces: RSS growth",
                "value": f"{growth:.2f} MB ({growth * 1024:+.0f} KiB)",
                "note": f"{r['roots']} namespace roots, {r['cached_blocks']} blocks cached at the end",
                "growth_mb": growth,
                **r,
            }
        )

    r = run_json([py, "-c", HUGE_POOL], args.timeout)
    if "error" in r:
        rows.append({"measure": "PrefixCache(num_blocks=2**40)", "value": r["error"], "note": ""})
    else:
        rows.append(
            {
                "measure": "PrefixCache(num_blocks=2**40): construct",
                "value": f"{r['construct_s'] * 1e3:.2f} ms",
                "note": f"RSS +{r['rss_growth_kib'] / 1024:.2f} MB incl. one request ({r['served_blocks']} blocks)",
                **r,
            }
        )

    table = Table(title="Cache core memory (each in a fresh subprocess)")
    for col in ("measure", "value", "note"):
        table.add_column(col)
    for row in rows:
        table.add_row(row["measure"], row["value"], row["note"])
    console.print(table)
    if args.json:
        args.json.write_text(json.dumps({"meta": _meta.end(meta), "rows": rows}, indent=2))
        console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
