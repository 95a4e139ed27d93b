"""Runtime: static KV cache (kv_cache), model/tokenizer loading (loader), packaged assets (assets).

Import the loader as `eagle3.runtime.loader` (it depends on eagle3.models, which depends on the cache).
"""
from ..models.kv_cache import KVCache

__all__ = ["KVCache"]
