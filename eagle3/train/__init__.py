"""Draft training pipeline: prompts, regenerated data, features, draft vocabulary, training-time test.

Entry point: `train_main(argv)` (`eagle3 train`, `python -m eagle3.train`, torchrun for DDP).
"""
from .config import TrainConfig
from .cli import train_main
from .pipeline import train

__all__ = ["TrainConfig", "train", "train_main"]
