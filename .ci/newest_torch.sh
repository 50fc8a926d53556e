#!/usr/bin/env bash
# CI: the torch adapter (bitwise against torch's own schedules on 2 and 4 ranks), its drop-in
# classes (their orders against what torch's classes dump, torch's test scenarios), the CSV files
# torch writes and the Hugging Face stages, on the newest torch the package registry serves, in
# an environment of its own (the README's test command pins torch 2.13.0).
#
#   bash .ci/newest_torch.sh            the newest torch release
#   bash .ci/newest_torch.sh 2.14.1     a given one (how the rows of
#                                       src/pipeoffload/integrations/torch_versions.py were tested)
#
# It fails when that torch is one the adapter was not tested on (add its row once the tests
# pass there) and when any of these tests is skipped. The registry's torch is the CUDA build
# (~0.5 GB wheel plus ~2.3 GB of NVIDIA libraries; it runs on CPU). pip's own cache keeps
# nothing of it on this machine, so the wheels are kept in $PIPEOFFLOAD_CI_WHEELS (default
# ~/.cache/pipeoffload-ci), one torch version at a time, and installed from there.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
started=$SECONDS

# This machine's pip configuration may cap torch (a constraints file); lift it for this
# environment only.
: > "$work/no-constraints.txt"
export PIP_CONSTRAINT="$work/no-constraints.txt"
python3 -m venv "$work/venv"
py="$work/venv/bin/python"
version="${1:-$("$py" -m pip index versions torch 2>/dev/null | sed -n 's/^torch (\(.*\))$/\1/p')}"
if [ -z "$version" ]; then
    echo "newest-torch: could not ask the package registry for torch's versions" >&2
    exit 1
fi

cache="${PIPEOFFLOAD_CI_WHEELS:-${XDG_CACHE_HOME:-$HOME/.cache}/pipeoffload-ci}"
wheels="$cache/torch-$version"
mkdir -p "$wheels"
find "$cache" -mindepth 1 -maxdepth 1 -name 'torch-*' ! -name "torch-$version" -exec rm -rf {} +
"$py" -m pip download -q -d "$wheels" "torch==$version"
"$py" -m pip install -q --no-index --find-links "$wheels" "torch==$version"
"$py" -m pip install -q -e "$repo[test]"
installed=$SECONDS
echo "newest-torch: torch $("$py" -c 'import torch; print(torch.__version__)') installed in $((installed - started)) s"

# An untested torch: the adapter's own refusal, naming the tested versions, ends the job here.
"$py" -c "import pipeoffload.torch"

cd "$repo"
"$py" -m pytest -p no:cacheprovider -rs tests/test_torch_adapter.py tests/test_torch_csv.py \
    tests/test_torch_versions.py tests/test_torch_orders.py tests/test_torch_dropin.py \
    tests/test_torch_multirank.py tests/test_hf.py tests/test_class_recompute.py \
    tests/test_runtime_classes.py 2>&1 | tee "$work/pytest.log"
if grep -q "^SKIPPED" "$work/pytest.log"; then
    echo "newest-torch: tests were skipped on torch $version (above); this job runs them all" >&2
    exit 1
fi
passed="$(grep -Eo '[0-9]+ passed' "$work/pytest.log" | tail -1)"
echo "newest-torch: torch $version, $((SECONDS - installed)) s of tests, $((SECONDS - started)) s in all"
echo "newest-torch: ${passed:-0 passed}, 0 failed"
