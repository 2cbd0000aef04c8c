#!/usr/bin/env bash
# Set up, then lint, type-check and run the whole test suite (under 10 minutes on 2 cores).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k grid -x`.
# PYTHON and MEGAPACK_VENV choose the environment as in scripts/setup.sh: by default python3
# (Python 3.11: megatron-core 0.16.1); CI's second run is
#   PYTHON=python3.12 MEGAPACK_VENV=.venv312 bash scripts/test.sh   (megatron-core 0.19.2)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/setup.sh
if [ -n "${MEGAPACK_VENV:-}" ]; then
  PY="$MEGAPACK_VENV/bin/python"  # made by scripts/setup.sh
fi
"$PY" - <<'PYEOF'
import sys
from importlib.metadata import version
print(f"== Python {sys.version.split()[0]}, torch {version('torch')}, "
      f"megatron-core {version('megatron-core')}")
PYEOF
# one command a line: under `set -e` a failure inside an `a && b` list does not stop the script
echo "== ruff"
"$PY" -m ruff check megapack tests examples setup.py
"$PY" -m ruff format --check megapack tests examples setup.py
echo "== mypy"
# against the interpreter's own Python (pyproject.toml's 3.11 on the first line): the numpy a
# Python 3.12 environment gets (2.5) types its methods for Python >= 3.12 only
"$PY" -m mypy --python-version "$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
echo "== pytest"
"$PY" -m pytest "$@"
