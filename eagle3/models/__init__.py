"""The reference models: config, shared layers, the native Llama-family target, the KV cache.
Used by training and as the numerical reference; the inference layout (eagle3.runtime) reads
their weights and never modifies them."""
from .config import ARCHITECTURES, ModelConfig, RopeConfig
from .kv_cache import KVCache
from .llama import ForwardOutput, LlamaModel

__all__ = ["ARCHITECTURES", "ModelConfig", "RopeConfig", "KVCache", "ForwardOutput", "LlamaModel"]
