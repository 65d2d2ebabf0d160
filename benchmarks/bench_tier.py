"""The second tier (disk, LMDB; shared, Redis): the targets of its issue, on a real model.

    python benchmarks/bench_tier.py [--model small] [--parts replay,restart,fits,redis] [--json FILE]

- replay:  ``scenarios/tier_documents.yaml`` (32 documents of ~1,000 tokens, Zipf 0.8, a pool of 4,352 tokens:
           the working set is ~8x the pool) through ``engine.replay.replay`` with and without a disk tier. TTFT
           p50 of the cached runs; outputs against the uncached baseline (tier run); the measured pool and tier
           hits per request against ``prefixcache simulate --tier-capacity unlimited`` (the two-tier prediction).
- restart: a child process fills a disk tier with a long prompt; a second child (a fresh process: no pool, the
           index restored from the directory) times a never-seen prompt (cold) and the repeated one.
- fits:    the same scenario with a pool that holds everything, tier on and off, interleaved (off, on, off, on):
           what write-through costs when the tier is never read.
- redis:   two ``prefixcache serve`` processes on one redis-server (127.0.0.1, free ports): a prompt prefilled by
           the first, then sent to the second (served from the shared tier: ``cached_tokens``), outputs equal.
Prints a table and writes JSON. Timings are this machine's; compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console
from rich.table import Table

import _meta

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = ROOT / "scenarios" / "tier_documents.yaml"
POOL_TOKENS = 4352
BS = 16


def redis_server_version() -> str | None:
    """``redis-server --version``'s version, or None without a redis-server. Changes nothing."""
    try:
        out = subprocess.run(["redis-server", "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return next((w.removeprefix("v=") for w in out.split() if w.startswith("v=")), out.strip() or None)


def _p50(xs: list[float]) -> float:
    return statistics.median(xs)


def _replay(model: str, capacity: int | None, disk: Path | None, baseline: bool) -> dict[str, Any]:
    from engine.replay import replay
    from prefixcache.sim.policy import Capacity
    from prefixcache.workload.scenario import load_scenario

    scenario = load_scenario(SCENARIO)
    cap = Capacity(None if capacity is None else capacity // BS)
    t = time.perf_counter()
    results, info = replay(scenario, [cap], model=model, block_size=BS, baseline=baseline, disk_cache=disk)
    rows = results[0].rows
    return {
        "wall_s": time.perf_counter() - t,
        "ttft_p50_s": _p50([r.ttft_cached_s for r in rows]),
        "ttft_s": [r.ttft_cached_s for r in rows],
        "cached_tokens": [r.cached_tokens for r in rows],
        "tier_tokens": [getattr(r, "tier_tokens", 0) or 0 for r in rows],
        "outputs_match": None if not baseline else all(r.outputs_match for r in rows),
        "uncached_ttft_p50_s": _p50([r.ttft_uncached_s for r in rows]) if baseline else None,
        # plan's rates: prompt tokens per second of uncached TTFT (the whole prompt prefilled), tier bytes read per s
        "prefill_tokens_per_s": (sum(r.prompt_tokens for r in rows) / sum(r.ttft_uncached_s for r in rows))
        if baseline
        else None,
        "tier": info.get("tier"),
    }


def _simulated(capacity: int) -> dict[str, Any]:
    """``prefixcache simulate`` with an unlimited tier below a pool of ``capacity`` tokens: per-request tokens."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "sim.json"
        cmd = [sys.executable, "-m", "prefixcache", "simulate", str(SCENARIO), "--capacity", str(capacity)]
        cmd += ["--tier-capacity", "unlimited", "--json", str(out), "--no-progress"]
        subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True)
        record = json.loads(out.read_text())
    cols = record["runs"][0]["rows"]  # columns: field -> one value per request
    return {"cached_tokens": cols["cached_tokens"], "tier_tokens": [t or 0 for t in cols["tier_tokens"]]}


def part_replay(model: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(dir=ROOT.parent if os.access(ROOT.parent, os.W_OK) else None) as d:
        off = _replay(model, POOL_TOKENS, None, baseline=False)
        on = _replay(model, POOL_TOKENS, Path(d), baseline=True)
    sim = _simulated(POOL_TOKENS)
    tier = next(iter((on["tier"] or {}).values()), {})
    read_rate = tier["tier_read_bytes"] / tier["tier_read_s"] if tier.get("tier_read_s") else None
    return {
        "prefill_tokens_per_s": on["prefill_tokens_per_s"],
        "tier_read_bytes_per_s": read_rate,
        "off": off,
        "on": on,
        "ttft_p50_ratio": on["ttft_p50_s"] / off["ttft_p50_s"],
        "simulated": sim,
        "matches_simulate": sim["cached_tokens"] == on["cached_tokens"] and sim["tier_tokens"] == on["tier_tokens"],
        "pool_hit_tokens": sum(on["cached_tokens"]) - sum(on["tier_tokens"]),
        "tier_hit_tokens": sum(on["tier_tokens"]),
        "hit_tokens_without_tier": sum(off["cached_tokens"]),
    }


_CHILD = """
import json, sys, time, torch
sys.path.insert(0, sys.argv[4])
from engine import PrefixCachedModel
from engine.models import load_model
from engine.replay import TTFTStreamer
model, tok = load_model(sys.argv[2])
t0 = time.perf_counter()
pcm = PrefixCachedModel(model, max_cached_tokens=8192, disk_cache=sys.argv[1])
ready = time.perf_counter() - t0
def ttft(ids):
    s = TTFTStreamer(); t = time.perf_counter()
    with torch.inference_mode():
        out = pcm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False, streamer=s)
    return s.first - t, out[0, ids.shape[1]:].tolist()
g = torch.Generator().manual_seed(int(sys.argv[3]))
prompt = torch.randint(0, 250, (1, 2048), generator=torch.Generator().manual_seed(7))
fresh = torch.randint(0, 250, (1, 2048), generator=g)
ttft(torch.randint(0, 250, (1, 64), generator=torch.Generator().manual_seed(99)))  # first-call costs, untimed
result = {"ready_s": ready, "restored_blocks": pcm.tier.restored_blocks, "restore_s": pcm.tier.restore_s}
if sys.argv[3] == "0":
    result["fill_ttft_s"], result["out"] = ttft(prompt)
else:
    result["cold_ttft_s"], _ = ttft(fresh)
    result["repeat_ttft_s"], result["out"] = ttft(prompt)
    result["tier_tokens"] = pcm.last_request_stats[0].tier_tokens
pcm.close()
print(json.dumps(result))
"""


def part_restart(model: str) -> dict[str, Any]:
    def child(d: str, which: int) -> dict[str, Any]:
        cmd = [sys.executable, "-c", _CHILD, d, model, str(which), str(ROOT)]
        return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])

    with tempfile.TemporaryDirectory() as d:
        fill = child(d, 0)
        again = child(d, 1)
    return {
        "fill": fill,
        "restart": again,
        "repeat_over_cold": again["repeat_ttft_s"] / again["cold_ttft_s"],
        "outputs_equal": fill["out"] == again["out"],
    }


def part_fits(model: str) -> dict[str, Any]:
    runs: dict[str, list[float]] = {"off": [], "on": []}
    for which in ("off", "on", "off", "on"):
        with tempfile.TemporaryDirectory() as d:
            r = _replay(model, None, Path(d) if which == "on" else None, baseline=False)
        runs[which].append(r["ttft_p50_s"])
    off, on = _p50(runs["off"]), _p50(runs["on"])
    return {"ttft_p50_off_s": runs["off"], "ttft_p50_on_s": runs["on"], "ratio": on / off}


def part_redis(model: str) -> dict[str, Any]:
    import httpx

    sys.path.insert(0, str(ROOT))
    from tests.tier_testutil import free_port, redis_server

    prompt = list(range(40, 240)) * 8  # 1,600 tokens
    with tempfile.TemporaryDirectory() as d, redis_server(Path(d)) as redis:
        procs, urls = [], []
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        try:
            for name in ("a", "b"):
                port = free_port()
                cmd = [sys.executable, "-m", "prefixcache", "serve", "--model", model, "--port", str(port)]
                cmd += ["--shared-cache", redis.url, "--max-cached-tokens", "8192"]
                log = open(Path(d) / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
                procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log))
                urls.append(f"http://127.0.0.1:{port}")
            deadline = time.monotonic() + 300
            for url in urls:
                while True:
                    try:
                        if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    if time.monotonic() > deadline:
                        raise RuntimeError("serve did not come up")
                    time.sleep(0.2)
            body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0}

            def call(url: str) -> tuple[float, dict]:
                t = time.perf_counter()
                r = httpx.post(f"{url}/v1/completions", json=body, timeout=300).json()
                return time.perf_counter() - t, r

            cold_s, first = call(urls[0])
            time.sleep(2.0)  # a's writer thread puts the blocks on the server
            shared_s, second = call(urls[1])
        finally:
            for p, log in procs:
                p.kill()
                p.wait()
                log.close()
    return {
        "prompt_tokens": len(prompt),
        "a_cold_s": cold_s,
        "b_from_redis_s": shared_s,
        "b_cached_tokens": second["usage"]["prompt_tokens_details"]["cached_tokens"],
        "outputs_equal": first["choices"][0]["text"] == second["choices"][0]["text"],
        "ratio": shared_s / cold_s,
    }


PARTS = {"replay": part_replay, "restart": part_restart, "fits": part_fits, "redis": part_redis}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "tier.json")
    args = ap.parse_args()
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        ap.error(f"--parts: unknown {unknown}; known: {', '.join(PARTS)}")
    meta = _meta.begin(peers=("lmdb", "redis"), redis_server=redis_server_version())
    out: dict[str, Any] = {"model": args.model, "machine": platform.processor() or platform.machine()}
    out["load_before"] = os.getloadavg()
    console = Console()
    for p in parts:
        console.print(f"[bold]{p}[/bold] ...")
        t = time.perf_counter()
        out[p] = PARTS[p](args.model)
        out[p]["part_wall_s"] = time.perf_counter() - t
    out["load_after"] = os.getloadavg()
    table = Table(title=f"bench_tier: {args.model}")
    for col in ("target", "measured", "goal"):
        table.add_column(col)
    if "replay" in out:
        r = out["replay"]
        table.add_row("replay TTFT p50, tier / no tier", f"{r['ttft_p50_ratio']:.3f}x", "<= 0.3x")
        table.add_row("  p50 no tier / tier (s)", f"{r['off']['ttft_p50_s']:.3f} / {r['on']['ttft_p50_s']:.3f}", "")
        table.add_row("  outputs equal the uncached baseline", str(r["on"]["outputs_match"]), "True")
        table.add_row(
            "  pool / tier hit tokens (no tier: pool)",
            f"{r['pool_hit_tokens']:,} / {r['tier_hit_tokens']:,} ({r['hit_tokens_without_tier']:,})",
            "",
        )
        table.add_row("  hits equal simulate's two-tier prediction", str(r["matches_simulate"]), "True")
        rate = r["tier_read_bytes_per_s"]
        table.add_row(
            "  prefill rate; tier read rate (plan's inputs)",
            f"{r['prefill_tokens_per_s']:,.0f} tok/s; {rate / 1e9 if rate else 0:.2f} GB/s",
            "",
        )
    if "restart" in out:
        r = out["restart"]
        table.add_row("restart: repeated / cold TTFT", f"{r['repeat_over_cold']:.3f}x", "<= 0.3x")
        table.add_row(
            "  index ready (blocks, s)", f"{r['restart']['restored_blocks']} in {r['restart']['restore_s']:.3f}", ""
        )
    if "fits" in out:
        table.add_row("fits the pool: TTFT p50 tier on / off", f"{out['fits']['ratio']:.3f}x", "<= 1.03x")
    if "redis" in out:
        r = out["redis"]
        table.add_row(
            "redis: b served from a's blocks (cached tokens)",
            f"{r['b_cached_tokens']:,} / {r['prompt_tokens']:,}",
            "> 0",
        )
        table.add_row("  b / a request time; outputs equal", f"{r['ratio']:.3f}x; {r['outputs_equal']}", "")
    console.print(table)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"meta": _meta.end(meta), **out}, indent=1))
    console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
