#!/usr/bin/env bash
# The test command: install if needed, then lint (ruff), type-check (mypy) and run pytest against real Redis.
# The guard rails live in pyproject.toml: ruff with lines up to 110 (E501) and a complexity limit of 13 (C901),
# mypy strict on schemas/ and rollstream/bus/, pytest turning every warning into an error (named exceptions).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/mypy
# Three pytest workers (pytest-xdist) on two cores: the end-to-end tests spend most of their time waiting on
# worker start-up and Redis, so a third worker fills the gaps (every test has its own namespace, run folder and
# free ports). ROLLSTREAM_TEST_WORKERS=0 runs the tests in one process.
.venv/bin/python -m pytest -q -n "${ROLLSTREAM_TEST_WORKERS:-3}" "$@"
