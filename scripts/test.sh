#!/usr/bin/env bash
# The test suite (README: bash scripts/setup.sh --test && bash scripts/test.sh): the lint gate (ruff,
# configured in pyproject.toml: unused imports and names, redefinitions, lines over 120), every test but the
# `slow` ones, then the `lossless` ones (output identity through packed models) again with the
# kernels off, on the fallbacks a CPU without AVX-512 runs (oneDNN linears, fp64 row-stable
# attention). `--slow` runs the slow tests instead (CI runs both: .ci/run). Other arguments go to
# both pytest runs.
set -euo pipefail
cd "$(dirname "$0")/.."
marks="not slow"
if [ "${1:-}" = "--slow" ]; then marks="slow"; shift; fi
pytest_allow_empty() {   # pytest's status 5 = no test selected, fine for a marker subset
  .venv/bin/python -m pytest -q "$@" || { rc=$?; [ "$rc" -eq 5 ] || exit "$rc"; }
}
echo "--- lint (ruff)"
.venv/bin/ruff check --quiet .
pytest_allow_empty -m "$marks" "$@"
echo "--- again with the kernels off (EAGLE3_KERNELS=0): the lossless tests"
EAGLE3_KERNELS=0 pytest_allow_empty -m "lossless and ($marks)" "$@"
