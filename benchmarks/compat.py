"""Which model families are cached exactly on which transformers release: a family probe, family by version.

    python benchmarks/compat.py                                  # the installed transformers
    python benchmarks/compat.py --python VENV/bin/python ...     # also each of these interpreters (other venvs)

Each family (the hybrid and MLA families of tests/hybrid_testutil.py, four attention families beside them) is
built from its config class with seeded random weights (4 layers at most, vocab 300), wrapped with
``PrefixCachedModel``, and sent two prompts sharing an 80-token prefix (the second twice), on the contiguous
``generate`` and on ``generate_batch`` (the paged engine). Against the bare model: greedy tokens equal and
first-step logits within 1e-4 (relative). A family is then

* ``exact``: both paths within tolerance and the repeated prompts served from cache;
* ``uncached``: the check at load (or the engine's probe) turned a path off, with an ``UncachedCallWarning``, and its
  outputs equal the bare model's (the reason is kept);
* ``exact on generate``: the contiguous ``generate`` is exact with hits; the paged engine refuses the model (the
  reason is kept) and ``generate_batch`` falls back to ``generate``, equal to the bare model;
* ``refused``: the constructor refuses the model (``UnsupportedModelError``), with its reason;
* ``WRONG``: a cached output differs from the bare model's. This must never appear.

Results merge into ``benchmarks/results/compat.json`` by transformers version (a run replaces its version's row);
``docs/compatibility.md`` renders the table from it (``render_docs.py``).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from packaging.version import Version

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _meta

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "compat.json"
TOL = 1e-4
SHARED = 80
NEW = 4


def _prompts() -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(11)
    shared = torch.randint(3, 300, (SHARED,), generator=g).tolist()
    return [shared + torch.randint(3, 300, (n,), generator=g).tolist() for n in (7, 12)]


def _first_step(fn: Any, ids: Any) -> Any:
    import torch

    return fn(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=NEW,
        do_sample=False,
        pad_token_id=0,
        suppress_tokens=[2],
        output_scores=True,
        return_dict_in_generate=True,
    )


def probe_family(family: str) -> dict[str, Any]:
    """One family on the installed transformers: its status, the worst logit difference, the cached tokens of the
    repeated prompts, and the reason when a path ran uncached or the model was refused."""
    import torch
    from hybrid_testutil import build

    from engine import PrefixCachedModel, UncachedCallWarning, UnsupportedModelError

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build(family)
    row: dict[str, Any] = {"family": family, "model": type(model).__name__}
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            pcm = PrefixCachedModel(model, max_cached_tokens=4096, block_size=16)
        except UnsupportedModelError as exc:
            return {**row, "status": "refused", "reason": str(exc)}
        row["wrap_seconds"] = round(time.perf_counter() - t0, 3)
        worst, wrong, cached = 0.0, [], 0
        prompts = [torch.tensor([p]) for p in _prompts()]
        for ids in [*prompts, *prompts]:
            out = _first_step(pcm.generate, ids)
            ref = _first_step(model.generate, ids)
            cached += pcm.last_request_stats[0].cached_tokens if pcm.last_request_stats else 0
            a, b = out.scores[0].float(), ref.scores[0].float()
            finite = torch.isfinite(b)
            diff = float((a[finite] - b[finite]).abs().max() / b[finite].abs().max())
            worst = max(worst, diff)
            if not torch.equal(out.sequences, ref.sequences) or diff > TOL:
                wrong.append("generate")
        batch = pcm.generate_batch(_prompts() * 2, max_new_tokens=NEW, do_sample=False)
        for p, got in zip(_prompts() * 2, batch.values()):
            ids = torch.tensor([p])
            bare = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)
            ref = bare[0, len(p) :].tolist()
            if got.error is not None or got.generated_tokens != ref[: len(got.generated_tokens)]:
                wrong.append("generate_batch")
    reasons = sorted(
        {str(w.message) for w in caught if issubclass(w.category, UncachedCallWarning) or "fallback" in str(w.message)}
    )
    row.update(
        max_logit_difference=worst,
        cached_tokens=cached,
        engine=pcm.runtime.engine_unsupported_reason is None and pcm.runtime.pool is not None,
        load_check_seconds=round(pcm.runtime.load_check_seconds, 3),
    )
    if wrong:
        return {**row, "status": "WRONG", "reason": f"differs from the bare model on {sorted(set(wrong))}"}
    if pcm.runtime.load_check_reason is not None or pcm.runtime.unsupported_reason is not None:
        return {**row, "status": "uncached", "reason": pcm.runtime.unsupported_reason}
    if not row["engine"]:
        return {
            **row,
            "status": "exact on generate",
            "reason": f"paged engine: {pcm.runtime.engine_unsupported_reason}",
        }
    if cached == 0:
        return {**row, "status": "WRONG", "reason": "cached but never served a hit", "warnings": reasons}
    return {**row, "status": "exact", "reason": None}


def run_here() -> dict[str, Any]:
    """Every family on this interpreter's transformers."""
    sys.path.insert(0, str(ROOT / "tests"))
    from hybrid_testutil import ATTENTION, FAMILIES

    from engine.versions import installed

    rows = []
    for family in [*FAMILIES, *ATTENTION]:
        t0 = time.perf_counter()
        try:
            row = probe_family(family)
        except Exception as exc:  # a family the installed transformers cannot even build or run bare
            row = {"family": family, "status": "error", "reason": f"{type(exc).__name__}: {exc}"[:300]}
        row["seconds"] = round(time.perf_counter() - t0, 2)
        print(f"  {family:18s} {row['status']:9s} {row.get('reason') or ''}"[:160], file=sys.stderr, flush=True)
        rows.append(row)
    return {"versions": installed(), "families": rows}


def table_md(runs: list[dict[str, Any]]) -> str:
    """The family x version table (markdown) of ``runs``."""
    versions = [r["versions"]["transformers"] for r in runs]
    families = list(dict.fromkeys(f["family"] for r in runs for f in r["families"]))
    lines = ["| family | " + " | ".join(f"transformers {v}" for v in versions) + " |"]
    lines.append("| --- |" + " --- |" * len(versions))
    for fam in families:
        cells = []
        for r in runs:
            row = next((f for f in r["families"] if f["family"] == fam), None)
            if row is None:
                cells.append("not run")
            elif row["status"] == "exact":
                cells.append(
                    f"exact, {row['cached_tokens']} tokens from cache, max diff {row['max_logit_difference']:.0e}"
                )
            else:
                why = re.sub(r" ?\(transformers [^)]*\)?|; transformers [^)]*", "", row.get("reason") or "")
                cells.append(f"**{row['status']}**: {why.replace('|', '/')[:150]}")
        lines.append(f"| {fam} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--python", action="append", default=[], help="also run under this interpreter (a venv's)")
    ap.add_argument("--out", default=str(OUT), help="the JSON to merge into")
    ap.add_argument("--here-json", default=None, help=argparse.SUPPRESS)  # the child's output
    args = ap.parse_args()
    if args.here_json:
        Path(args.here_json).write_text(json.dumps(run_here()))
        return
    out = Path(args.out)
    old = json.loads(out.read_text()) if out.exists() else {"runs": []}
    runs = {r["versions"]["transformers"]: r for r in old.get("runs", [])}
    meta = _meta.begin()
    print(f"compat on {sys.executable}", file=sys.stderr)
    here = run_here()
    runs[here["versions"]["transformers"]] = here
    for py in args.python:
        print(f"compat on {py}", file=sys.stderr)
        tmp = out.with_suffix(".part.json")
        subprocess.run([py, __file__, "--here-json", str(tmp)], check=True, cwd=ROOT)
        r = json.loads(tmp.read_text())
        tmp.unlink()
        runs[r["versions"]["transformers"]] = r
    ordered = sorted(runs.values(), key=lambda r: Version(r["versions"]["transformers"]))
    wrong = [
        (r["versions"]["transformers"], f["family"]) for r in ordered for f in r["families"] if f["status"] == "WRONG"
    ]
    result = {"meta": _meta.end(meta), "runs": ordered, "wrong": wrong, "table_md": table_md(ordered), "tolerance": TOL}
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(result["table_md"])
    print(f"wrong outputs: {len(wrong)} {wrong}")


if __name__ == "__main__":
    main()
