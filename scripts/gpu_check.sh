#!/usr/bin/env bash
# The GPU kit: attention backends vs a float64 reference, packed == padded losses (fp32 and bf16),
# zero host syncs in delivery + prefetch + a packed fwd+bwd, and the real-size throughput table
# (0.84B GPT, seq 4096 and 8192, packed vs every baseline, interleaved) with its targets.
# By section: one run of <= 6 minutes measures what a change touched; the whole kit is two runs
# (`--list` prints the sections, their estimated time and the split).
#
#   bash scripts/gpu_check.sh [--out DIR] [--dry-run] [--only SECTIONS] [--list] [--backend NAME]
#
# Writes DIR/gpu-report.json, DIR/gpu-report.md and DIR/gpu-kit.log (DIR defaults to gpu-out).
# --dry-run: the same steps on CPU at toy sizes (fp32, gloo), CUDA-only checks skipped; < 1 minute.
# --only attention,throughput,...: run those sections; --backend: the model's THD attention
# (default auto); both go to `python -m megapack.bench.gpu.kit`, which checks them.
# Wheels in .whl/ (bash scripts/gpu_wheels.sh) are installed into /tmp/site first when
# megatron-core is not importable here (the GPU machine has none; carry .whl with the call).
# Exit status: 0 when no check failed, 1 when one did (or the kit's process died: the report then
# ends with a failed "kit process" check), 2 on a usage error.
set -uo pipefail
caller=$PWD
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
out=gpu-out  # in the repository; an --out given is taken from where the script was called
kit=()  # flags for the kit itself
list=0
usage="usage: bash scripts/gpu_check.sh [--out DIR] [--dry-run] [--only SECTIONS] [--list] [--backend NAME]"
while [ $# -gt 0 ]; do
  case "$1" in
    --out) [ $# -ge 2 ] || { echo "gpu_check: --out needs a folder" >&2; exit 2; }
      case "$2" in /*) out=$2 ;; *) out="$caller/$2" ;; esac; shift 2 ;;
    --dry-run) kit+=(--dry-run); shift ;;
    --list) list=1; shift ;;
    --only|--backend) [ $# -ge 2 ] || { echo "gpu_check: $1 needs a value" >&2; exit 2; }
      kit+=("$1" "$2"); shift 2 ;;
    --only=*|--backend=*) kit+=("$1"); shift ;;
    *) echo "$usage  (unknown argument: $1)" >&2; exit 2 ;;
  esac
done

if compgen -G ".whl/*.whl" >/dev/null && ! "$PY" -c 'import megatron.core' 2>/dev/null; then
  echo "gpu_check: installing the carried wheels into /tmp/site: $(cd .whl && echo *.whl)" >&2
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || { echo "gpu_check: installing .whl/*.whl failed" >&2; exit 1; }
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ "$list" = 1 ]; then exec "$PY" -m megapack.bench.gpu.kit --list; fi

mkdir -p "$out"
"$PY" -m megapack.bench.gpu.kit --out "$out" "${kit[@]}" 2>&1 | tee "$out/gpu-kit.log"
rc=${PIPESTATUS[0]}
case "$rc" in
  0) exit 0 ;;
  2) exit 2 ;;  # a usage error: the kit said which
  3) exit 1 ;;  # a check failed; the report is complete
  *)
    echo "gpu_check: the kit's process exited $rc; recording it in $out/gpu-report.json" >&2
    "$PY" -m megapack.bench.gpu.report --record-crash "$rc" --out "$out" --log "$out/gpu-kit.log"
    exit 1 ;;
esac
