"""Targets without a native model: the generic Hugging Face adapter, chosen automatically."""
from __future__ import annotations

from typing import Optional

import torch

from ..errors import UnsupportedError
from ..models.config import ModelConfig
from ..models.target import Target
from ..runtime.loader import load_model, read_hf_config, resolve_model
from .hf import HFCache, HFTarget, TargetConfig, find_decoder, load_hf_model


def load_target(spec: Optional[str], device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32, trust_remote_code: bool = False) -> Target:
    """The native LlamaModel when ModelConfig accepts the checkpoint's config, HFTarget otherwise.

    `spec` is what resolve_model takes (None / "smollm2", a .gguf file, an HF directory).
    """
    source = resolve_model(spec)
    try:
        ModelConfig.from_hf(read_hf_config(source.hf_dir))
    except UnsupportedError:
        return HFTarget.from_pretrained(source.hf_dir, device, dtype, trust_remote_code)
    return load_model(source.hf_dir, device, dtype)


__all__ = ["HFCache", "HFTarget", "Target", "TargetConfig", "find_decoder", "load_hf_model",
           "load_target"]
