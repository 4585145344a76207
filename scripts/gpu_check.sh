#!/usr/bin/env bash
# CUDA check: a tiny random HF model runs 3 global steps through producers and trainer on the GPU
# (`rollstream run`, supervisord, embedded Redis) and prints tokens/s and samples/s; the log is audited.
#   bash scripts/gpu_check.sh [--steps N] [--allow-cpu] [key=value ...]    (details: scripts/gpu_check.py)
# Needs a Python with a CUDA torch and rollstream's dependencies: PYTHON=... (default .venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" scripts/gpu_check.py "$@"
