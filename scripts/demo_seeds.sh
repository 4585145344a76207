#!/usr/bin/env bash
# The learning demo: for each seed, a supervised warm start (< 10% exact match) then `rollstream run`
# of pipeline.yaml (2 producers + trainer + aggregator) until held-out greedy val/acc >= 0.9 (plus HOLD_S
# more seconds) or LIMIT_S seconds; prints per seed: start val/acc, seconds to 90%, final val/acc, samples/s.
#
#   scripts/demo_seeds.sh [seed ...]            (default seeds 0 1 2; extra overrides via DEMO_OVERRIDES)
#   LIMIT_S=600 HOLD_S=30 RUN_DIR=/tmp/rollstream-demo scripts/demo_seeds.sh 0
#
# The clock starts before the warm start, so "s to 90%" includes it (its own time is printed too).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
RS=.venv/bin/rollstream
RUN_DIR=${RUN_DIR:-/tmp/rollstream-demo}
LIMIT_S=${LIMIT_S:-600}
HOLD_S=${HOLD_S:-30}
TARGET=${TARGET:-0.9}
SEEDS=("$@")
[ ${#SEEDS[@]} -eq 0 ] && SEEDS=(0 1 2)
read -r -a EXTRA <<< "${DEMO_OVERRIDES:-}"
mkdir -p "$RUN_DIR"
echo "load before: $(uptime)"
SUMMARY=()
for seed in "${SEEDS[@]}"; do
  name="demo-s$seed"
  common=(run.name="$name" run.dir="$RUN_DIR" run.seed="$seed" "${EXTRA[@]}")
  if [ -e "$RUN_DIR/$name" ]; then rm -rf "${RUN_DIR:?}/$name"; fi
  t0=$(date +%s.%N)
  warm="$RUN_DIR/warm-s$seed.safetensors"
  $PY scripts/warm_start.py pipeline.yaml "${common[@]}" --out "$warm"
  $RS run pipeline.yaml "${common[@]}" model.init_from="$warm" >/dev/null
  records="$RUN_DIR/$name/records.jsonl"
  reached=""
  while :; do
    sleep 2
    now=$(date +%s.%N)
    el=$($PY -c "print(f'{$now - $t0:.0f}')")
    if [ -z "$reached" ] && [ -f "$records" ] && \
       $PY -c "import json,sys; sys.exit(0 if any(json.loads(l).get('val/acc', -1) >= $TARGET for l in open('$records')) else 1)"; then
      reached=$el
      echo "seed $seed: val/acc >= $TARGET after ${reached}s"
    fi
    if [ -n "$reached" ] && [ "$el" -ge $((reached + HOLD_S)) ]; then break; fi
    if [ "$el" -ge "$LIMIT_S" ]; then break; fi
  done
  $RS stop pipeline.yaml "${common[@]}" >/dev/null || echo "seed $seed: a worker exited non-zero on stop"
  line=$($PY - "$records" "$t0" "${reached:-none}" "$seed" <<'PYEOF'
import json, sys
path, t0, reached, seed = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4]
rows = [json.loads(line) for line in open(path)]
vals = [(r["training/global_step"], r["val/acc"]) for r in rows if "val/acc" in r]
steps = max(r.get("training/global_step", 0) for r in rows)
trained = sum(r.get("fully_async/count/trained_samples", 0) for r in rows)
busy = sum(r.get("timing_s/step", 0) for r in rows)
when = f"after {reached}s" if reached != "none" else "not reached"
print(f"seed {seed}: val/acc start {vals[0][1]:.3f}, 90% {when}, final {vals[-1][1]:.3f} "
      f"(best {max(v for _, v in vals):.3f}) at step {steps}, {trained:.0f} samples trained, "
      f"{trained / max(busy, 1e-9):.1f} samples/s of trainer step time")
PYEOF
)
  echo "$line"
  SUMMARY+=("$line")
done
echo "load after: $(uptime)"
printf '%s\n' "${SUMMARY[@]}"
