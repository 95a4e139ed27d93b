"""Draft training pipeline: prompts, regenerated data, features, draft vocabulary, training-time test.

Entry point: `train_main(argv)` (`eagle3 train`, `python -m eagle3.train`, torchrun for DDP).
Imports are lazy: vLLM loads `eagle3.train.vllm_connector` by module path in its own venv, which
must not pull in the pipeline.
"""
from __future__ import annotations

from importlib import import_module

__all__ = ["TrainConfig", "train", "train_main"]
_WHERE = {"TrainConfig": ".config", "train": ".pipeline", "train_main": ".cli"}


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_WHERE[name], __name__), name)
