#!/usr/bin/env bash
# The demo on CPU: install, a short supervised warm start of the tiny GPT (ends under 10% exact match; a
# config with a pretrained model skips it and builds the model once if missing; one with data.tool=calculator
# gets the tool warm start, scripts/tool_warm_start.py, read by the run's validation of version 0), then the whole
# pipeline (embedded Redis + 2 producers + trainer + aggregator under supervisord) until held-out greedy
# val/acc >= TARGET or LIMIT_S seconds (clock started before the warm start), with a live progress line;
# then a decoded sample, the plot, and a clean stop. Each call starts a fresh runs/<run.name>/.
#
#   scripts/demo.sh [key=value ...]            e.g. scripts/demo.sh run.seed=3
#   TARGET=0.95 LIMIT_S=1200 scripts/demo.sh    (defaults)
#   CONFIG=configs/reverse-variable.yaml TARGET=0.9 scripts/demo.sh run.seed=1   (another config; default pipeline.yaml)
#   CONFIG=configs/smollm2-basic-arithmetic.yaml TARGET=0.6 scripts/demo.sh run.seed=0   (SmolLM2-135M-Instruct)
#   CONFIG=configs/smollm2-calculator.yaml TARGET=0.9 LIMIT_S=1800 scripts/demo.sh run.seed=0   (with a calculator)
#
# Exit status: 0 target reached, 2 not reached in time, 1 a worker failed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=.venv/bin/python
RS=.venv/bin/rollstream
TARGET=${TARGET:-0.95}
LIMIT_S=${LIMIT_S:-1200}
CONFIG=${CONFIG:-pipeline.yaml}
ARGS=("$CONFIG" run.name=demo run.dir=runs "$@")
RUN_DIR=$($PY -c 'import sys; from rollstream.config import load_config; print(load_config(sys.argv[1], sys.argv[2:]).run_dir())' "${ARGS[@]}")
if [ -e "$RUN_DIR" ]; then
  echo "fresh demo: stopping and removing the previous $RUN_DIR"
  $RS stop "${ARGS[@]}" >/dev/null 2>&1 || true
  rm -rf "$RUN_DIR"
fi
mkdir -p -m 700 "$RUN_DIR"
T0=$($PY -c 'import time; print(time.time())')
BACKEND=$($PY -c 'import sys; from rollstream.config import load_config; c = load_config(sys.argv[1], sys.argv[2:]); print(c.model.backend, c.data.tool)' "${ARGS[@]}")
if [ "$BACKEND" = "tiny none" ]; then  # the random tiny GPT gets a warm start
  $PY scripts/warm_start.py "${ARGS[@]}" --out "$RUN_DIR/warm_start.safetensors" 2>/dev/null
  ARGS+=(model.init_from="$RUN_DIR/warm_start.safetensors")
elif [ "$BACKEND" = "hf calculator" ]; then  # a few supervised steps on tool-call traces
  $RS model build "$($PY -c 'import sys; from rollstream.config import load_config; print(load_config(sys.argv[1], sys.argv[2:]).model.pretrained or "")' "${ARGS[@]}")" >/dev/null 2>&1 || true
  # --no-eval: the run's validation of version 0 (the warm start) is its held-out report (records.jsonl step 0)
  $PY scripts/tool_warm_start.py "${ARGS[@]}" --out "$RUN_DIR/warm_start" --no-eval 2>/dev/null | tee "$RUN_DIR/warm_start.txt"
  ARGS+=(model.hf_path="$RUN_DIR/warm_start")
fi  # any other pretrained model starts as it is
$RS run "${ARGS[@]}"  # builds model.pretrained into its cache first when missing
trap '$RS stop "${ARGS[@]}" >/dev/null 2>&1 || true' INT TERM
rc=0
$RS watch "${ARGS[@]}" --until-val-acc "$TARGET" --limit-s "$LIMIT_S" --since "$T0" || rc=$?
$RS inspect rollouts:rollout_00 -1 "${ARGS[@]}" | head -30 || true
$RS plot "${ARGS[@]}" --out "$RUN_DIR/reward.png" || true
$RS stop "${ARGS[@]}"
exit $rc
