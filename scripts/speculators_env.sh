#!/usr/bin/env bash
# The environment speculators itself runs in, for tests/test_export.py's load-and-compare check.
# speculators pins torch / transformers differently from specbook, so it never enters .venv: it gets its own
# venv under ${SPECBOOK_CACHE:-~/.cache/specbook}/envs/, built once (about 2-3 minutes, ~1.5 GB) and reused.
# speculators is installed --no-deps with the packages its import needs, pinned here: its torchvision /
# torchaudio requirements are left out (unused by the model classes; PyPI's torchvision does not import next
# to the CPU torch wheel). Prints the env's python on its last line.
set -euo pipefail
VERSION=0.9.0
ENV="${SPECBOOK_CACHE:-$HOME/.cache/specbook}/envs/speculators-$VERSION"
PY=${PYTHON:-python3}
if [ ! -f "$ENV/.ready" ]; then
  rm -rf "$ENV"
  "$PY" -m venv "$ENV"
  export PIP_DISABLE_PIP_VERSION_CHECK=1
  "$ENV/bin/pip" install -q "torch==2.13.0" >&2
  "$ENV/bin/pip" install -q --no-deps "speculators==$VERSION" >&2
  "$ENV/bin/pip" install -q "transformers==5.19.0" "hs-connectors==$VERSION" "datasets>=4,<=5.1.0" "openai>=2" \
    "pydantic>=2" "pydantic-settings>=2" "loguru>=0.7.2,<=0.7.3" "numpy>=2,<=2.5.4" "tqdm>=4.66.3,<=4.70.1" \
    safetensors typer rich psutil protobuf aiohttp httpx click huggingface-hub pyyaml >&2
  "$ENV/bin/python" -c "import speculators" >&2
  touch "$ENV/.ready"
fi
echo "$ENV/bin/python"
