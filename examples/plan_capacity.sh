#!/usr/bin/env bash
# Plan capacity for a trace: the hit rate at every cache size, the optimal bound, and how many GB of KV it takes
# to reach 50/70/90% of the achievable hit rate, for a given model and KV dtype. Model-free: seconds.
#
#   bash examples/plan_capacity.sh                 # sized for the built-in `small` preset's KV in bf16
#   bash examples/plan_capacity.sh --model tiny
#   OUT=reports bash examples/plan_capacity.sh     # where the reports go (default: a new temporary folder)
set -euo pipefail
MODEL=small
if [[ "${1:-}" == "--model" ]]; then MODEL="$2"; fi
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
PC=(python3 -m prefixcache)  # or just `prefixcache` once installed

# The Mooncake synthetic trace shipped in scenarios/traces (3,993 requests, 512-token blocks), LRU and FIFO
# side by side. --dtype says what one token of KV costs: bf16 is 2 bytes per element (the presets run in fp32).
"${PC[@]}" plan scenarios/mooncake_synthetic.yaml --model "$MODEL" --dtype bf16 -p lru -p fifo \
    --json "$OUT/plan.json" --html "$OUT/plan.html"

# Why the rest misses at one capacity (10,000 blocks of 512 tokens: 5.1M tokens): cold or evicted, and what to do.
"${PC[@]}" explain scenarios/mooncake_synthetic.yaml --capacity-blocks 10000 --top 3 --no-progress

echo "plan: $OUT/plan.html (open it in a browser), $OUT/plan.json"
