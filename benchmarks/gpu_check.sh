#!/usr/bin/env bash
# The GPU check of issue 11, one script, one table (at most 8 minutes on one H100 / H200):
#   1. the CUDA tests (tests/test_runtime_cuda.py: offload RELOAD / FETCH bitwise, the cap on
#      pending copies, recomputation on a parameter-free stage);
#   2. the same under TORCH_CUDA_SANITIZER=1 (stream-order races between compute and copies);
#   3. the host-ahead stress (benchmarks/gpu_stress.py);
#   4. benchmarks/gpu_offload.py at one realistic size, po-f and po-f + FETCH vs no offload.
# Usage: bash benchmarks/gpu_check.sh [--device cpu] [--log-dir DIR]
#   --device cpu runs every step on the CPU, shortened (the CUDA tests then skip): what CI runs.
# Each step's full output goes to DIR (default: a temporary folder); the table says where.
# Exit status: 0 when every step passed.
set -u
DEVICE=cuda
LOG_DIR=""
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE="$2"; shift 2 ;;
    --log-dir) LOG_DIR="$2"; shift 2 ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (use --device cpu|cuda, --log-dir DIR)" >&2; exit 2 ;;
  esac
done
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-python}"
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
export CUBLAS_WORKSPACE_CONFIG=":4096:8"  # deterministic cuBLAS for the bitwise checks
LOG_DIR="${LOG_DIR:-$(mktemp -d)}"
mkdir -p "$LOG_DIR"
cd "$ROOT" || exit 2

if [ "$DEVICE" = cpu ]; then
  STRESS=(--device cpu --microbatches 4)
  LIMIT="${GPU_CHECK_LIMIT_S:-120}"  # seconds per step; the test suite sets a hang guard
  OFFLOAD=(--device cpu --tiny --sizes 4x64x32 --variants po-f,po-f+fetch --steps 1 --warmup 0
           --time-budget-s "$LIMIT")
else
  STRESS=(--device cuda)
  OFFLOAD=(--device cuda --sizes 8x4096x8192 --variants po-f,po-f+fetch --steps 3 --warmup 1
           --time-budget-s 150)
  LIMIT="${GPU_CHECK_LIMIT_S:-240}"
fi

ROWS=()
FAILED=0
step() {  # step NAME LIMIT_S COMMAND...: run it, keep its log, add a table row
  local name="$1" limit="$2" log="$LOG_DIR/$(echo "$1" | tr ' +/' '___').log"
  shift 2
  local start=$SECONDS
  timeout "$limit" "$@" >"$log" 2>&1
  local rc=$?
  local took=$((SECONDS - start))
  local result
  result="$(grep '^RESULT: ' "$log" | tail -n 1 | cut -c 9-)"
  if [ -z "$result" ]; then  # pytest: its summary line
    result="$(grep -E '(passed|failed|skipped|error)' "$log" | tail -n 1 | tr -d '=' | sed 's/^ *//')"
  fi
  local status=ok
  if [ "$rc" -eq 124 ]; then status="TIMED OUT (${limit} s)"; FAILED=1
  elif [ "$rc" -ne 0 ]; then status="FAILED (exit $rc)"; FAILED=1; fi
  ROWS+=("| $name | $status | ${took} | ${result:-see log} |")
  echo "gpu_check: $name: $status in ${took} s" >&2
}

step "cuda tests" "$LIMIT" "$PYTHON" -m pytest tests/test_runtime_cuda.py -p no:cacheprovider
TORCH_CUDA_SANITIZER=1 step "cuda tests, sanitizer" "$LIMIT" \
  "$PYTHON" -m pytest tests/test_runtime_cuda.py -p no:cacheprovider
step "host-ahead stress" "$LIMIT" "$PYTHON" benchmarks/gpu_stress.py "${STRESS[@]}"
step "gpu_offload po-f" "$LIMIT" "$PYTHON" benchmarks/gpu_offload.py "${OFFLOAD[@]}"

echo
echo "GPU check on $DEVICE ($("$PYTHON" -c 'import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device")' 2>/dev/null)); logs in $LOG_DIR"
echo "| step | status | seconds | result |"
echo "|---|---|---|---|"
printf '%s\n' "${ROWS[@]}"
exit "$FAILED"
