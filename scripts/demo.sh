#!/usr/bin/env bash
# A tiny end-to-end run on CPU: start it, wait for a few records, show status and a sample, plot, stop.
# Usage: scripts/demo.sh [extra key=value overrides]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
RS=".venv/bin/rollstream"
ARGS=(pipeline.yaml run.name=demo run.dir=runs trainer.total_global_steps=40 "$@")
$RS run "${ARGS[@]}" --wait-records 10
$RS status "${ARGS[@]}"
$RS inspect rollouts -1 "${ARGS[@]}" | head -40
$RS plot "${ARGS[@]}" --out runs/demo/reward.png
$RS stop "${ARGS[@]}"
