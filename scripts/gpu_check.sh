#!/usr/bin/env bash
# The GPU kit: attention backends vs a float64 reference, packed == padded losses (fp32 and bf16),
# zero host syncs in delivery + prefetch + a packed fwd+bwd, and the real-size throughput table
# (0.84B GPT, seq 4096 and 8192, packed vs padded) with its targets. About 3-5 minutes on one GPU.
#
#   bash scripts/gpu_check.sh [--out DIR] [--dry-run]
#
# Writes DIR/gpu-report.json, DIR/gpu-report.md and DIR/gpu-kit.log (DIR defaults to gpu-out).
# --dry-run: the same steps on CPU at toy sizes (fp32, gloo), CUDA-only checks skipped; < 1 minute.
# Wheels in .whl/ (bash scripts/gpu_wheels.sh) are installed into /tmp/site first when
# megatron-core is not importable here (the GPU machine has none; carry .whl with the call).
# Exit status: 0 when no check failed, 1 when one did (or the kit's process died: the report then
# ends with a failed "kit process" check), 2 on a usage error.
set -uo pipefail
caller=$PWD
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
out=gpu-out  # in the repository; an --out given is taken from where the script was called
dry=()
while [ $# -gt 0 ]; do
  case "$1" in
    --out) [ $# -ge 2 ] || { echo "gpu_check: --out needs a folder" >&2; exit 2; }
      case "$2" in /*) out=$2 ;; *) out="$caller/$2" ;; esac; shift 2 ;;
    --dry-run) dry=(--dry-run); shift ;;
    *) echo "usage: bash scripts/gpu_check.sh [--out DIR] [--dry-run]  (unknown argument: $1)" >&2; exit 2 ;;
  esac
done

if compgen -G ".whl/*.whl" >/dev/null && ! "$PY" -c 'import megatron.core' 2>/dev/null; then
  echo "gpu_check: installing the carried wheels into /tmp/site: $(cd .whl && echo *.whl)" >&2
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || { echo "gpu_check: installing .whl/*.whl failed" >&2; exit 1; }
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

mkdir -p "$out"
"$PY" -m megapack.bench.gpu.kit --out "$out" "${dry[@]}" 2>&1 | tee "$out/gpu-kit.log"
rc=${PIPESTATUS[0]}
case "$rc" in
  0) exit 0 ;;
  3) exit 1 ;;  # a check failed; the report is complete
  *)
    echo "gpu_check: the kit's process exited $rc; recording it in $out/gpu-report.json" >&2
    "$PY" -m megapack.bench.gpu.report --record-crash "$rc" --out "$out" --log "$out/gpu-kit.log"
    exit 1 ;;
esac
