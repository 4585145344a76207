#!/usr/bin/env bash
# The demo's learning check on several seeds: per seed the warm start, then pipeline.yaml under
# `rollstream run` until held-out val/acc >= TARGET (default 0.95) or LIMIT_S (default 180 s); prints a table
# of seconds and samples to the target (the clock starts at `rollstream run`; the ~4 s warm start is not in it).
#
#   scripts/demo_seeds.sh [seed ...] [key=value ...]     (default seeds 0 1 2)
#   TARGET=0.95 LIMIT_S=180 OUT_DIR=runs/demo-seeds scripts/demo_seeds.sh 0 1 2 3 4
set -euo pipefail
cd "$(dirname "$0")/.."
SEEDS=()
OVERRIDES=()
for a in "$@"; do
  if [[ "$a" == *=* ]]; then OVERRIDES+=("$a"); else SEEDS+=("$a"); fi
done
[ ${#SEEDS[@]} -eq 0 ] && SEEDS=(0 1 2)
exec .venv/bin/rollstream bench learn pipeline.yaml "${OVERRIDES[@]}" --modes async --seeds "${SEEDS[@]}" \
  --target "${TARGET:-0.95}" --limit-s "${LIMIT_S:-180}" --out-dir "${OUT_DIR:-runs/demo-seeds}"
