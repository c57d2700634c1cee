#!/usr/bin/env bash
# Set up and run the whole test suite: the linter (ruff), then unit, property, statistical, real-model,
# notebooks (nbval, SPECBOOK_FAST=1) and the real-browser test (needs Debian's chromium).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check src tests
unset MPLBACKEND  # notebook kernels must keep their inline backend
# one worker per core, at most 4 (--dist loadfile keeps each notebook's cells, and each test file, on one worker);
# tests/conftest.py gives each worker and its notebook kernels its share of the threads
SPECBOOK_FAST=1 python -m pytest --nbval-lax -p no:cacheprovider -n auto --maxprocesses 4 --dist loadfile "$@" tests notebooks
