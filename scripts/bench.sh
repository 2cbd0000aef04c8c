#!/usr/bin/env bash
# Set up, then run the main job on the embedded default: `megapack bench` on CPU (gloo), throughput
# on tp=2 x pp=2, transfer on tp=2 and 4, packing on the bundled OpenChat lengths.
# Writes bench-out/bench.json and bench-out/plots/*.png; about 4 minutes on 2 cores.
# Extra arguments go to `megapack bench`, e.g. `bash scripts/bench.sh --quick` (under a minute),
# which writes bench-out/quick/ instead, so a full run's results are never overwritten.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/setup.sh
out=bench-out
for arg in "$@"; do
  if [ "$arg" = "--quick" ]; then out=bench-out/quick; fi  # never overwrite a full run's results
done
exec "$PY" -m megapack.cli bench --json "$out/bench.json" --plots "$out/plots" "$@"
