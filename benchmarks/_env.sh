# Sourced by the GPU scripts (gpu_check.sh, gpu_multi.sh): ROOT (the checkout), PYTHON (as set,
# else python, else python3) and a PYTHONPATH that finds pipeoffload and the benchmarks' helpers.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -z "${PYTHON:-}" ]; then
  if command -v python >/dev/null 2>&1; then PYTHON=python; else PYTHON=python3; fi
fi
export PYTHONPATH="$ROOT/src:$ROOT/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
export CUBLAS_WORKSPACE_CONFIG=":4096:8"  # deterministic cuBLAS for the bitwise checks
