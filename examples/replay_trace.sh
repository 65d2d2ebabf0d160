#!/usr/bin/env bash
# Replay a workload and write its report: first a real trace without a model (seconds), then a chat scenario
# through a model, cached against uncached, with the outputs checked.
#
#   bash examples/replay_trace.sh                 # the built-in `small` preset (a few minutes on 2 CPU cores)
#   bash examples/replay_trace.sh --model tiny    # seconds
#   OUT=reports bash examples/replay_trace.sh     # where the reports go (default: a new temporary folder)
set -euo pipefail
MODEL=small
if [[ "${1:-}" == "--model" ]]; then MODEL="$2"; fi
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
PC=(python3 -m prefixcache)  # or just `prefixcache` once installed

# 1. A Mooncake hash-id trace (shipped in scenarios/traces), model-free, at three capacities of 512-token blocks.
"${PC[@]}" simulate scenarios/traces/mooncake_conversation_trace.jsonl.gz \
    --capacity-blocks 1000 --capacity-blocks 10000 --capacity unlimited \
    --no-progress --json "$OUT/trace.json" --html "$OUT/trace.html"

# 2. Five users' chats through a model: each request cached and uncached, time to first token, outputs compared
#    (--verify: a mismatch exits 1). The first 8 requests, one pool size, to keep it short.
"${PC[@]}" replay scenarios/chat.yaml --model "$MODEL" --capacity 2048 --max-requests 8 --verify \
    --no-progress --json "$OUT/chat.json"
"${PC[@]}" report "$OUT/chat.json" --html "$OUT/chat.html" --markdown "$OUT/chat.md"

echo "reports: $OUT/trace.html $OUT/chat.html $OUT/chat.md (open the HTML files in a browser)"
