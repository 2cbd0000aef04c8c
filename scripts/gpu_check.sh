#!/usr/bin/env bash
# The GPU kit, by sections: the first-run plan (a toy GraphStep captured with each attention
# backend forced, cuDNN's THD attention against torch varlen per FLOP on two rows, packed (cudnn)
# against fair grouped padding on the 0.84B preset, whole-step graphs against grouped eager), and
# the whole kit: attention backends vs a float64 reference, packed == padded losses (fp32 and
# bf16), zero host syncs in delivery + prefetch + a packed fwd+bwd, the real-size throughput table
# (0.84B GPT, seq 4096 and 8192, packed vs every baseline, interleaved) with its targets, a
# profile, the captured step. One run of <= 6 minutes measures what a change touched (`--only`);
# the whole kit is two runs; `--plan first-run` is one run of <= 5 minutes (`--list` prints the
# sections, the plans, their estimated time and the split).
#
#   bash scripts/gpu_check.sh [--out DIR] [--dry-run] [--plan NAME | --only SECTIONS] [--list] [--backend NAME]
#
# Writes DIR/gpu-report.json, DIR/gpu-report.md and DIR/gpu-kit.log (DIR defaults to gpu-out).
# --dry-run: the same steps on CPU at toy sizes (fp32, gloo), CUDA-only checks skipped; < 1 minute.
# --plan first-run, --only attention,throughput,...: run those sections; --backend: the models'
# THD attention (default auto; cudnn in the first-run plan where it trains); all go to
# `python -m megapack.bench.gpu.kit`, which checks them.
# Wheels in .whl/ (bash scripts/gpu_wheels.sh) are installed into /tmp/site first when
# megatron-core is not importable here (the GPU machine has none; carry .whl with the call), or
# when the cuDNN frontend (`import cudnn`) is not and its wheel is there.
# Exit status: 0 when no check failed, 1 when one did (or the kit's process died: the report then
# ends with a failed "kit process" check), 2 on a usage error.
set -uo pipefail
caller=$PWD
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
out=gpu-out  # in the repository; an --out given is taken from where the script was called
kit=()  # flags for the kit itself
list=0
usage="usage: bash scripts/gpu_check.sh [--out DIR] [--dry-run] [--plan NAME | --only SECTIONS] [--list] [--backend NAME]"
while [ $# -gt 0 ]; do
  case "$1" in
    --out) [ $# -ge 2 ] || { echo "gpu_check: --out needs a folder" >&2; exit 2; }
      case "$2" in /*) out=$2 ;; *) out="$caller/$2" ;; esac; shift 2 ;;
    --dry-run) kit+=(--dry-run); shift ;;
    --list) list=1; shift ;;
    --only|--backend|--plan) [ $# -ge 2 ] || { echo "gpu_check: $1 needs a value" >&2; exit 2; }
      kit+=("$1" "$2"); shift 2 ;;
    --only=*|--backend=*|--plan=*) kit+=("$1"); shift ;;
    *) echo "$usage  (unknown argument: $1)" >&2; exit 2 ;;
  esac
done

if compgen -G ".whl/*.whl" >/dev/null && { ! "$PY" -c 'import megatron.core' 2>/dev/null ||
    { compgen -G ".whl/nvidia_cudnn_frontend-*.whl" >/dev/null && ! "$PY" -c 'import cudnn' 2>/dev/null; }; }; then
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
