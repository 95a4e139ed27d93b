"""Frozen model configuration built from a Hugging Face config dict."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from ..errors import ContractError, UnsupportedError

# architectures[0] -> family flags. One model class serves them all (see models/llama.py).
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {},
    "MistralForCausalLM": {},
    "Qwen2ForCausalLM": {"qkv_bias": True, "o_bias": False},   # bias on q/k/v only
    "Qwen3ForCausalLM": {"qk_norm": True},
}


def default_capture_ids(num_layers: int) -> tuple[int, int, int]:
    """The EAGLE-3 default capture ids, "input to layer i": 2, L//2, L-3 (every engine and the EAGLE
    reference use them when a draft stores no ids)."""
    return (2, num_layers // 2, num_layers - 3)


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    scaling_type: Optional[str] = None      # None | "linear" | "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    @classmethod
    def from_hf(cls, hf: dict) -> "RopeConfig":
        theta = float(hf.get("rope_theta", (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)))
        scaling = hf.get("rope_scaling") or {}
        params = hf.get("rope_parameters") or {}
        if not scaling and params.get("rope_type", "default") != "default":
            scaling = params
        kind = scaling.get("rope_type", scaling.get("type")) if scaling else None
        if kind in (None, "default"):
            return cls(theta=theta)
        if kind not in ("linear", "llama3"):
            raise UnsupportedError(
                f"rope_scaling type {kind!r} is not implemented; supported: linear, llama3 "
                "(or none). Use the generic adapter (eagle3.adapters) for this model.")
        return cls(theta=theta, scaling_type=kind, factor=float(scaling.get("factor", 1.0)),
                   low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
                   high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
                   original_max_position=int(scaling.get("original_max_position_embeddings", 8192)))


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        archs = hf.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in ARCHITECTURES:
            raise UnsupportedError(
                f"architecture {arch!r} has no native implementation; supported: "
                f"{', '.join(sorted(ARCHITECTURES))}. Other Hugging Face models run through the "
                "generic adapter (eagle3.adapters.HFTarget).")
        flags = ARCHITECTURES[arch]
        heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        window = hf.get("sliding_window")
        if arch == "MistralForCausalLM" and window and hf.get("use_sliding_window", True) \
                and int(window) < int(hf.get("max_position_embeddings", 0)):
            raise UnsupportedError(
                f"sliding_window={window} is not implemented; load a config without it or use the "
                "generic adapter")
        if hf.get("mlp_bias"):
            raise UnsupportedError("mlp_bias=true is not implemented; use the generic adapter")
        return cls(
            architecture=arch, vocab_size=int(hf["vocab_size"]), hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]), num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads, num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hidden // heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope=RopeConfig.from_hf(hf),
            max_position=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=bool(flags.get("qkv_bias", hf.get("attention_bias", False))),
            o_bias=bool(flags.get("o_bias", hf.get("attention_bias", False))),
            qk_norm=bool(flags.get("qk_norm", False)),
            bos_token_id=hf.get("bos_token_id"), eos_token_ids=eos_ids,
        )

    @property
    def default_aux_layer_ids(self) -> tuple[int, int, int]:
        return default_capture_ids(self.num_layers)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def check_capture_ids(capture_ids, num_layers: int, default_ids) -> None:
    """Capture ids ("input to layer i") must be in [0, num_layers), distinct and ascending."""
    ids = list(capture_ids)
    if any(not 0 <= i < num_layers for i in ids):
        raise ContractError("aux_layer_ids", ids, f"ids in [0, {num_layers - 1}]",
                            f"this target has {num_layers} layers; ids use the 'input to layer i' "
                            f"convention (default {list(default_ids)})")
    if len(set(ids)) != len(ids) or ids != sorted(ids):
        raise ContractError("aux_layer_ids", ids, "distinct ids in ascending order",
                            "list each captured layer once, low to high")
