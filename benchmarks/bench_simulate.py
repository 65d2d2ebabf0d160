"""`prefixcache simulate` against a plain stdlib trie-LRU replay of the same trace and capacities.

For each shipped Mooncake trace (scenarios/traces, block 512) at 1,000 / 10,000 / unlimited blocks, in one
process and one run, alternating (medians of --repeat):

* ours: the whole command, ``prefixcache simulate TRACE --capacity-blocks 1000 --capacity-blocks 10000
  --capacity unlimited --json OUT`` (trace loading, the three replays, the run record built and written;
  reading the record back for the check below is not timed);
* reference: the same trace read with gzip + json, replayed at the same three capacities by a dict trie
  with an OrderedDict LRU (a request hits its leading cached blocks; the missing ones are inserted, evicting
  the least recently used leaf — the oldest entry is always a leaf, since a request touches its path
  deepest-first; nothing is written).

With --runs N the whole comparison is made N times, one after the other, and each run's medians are kept
(``runs``, ``run_ratios``): the ratio moves between runs on a shared machine, and one run's pairs do not show it.

The reference's hit counts must equal ours (an independent check of the replay). Optionally (--kvtester
FILE, not shipped) the kv-cache-tester trace at one capacity, loading included.

Miss causes (``prefixcache.sim.causes``) cost: the same three replays through ``prefixcache.sim.replay.simulate``
with and without them (``causes=False``), alternating, each on a freshly rendered workload (so the workload's
part of the analysis is included every time), in CPU seconds of this process (robust to other processes on a
shared machine), medians of --repeat; also two token scenarios (5x the repeats). The causes must not make
simulate more than 1.3x slower on the Mooncake traces.

    python benchmarks/bench_simulate.py [--repeat 3] [--runs 1] [--json FILE] [--kvtester FILE --kvtester-blocks N]
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import statistics
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

from rich.console import Console
from rich.table import Table

import _meta
from prefixcache.cli import app
from prefixcache.sim.policy import Capacity
from prefixcache.sim.replay import simulate
from prefixcache.sim.requests import from_scenario, from_trace
from prefixcache.workload.scenario import load_scenario
from prefixcache.workload.trace import load_trace

TRACES = Path(__file__).resolve().parents[1] / "scenarios" / "traces"
MOONCAKE = ("mooncake_conversation_trace.jsonl.gz", "mooncake_synthetic_trace.jsonl.gz")
CAPACITIES = (1_000, 10_000, None)
SCENARIOS = Path(__file__).resolve().parents[1] / "scenarios"
TOKEN_SCENARIOS = ("chat.yaml", "rag.yaml")  # token mode, at 64 and 1,024 blocks and unlimited


def cpu_timed(fn):
    """CPU seconds of this process running ``fn`` (other processes' load on a shared machine barely moves it)."""
    gc.collect()
    t = time.process_time()
    fn()
    return time.process_time() - t


def causes_cost(reqs_of, caps, repeat: int) -> dict:
    """CPU seconds of ``simulate`` without and with miss causes, alternating, fresh requests each time: medians
    of each, and the median of the pairs' ratios (each pair ran back to back)."""
    without, with_ = [], []
    for _ in range(repeat):
        without.append(cpu_timed(lambda: simulate(reqs_of(), caps, causes=False)))
        with_.append(cpu_timed(lambda: simulate(reqs_of(), caps)))
    return {
        "without_s": statistics.median(without),
        "with_s": statistics.median(with_),
        "ratio": statistics.median(b / a for a, b in zip(without, with_)),
        "without_runs_s": without,
        "with_runs_s": with_,
    }


def reference_replay(path: Path, capacities: tuple[int | None, ...]) -> tuple[list[int], list[int]]:
    """Hit blocks and hit tokens per capacity, stdlib only (see the module docstring)."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        reqs = [json.loads(line) for line in f if line.strip()]
    hit_blocks, hit_tokens = [], []
    for cap in capacities:
        limit = float("inf") if cap is None else cap
        root: dict = {}
        lru: OrderedDict = OrderedDict()  # node id -> (parent dict, key); oldest first
        hb = ht = 0
        for r in reqs:
            ids, n = r["hash_ids"], r["input_length"]
            node, path, h = root, [], 0
            for k in ids:  # leading cached blocks
                child = node.get(k)
                if child is None:
                    break
                path.append((node, k, child))
                node = child[0]
                h += 1
            hb += h
            ht += min(h * 512, n)
            for _, _, child in reversed(path):  # deepest first: the root end of the path ends newest
                lru.move_to_end(child[1])
            on_path = {child[1] for _, _, child in path}
            for k in ids[h:]:
                while len(lru) >= limit:
                    victim = next(iter(lru))
                    if victim in on_path:
                        break
                    vparent, vkey = lru.pop(victim)
                    del vparent[vkey]
                if len(lru) >= limit:
                    break
                child = ({}, object())
                node[k] = child
                lru[child[1]] = (node, k)
                path.append((node, k, child))
                on_path.add(child[1])
                node = child[0]
            for _, _, child in reversed(path[h:]):
                lru.move_to_end(child[1])
            for _, _, child in reversed(path[:h]):
                lru.move_to_end(child[1])
        hit_blocks.append(hb)
        hit_tokens.append(ht)
    return hit_blocks, hit_tokens


def ours(path: Path, out: Path) -> None:
    """Run the simulate command in-process (its record is read back, untimed, by ``totals``)."""
    args = ["simulate", str(path), "--no-progress", "--json", str(out)]
    for c in CAPACITIES:
        args += ["--capacity", "unlimited"] if c is None else ["--capacity-blocks", str(c)]
    app(args, standalone_mode=False)


def totals(out: Path) -> list[dict]:
    """The totals of the run record ``ours`` wrote."""
    return json.loads(out.read_text())["totals"]  # type: ignore[no-any-return]


def timed(fn, *args):
    gc.collect()
    t = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--runs", type=int, default=1, help="whole comparisons, one after the other (medians of each)")
    ap.add_argument("--json", type=Path, help="write the results as JSON")
    ap.add_argument("--kvtester", type=Path, help="the kv-cache-tester trace (.jsonl.gz), if you have it")
    ap.add_argument("--kvtester-blocks", type=int, default=100_000)
    args = ap.parse_args()
    meta = _meta.begin()
    times: dict[str, list[tuple[list[float], list[float]]]] = {name: [] for name in MOONCAKE}  # per run: ours, ref
    record: dict[str, tuple[list[dict], int]] = {}  # per trace: the record's totals and its size in bytes
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        for _run in range(args.runs):
            for name in MOONCAKE:
                path = TRACES / name
                t_ours, t_ref = [], []
                for _ in range(args.repeat):
                    s, _ = timed(ours, path, out)
                    t_ours.append(s)
                    got = totals(out)
                    s, (ref_blocks, ref_tokens) = timed(reference_replay, path, CAPACITIES)
                    t_ref.append(s)
                got_blocks = [t["hit_blocks"] for t in got]
                got_tokens = [t["cached_tokens"] for t in got]
                assert got_blocks == ref_blocks and got_tokens == ref_tokens, (name, got_blocks, ref_blocks)
                times[name].append((t_ours, t_ref))
                record[name] = got, out.stat().st_size
        rows = [
            {
                "trace": name.split(".")[0],
                "capacities": ["unlimited" if c is None else c for c in CAPACITIES],
                "block_hit_rates": [round(t["block_hit_rate"], 4) for t in record[name][0]],
                "token_hit_rates": [round(t["token_hit_rate"], 4) for t in record[name][0]],
                "simulate_s": statistics.median(times[name][0][0]),  # the first run's medians
                "reference_s": statistics.median(times[name][0][1]),
                "simulate_runs_s": times[name][0][0],
                "reference_runs_s": times[name][0][1],
                "runs": [
                    {"simulate_s": statistics.median(o), "reference_s": statistics.median(r)} for o, r in times[name]
                ],
                "run_ratios": [statistics.median(o) / statistics.median(r) for o, r in times[name]],
                "json_bytes": record[name][1],
            }
            for name in MOONCAKE
        ]
    kv = None
    if args.kvtester is not None:
        t0 = time.perf_counter()
        trace = load_trace(args.kvtester)
        t1 = time.perf_counter()
        (res,) = simulate(from_trace(trace), [Capacity(args.kvtester_blocks)])
        t2 = time.perf_counter()
        tot = res.totals()
        kv = {
            "requests": len(trace),
            "block_refs": trace.num_blocks,
            "blocks": args.kvtester_blocks,
            "load_s": t1 - t0,
            "replay_s": t2 - t1,
            "token_hit_rate": tot["token_hit_rate"],
            "block_hit_rate": tot["block_hit_rate"],
        }
    causes_rows = []
    caps = [Capacity(c) for c in CAPACITIES]
    for name in MOONCAKE:
        trace = load_trace(TRACES / name)
        cost = causes_cost(lambda trace=trace: from_trace(trace), caps, args.repeat)
        causes_rows.append({"workload": name.split(".")[0], "requests": len(trace), **cost})
    for name in TOKEN_SCENARIOS:
        sc = load_scenario(SCENARIOS / name)
        bs = sc.block_size or 16
        sc_caps = [Capacity(64), Capacity(1024), Capacity(None)]
        cost = causes_cost(lambda sc=sc, bs=bs: from_scenario(sc, bs), sc_caps, 5 * args.repeat)
        causes_rows.append({"workload": name, "requests": len(sc), **cost})
    table = Table(title=f"prefixcache simulate vs a stdlib trie-LRU replay (3 capacities, median of {args.repeat})")
    for col in ("trace", "block hit rate (1k / 10k / unl.)", "simulate s", "reference s", "simulate / reference"):
        table.add_column(col, justify="left" if col == "trace" else "right")
    for r in rows:
        table.add_row(
            r["trace"],
            " / ".join(f"{x:.4f}" for x in r["block_hit_rates"]),
            f"{r['simulate_s']:.2f}",
            f"{r['reference_s']:.2f}",
            f"{r['simulate_s'] / r['reference_s']:.2f}x",
        )
    console = Console(width=140)
    console.print(table)
    ctab = Table(title=f"simulate with / without miss causes (3 capacities, CPU seconds, median of {args.repeat})")
    for col in ("workload", "requests", "without causes s", "with causes s", "with / without (median pair)"):
        ctab.add_column(col, justify="left" if col == "workload" else "right")
    for r in causes_rows:
        ctab.add_row(
            r["workload"], f"{r['requests']:,}", f"{r['without_s']:.3f}", f"{r['with_s']:.3f}", f"{r['ratio']:.2f}x"
        )
    console.print(ctab)
    if kv:
        console.print(
            f"kv-cache-tester at {kv['blocks']:,} blocks: load {kv['load_s']:.1f} s, replay "
            f"{kv['replay_s']:.1f} s, token hit rate {kv['token_hit_rate']:.4f}"
        )
    if args.json:
        doc = {"meta": _meta.end(meta), "rows": rows, "kvtester": kv, "causes": causes_rows}
        args.json.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
