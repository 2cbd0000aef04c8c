#!/usr/bin/env bash
# Mutation testing (mutmut 3) of the named modules with only their own tests; not run in CI.
#   bash scripts/mutation.sh megapack/packing/bfd.py [MODULE...] [--min-score 95] [--workers 1]
# Works in a copy (.mutation/run/), never in the source tree; prints each module's score and every
# surviving mutant's diff. See CONTRIBUTING.md, "Mutation testing", and scripts/mutation.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! command -v mutmut >/dev/null; then
  echo "mutation: mutmut is not installed: pip install 'mutmut>=3.8,<4'" >&2
  exit 2
fi
exec "$PY" scripts/mutation.py "$@"
