#!/usr/bin/env bash
# The test command: install if needed, then lint (ruff), type-check (mypy) and run pytest against real Redis.
# The guard rails live in pyproject.toml: ruff with lines up to 110 (E501) and a complexity limit of 13 (C901),
# mypy strict on schemas/ and rollstream/bus/, pytest turning every warning into an error (named exceptions).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/mypy
.venv/bin/python -m pytest -q "$@"
