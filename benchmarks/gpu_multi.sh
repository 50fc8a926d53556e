#!/usr/bin/env bash
# The multi-GPU check of issue 20 (benchmarks/gpu_multi.py says what it checks): torchrun with
# one process per GPU; step 1 and two more of zbv, interleaved-1f1b and dualpipe exact against
# one process, a tied-embedding Hugging Face model, and a V schedule on a device capped near
# its plan. It has not run on GPUs yet.
# Usage: bash benchmarks/gpu_multi.sh [--nproc N] [--device cpu] [--limit-s S]
#   --nproc N: processes (default 2); with fewer GPUs than that it prints SKIPPED and exits 0.
#   --device cpu: the same processes on gloo (what CI runs, so the script keeps working).
# Exit status: 0 when every check on every rank passed (or the check was skipped).
set -u
DEVICE=cuda
NPROC=2
LIMIT=300
while [ $# -gt 0 ]; do
  case "$1" in
    --nproc) NPROC="$2"; shift 2 ;;
    --device) DEVICE="$2"; shift 2 ;;
    --limit-s) LIMIT="$2"; shift 2 ;;
    -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
    *) echo "gpu_multi.sh: unknown argument $1 (use --nproc N, --device cpu|cuda," \
            "--limit-s S)" >&2; exit 2 ;;
  esac
done
if ! [ "$NPROC" -ge 2 ] 2>/dev/null; then
  echo "gpu_multi.sh: --nproc must be a number >= 2 (a pipeline of one rank sends nothing)" >&2
  exit 2
fi
# shellcheck source=benchmarks/_env.sh
source "$(dirname "$0")/_env.sh"
cd "$ROOT" || exit 2
if [ "$DEVICE" = cuda ]; then
  GPUS="$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)"
  if [ "${GPUS:-0}" -lt "$NPROC" ]; then
    echo "gpu_multi: SKIPPED: ${GPUS:-0} CUDA device(s), $NPROC processes need one each"
    exit 0
  fi
fi
timeout "$LIMIT" "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
  benchmarks/gpu_multi.py --device "$DEVICE"
rc=$?
if [ "$rc" -eq 124 ]; then echo "gpu_multi: TIMED OUT after $LIMIT s (a hang: see the ranks' last lines)"; fi
exit "$rc"
