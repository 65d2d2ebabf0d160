#!/usr/bin/env bash
# Run every example on the `tiny` preset, each under a time limit, so they never rot (.ci/run calls this).
#   bash examples/run_all.sh            # tiny (CI)
#   MODEL=small bash examples/run_all.sh
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL="${MODEL:-tiny}"
LIMIT="${EXAMPLE_TIMEOUT:-300}"  # seconds per example; each takes well under a minute on tiny on a quiet machine
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
export OUT
run() {
    echo "== $*"
    local start=$SECONDS
    timeout --kill-after=10 "$LIMIT" "$@"
    echo "== ok in $((SECONDS - start)) s: $*"
}
run python3 examples/wrap_hf_model.py --model "$MODEL"
run bash examples/replay_trace.sh --model "$MODEL"
run bash examples/plan_capacity.sh --model "$MODEL"
run python3 examples/serve_openai_client.py --model "$MODEL"
run python3 examples/multi_tenant_chat.py --model "$MODEL"
echo "all examples ran"
