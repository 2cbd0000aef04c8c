#!/usr/bin/env bash
# Set up, then run the main job on the embedded default: CPU, gloo, tp=2 x pp=2 on 4 processes.
# Each rank prints its pipeline stage and the fields get_batch_on_this_tp_rank gave it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/setup.sh
exec "$PY" -m torch.distributed.run --nproc-per-node 4 examples/demo_tp_pp.py --tp 2 --pp 2 "$@"
