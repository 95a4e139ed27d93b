"""Runtime: static KV cache, model/tokenizer loading, packaged assets."""
from .kv_cache import KVCache
from .loader import ModelSource, load_model, load_tokenizer, resolve_model

__all__ = ["KVCache", "ModelSource", "load_model", "load_tokenizer", "resolve_model"]
