#!/usr/bin/env bash
# The main job: set up, execute every notebook headless into build/ (executed .ipynb + HTML),
# print a results summary.   Usage: scripts/tour.sh [--quick]   (--quick = SPECBOOK_FAST=1 sizes)
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
bash scripts/setup.sh
. .venv/bin/activate
if [ "${1:-}" = "--quick" ]; then export SPECBOOK_FAST=1; fi
mkdir -p build/notebooks
for nb in notebooks/[0-9]*.ipynb; do
  name=$(basename "$nb" .ipynb)
  echo "[tour] running $name ${SPECBOOK_FAST:+(quick)}"
  # specbook.nbrun: nbconvert's execution, minus its wait forever for a reply lost after a widget cell
  python -m specbook.nbrun --out build/notebooks "$nb" 2>&1 | grep -v -E "WARNING|Kernel is running" || true
  [ -f "build/notebooks/$name.ipynb" ] || { echo "[tour] $name failed"; exit 1; }
  jupyter nbconvert --to html --output-dir build/notebooks "build/notebooks/$name.ipynb" >/dev/null 2>&1
done
python -m specbook.report build/notebooks
echo "[tour] done in $(( $(date +%s) - start ))s; open build/notebooks/*.html"
