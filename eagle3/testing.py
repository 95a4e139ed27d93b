"""Tiny random-weight models of each supported family, for tests and dry runs (no downloads)."""
from __future__ import annotations

import torch

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=2)

FAMILIES = {
    "llama3": dict(TINY, architectures=["LlamaForCausalLM"], model_type="llama",
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "llama_linear": dict(TINY, architectures=["LlamaForCausalLM"], model_type="llama",
                         rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "mistral": dict(TINY, architectures=["MistralForCausalLM"], model_type="mistral",
                    sliding_window=None),
    "qwen2": dict(TINY, architectures=["Qwen2ForCausalLM"], model_type="qwen2"),
    "qwen3": dict(TINY, architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=24),
    "smollm_tied": dict(TINY, architectures=["LlamaForCausalLM"], model_type="llama",
                        tie_word_embeddings=True),
}


def hf_model_from_dict(hf_cfg: dict, seed: int = 0):
    """A random-weight HF transformers model for `hf_cfg` (fp32, eval)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = dict(hf_cfg)
    model_type = cfg.pop("model_type")
    config = AutoConfig.for_model(model_type, **cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # HF inits norms to 1: perturb them so a wrong norm shows up
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def native_from_hf(hf_model, tmp_path):
    """Save an HF model to safetensors and load it through our strict loader."""
    from .runtime.loader import load_model
    hf_model.save_pretrained(tmp_path, safe_serialization=True)
    return load_model(tmp_path)
