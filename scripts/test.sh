#!/usr/bin/env bash
# Set up, then lint, type-check and run the whole test suite (under 10 minutes on 2 cores).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k grid -x`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/setup.sh
# one command a line: under `set -e` a failure inside an `a && b` list does not stop the script
echo "== ruff"
"$PY" -m ruff check megapack tests examples setup.py
"$PY" -m ruff format --check megapack tests examples setup.py
echo "== mypy"
"$PY" -m mypy
echo "== pytest"
"$PY" -m pytest "$@"
