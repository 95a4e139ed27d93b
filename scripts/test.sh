#!/usr/bin/env bash
# The test suite as CI runs it (README: bash scripts/setup.sh --test && bash scripts/test.sh):
# every test, then the `lossless` ones (output identity through packed models) again with the
# kernels off, on the fallbacks a CPU without AVX-512 runs (oneDNN linears, fp64 row-stable
# attention). Extra arguments go to both pytest runs.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m pytest -q "$@"
echo "--- again with the kernels off (EAGLE3_KERNELS=0): the lossless tests"
EAGLE3_KERNELS=0 .venv/bin/python -m pytest -q -m lossless "$@"
