#!/usr/bin/env bash
# Set up, then run the main job on the embedded default: `megapack bench` on CPU (gloo), throughput
# on tp=2 x pp=2, transfer on tp=2 and 4, packing on the bundled OpenChat lengths.
# Writes bench-out/bench.json and bench-out/plots/*.png; about 1.5 minutes on 2 cores.
# Extra arguments go to `megapack bench`, e.g. `bash scripts/bench.sh --quick`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/setup.sh
exec "$PY" -m megapack.cli bench --json bench-out/bench.json --plots bench-out/plots "$@"
