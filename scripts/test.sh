#!/usr/bin/env bash
# Set up and run the whole test suite: the linter (ruff), then unit, property, statistical, real-model,
# notebooks (nbval, SPECBOOK_FAST=1) and the real-browser test (needs Debian's chromium).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check src tests
unset MPLBACKEND  # notebook kernels must keep their inline backend
SPECBOOK_FAST=1 python -m pytest --nbval-lax -p no:cacheprovider "$@" tests notebooks
