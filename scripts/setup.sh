#!/usr/bin/env bash
# Idempotent set-up on a fresh machine (Python 3.11, CPU only): torch's CPU wheel first, because a
# bare torch requirement with no torch installed pulls the multi-GB CUDA build; then megapack with
# its test tools (megatron-core, numpy, pytest, hypothesis, ruff, mypy).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_ROOT_USER_ACTION=ignore
if ! "$PY" -c 'import torch' 2>/dev/null; then
  "$PY" -m pip install -q --disable-pip-version-check "torch==2.13.0"
fi
"$PY" -m pip install -q --disable-pip-version-check -e ".[test]"
