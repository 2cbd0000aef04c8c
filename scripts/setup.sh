#!/usr/bin/env bash
# Idempotent set-up on a fresh machine (Python 3.11): torch first, then megapack with its test
# tools (megatron-core, numpy, pytest, hypothesis, ruff, mypy).
#
# torch comes from your pip configuration's index unless MEGAPACK_TORCH_INDEX_URL names another
# one. On plain PyPI, torch==2.13.0 for Linux x86_64 is the CUDA build: it pulls several GB of
# nvidia-* wheels. For the CPU-only build use PyTorch's CPU index:
#   MEGAPACK_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu bash scripts/setup.sh
# An already installed torch is kept as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_ROOT_USER_ACTION=ignore
if ! "$PY" -c 'import torch' 2>/dev/null; then
  index=()
  if [ -n "${MEGAPACK_TORCH_INDEX_URL:-}" ]; then
    index=(--index-url "$MEGAPACK_TORCH_INDEX_URL")
    echo "setup: torch==2.13.0 from $MEGAPACK_TORCH_INDEX_URL" >&2
  fi
  "$PY" -m pip install -q --disable-pip-version-check "${index[@]}" "torch==2.13.0"
fi
"$PY" -m pip install -q --disable-pip-version-check -e ".[test]"
