#!/usr/bin/env bash
# The prepared GPU check: on a machine with an NVIDIA GPU, in under 5 minutes (after any install):
#   1. the CUDA build of torch (installed from PyPI, whose Linux wheels are CUDA builds, when the torch found
#      cannot see the GPU; TORCH_INDEX_URL picks another index) and the project's dependencies if missing;
#   2. the engine's exactness tests on cuda: tests/test_engine_archs.py with PREFIXCACHE_TEST_DEVICE=cuda
#      (every architecture in fp32, logits within 1e-4, and in bf16, greedy tokens equal);
#   3. benchmarks/bench_ttft.py --device cuda in fp32 and in bf16 (3 runs each, spread across runs);
#   4. a short summary. Results land in OUT_DIR (default benchmarks/results/gpu): the JSON records and logs.
# Without an NVIDIA GPU it prints why and exits 0. Exit status: 0 when everything ran and passed, else 1.
#
#   benchmarks/gpu_check.sh [OUT_DIR]        env: PYTHON (default python3), TORCH_INDEX_URL, GPU_CHECK_RUNS (3)
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
PY="${PYTHON:-python3}"
OUT_DIR="${1:-$ROOT/benchmarks/results/gpu}"
RUNS="${GPU_CHECK_RUNS:-3}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

say() { printf '[gpu_check] %s\n' "$*"; }

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    say "no NVIDIA GPU found (nvidia-smi lists none): skipped"
    exit 0
fi
say "GPU: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -n 1)"
mkdir -p "$OUT_DIR" || exit 1
start=$SECONDS

# ---- 1. dependencies and a torch that sees the GPU ------------------------------------------------------
if ! "$PY" -c "import torch, transformers, tokenizers, xxhash, sortedcontainers, typer, rich, yaml, pytest, hypothesis" \
    2>/dev/null; then
    say "installing the project's dependencies (pip install -e '.[dev]')"
    "$PY" -m pip install -q -e ".[dev]" || { say "FAILED: pip install -e '.[dev]'"; exit 1; }
fi
cuda_ok() { "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; }
if ! cuda_ok; then
    have="$("$PY" -c "import torch; print(torch.__version__, torch.version.cuda)")"
    say "torch $have cannot see the GPU: installing a CUDA build"
    version="$("$PY" -c "import torch; print(torch.__version__.split('+')[0])")"
    "$PY" -m pip uninstall -q -y torch
    "$PY" -m pip install -q ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==$version" \
        || "$PY" -m pip install -q ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} torch \
        || { say "FAILED: could not install a CUDA build of torch"; exit 1; }
    if ! cuda_ok; then
        "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
        say "FAILED: torch still sees no CUDA device (driver too old for this build? see nvidia-smi)"
        exit 1
    fi
fi
"$PY" -c "import torch, transformers; print('[gpu_check] torch', torch.__version__, 'cuda', torch.version.cuda, \
'| transformers', transformers.__version__, '|', torch.cuda.get_device_name(0))"
say "setup took $((SECONDS - start)) s"

# ---- 2. exactness tests on cuda ------------------------------------------------------------------------
status=0
t=$SECONDS
PREFIXCACHE_TEST_DEVICE=cuda timeout 180 "$PY" -m pytest -q -p no:cacheprovider tests/test_engine_archs.py \
    2>&1 | tee "$OUT_DIR/tests_cuda.log"
tests_rc=${PIPESTATUS[0]}
tests_line="$(grep -E '(passed|failed|error)' "$OUT_DIR/tests_cuda.log" | tail -n 1)"
[ "$tests_rc" -eq 0 ] || status=1
say "exactness tests on cuda: exit $tests_rc, $((SECONDS - t)) s"

# ---- 3. TTFT benchmark on cuda, fp32 and bf16 -----------------------------------------------------------
for dtype in fp32 bf16; do
    t=$SECONDS
    timeout 120 "$PY" benchmarks/bench_ttft.py --device cuda --dtype "$dtype" --runs "$RUNS" \
        --json "$OUT_DIR/ttft_cuda_$dtype.json" 2>&1 | tee "$OUT_DIR/ttft_cuda_$dtype.log"
    rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || { status=1; rm -f "$OUT_DIR/ttft_cuda_$dtype.json"; }
    say "bench_ttft --device cuda --dtype $dtype: exit $rc, $((SECONDS - t)) s"
done

# ---- 4. summary -----------------------------------------------------------------------------------------
echo
say "SUMMARY ($((SECONDS - start)) s in all; GPU figures, medians of $RUNS runs [min-max])"
say "exactness tests (tests/test_engine_archs.py on cuda): ${tests_line:-no result} (exit $tests_rc)"
"$PY" - "$OUT_DIR" <<'EOF'
import json, sys
from pathlib import Path

rows = [
    ("TTFT uncached", "ttft_uncached_s", 1e3, "ms"),
    ("TTFT hit (2,048 cached)", "ttft_cached_s", 1e3, "ms"),
    ("TTFT ideal", "ttft_ideal_s", 1e3, "ms"),
    ("hit speedup", "speedup", 1, "x"),
    ("hit / ideal", "cached_over_ideal", 1, "x"),
    ("miss / uncached", "miss_overhead_ratio", 1, "x"),
    ("batch miss / raw", "batch_miss_over_raw", 1, "x"),
    ("batch cached / raw", "batch_hit_over_raw", 1, "x"),
    ("weights check", "weights_check_s", 1e3, "ms"),
]
for dtype in ("fp32", "bf16"):
    path = Path(sys.argv[1]) / f"ttft_cuda_{dtype}.json"
    if not path.exists():
        print(f"[gpu_check] bench_ttft {dtype}: no result")
        continue
    figures = json.loads(path.read_text())["figures"]
    parts = []
    for label, key, scale, unit in rows:
        if key in figures:
            f = figures[key]
            parts.append(f"{label} {f['median'] * scale:.3g}{unit} [{f['min'] * scale:.3g}-{f['max'] * scale:.3g}]")
    print(f"[gpu_check] bench_ttft {dtype} ({path}): " + "; ".join(parts))
EOF
say "$([ "$status" -eq 0 ] && echo PASSED || echo FAILED)"
exit "$status"
