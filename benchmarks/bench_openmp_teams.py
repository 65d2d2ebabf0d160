"""What a second OpenMP team and libgomp's spin count do to the engine's forward on this machine.

    python benchmarks/bench_openmp_teams.py [--model small] [--tokens 12] [--forwards 30] [--compete] [--json F]

Each case runs in a fresh process: forwards of ``--tokens`` tokens on a thread that is not the first one, either
with the first thread's team alive (it ran a forward first: two teams, so libgomp throttles every worker's spin,
as the server was before ``engine/threads.py``) or without it (one team), at libgomp's default spin and at the
``GOMP_SPINCOUNT`` values given. ``--compete`` keeps one core busy with another process meanwhile (a machine
shared with other work). Printed per case: ms per forward, the process's cores busy, voluntary context switches per
forward (workers going to sleep between parallel regions).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _switches() -> int:
    total = 0
    for task in glob.glob(f"/proc/{os.getpid()}/task/*/status"):
        with open(task) as f:
            total += sum(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))
    return total


def child(model_name: str, teams: int, tokens: int, forwards: int) -> None:
    """One case, in this process: print its figures as JSON."""
    sys.path.insert(0, str(ROOT))
    import torch

    from engine.models import build_preset

    model, _ = build_preset(model_name)
    model.eval()
    x = torch.randint(0, 256, (1, tokens))
    out: dict[str, float] = {}

    def run() -> None:
        with torch.inference_mode():
            for _ in range(3):
                model(x)
            v0, t0, c0 = _switches(), time.perf_counter(), time.process_time()
            for _ in range(forwards):
                model(x)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        out.update(ms_per_forward=1000 * wall / forwards, cores_busy=cpu / wall)
        out["voluntary_switches_per_forward"] = (_switches() - v0) / forwards

    if teams == 2:
        with torch.inference_mode():
            model(x)  # the first thread's own team
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small")
    ap.add_argument("--tokens", type=int, default=12)
    ap.add_argument("--forwards", type=int, default=30)
    ap.add_argument("--spins", default="3000,10000", help="GOMP_SPINCOUNT values to try with one team")
    ap.add_argument("--compete", action="store_true", help="keep one core busy with another process meanwhile")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--child", nargs=2, metavar=("TEAMS", "SPIN"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.model, int(args.child[0]), args.tokens, args.forwards)
        return
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import _meta

    meta = _meta.begin(peers=("torch",))
    cases = [(2, None), (1, None)] + [(1, int(s)) for s in args.spins.split(",") if s]
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.compete else None
    rows = []
    try:
        for teams, spin in cases:
            env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
            if spin is not None:
                env["GOMP_SPINCOUNT"] = str(spin)
            cmd = [sys.executable, __file__, "--model", args.model, "--tokens", str(args.tokens)]
            cmd += ["--forwards", str(args.forwards), "--child", str(teams), str(spin)]
            res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            row = {"teams": teams, "gomp_spincount": spin, **json.loads(res.stdout.strip().splitlines()[-1])}
            rows.append(row)
            print(
                f"{teams} team(s), GOMP_SPINCOUNT {spin or 'default'}: {row['ms_per_forward']:.1f} ms/forward, "
                f"{row['cores_busy']:.2f} cores busy, {row['voluntary_switches_per_forward']:.0f} voluntary "
                "switches/forward",
                flush=True,
            )
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    if args.json:
        payload = {"meta": _meta.end(meta), "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}
        args.json.write_text(json.dumps(payload, indent=1) + "\n")


if __name__ == "__main__":
    main()
