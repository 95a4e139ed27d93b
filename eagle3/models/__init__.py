"""Model definitions: config, shared layers, the native Llama-family target."""
from .config import ARCHITECTURES, ModelConfig, RopeConfig
from .llama import ForwardOutput, LlamaModel

__all__ = ["ARCHITECTURES", "ModelConfig", "RopeConfig", "ForwardOutput", "LlamaModel"]
