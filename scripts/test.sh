#!/usr/bin/env bash
# The test command: install if needed, then lint (ruff), type-check (mypy) and run pytest against real Redis.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/mypy
.venv/bin/python -m pytest -q "$@"
