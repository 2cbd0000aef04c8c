#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: torch first, then megapack with its test tools
# (megatron-core, numpy, pytest, hypothesis, ruff, mypy). Python 3.11 gets megatron-core 0.16.1,
# Python 3.12 megatron-core 0.19.2 (setup.py's test extra: the two lines CI runs).
#
# PYTHON names the interpreter (default python3). MEGAPACK_VENV=DIR sets up a virtual environment
# in DIR instead (made with PYTHON on the first run; a directory inside the repository, ignored by
# git), which is how CI's second environment is made:
#   PYTHON=python3.12 MEGAPACK_VENV=.venv312 bash scripts/setup.sh
# Under pyenv, a PYTHON such as python3.12 that the current pyenv version lacks is looked up in
# the installed versions.
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
if [ -n "${MEGAPACK_VENV:-}" ]; then
  if [ ! -x "$MEGAPACK_VENV/bin/python" ]; then
    if ! "$PY" --version >/dev/null 2>&1 && command -v pyenv >/dev/null 2>&1; then
      for version in $(pyenv versions --bare | sort -rV); do  # the newest one that has it
        if found=$(PYENV_VERSION="$version" pyenv which "$PY" 2>/dev/null); then
          PY=$found
          break
        fi
      done
    fi
    echo "setup: creating $MEGAPACK_VENV with $("$PY" --version 2>&1)" >&2
    "$PY" -m venv "$MEGAPACK_VENV"
  fi
  PY="$MEGAPACK_VENV/bin/python"
fi
if ! "$PY" -c 'import torch' 2>/dev/null; then
  index=()
  if [ -n "${MEGAPACK_TORCH_INDEX_URL:-}" ]; then
    index=(--index-url "$MEGAPACK_TORCH_INDEX_URL")
    echo "setup: torch==2.13.0 from $MEGAPACK_TORCH_INDEX_URL" >&2
  fi
  "$PY" -m pip install -q --disable-pip-version-check "${index[@]}" "torch==2.13.0"
fi
"$PY" -m pip install -q --disable-pip-version-check -e ".[test]"
