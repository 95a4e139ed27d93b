"""Static (preallocated) KV cache that takes blocks of tokens and keeps a chosen subset of a block.

Layout: keys and values [num_layers, batch, num_kv_heads, max_len, head_dim]. Slot i holds the token
whose KV was written i-th; `length` slots are live. A forward writes its block at [length, length+T)
and then `advance(T)`; after tree verification `keep(start, kept)` compacts the accepted nodes of the
block to [start, start+len(kept)) in order. Nothing is reallocated after construction.
"""
from __future__ import annotations

import torch

from ..errors import InputError


def check_room(length: int, num_new: int, max_len: int) -> None:
    """Raise InputError when `num_new` more tokens do not fit after `length` cached ones."""
    if length + num_new > max_len:
        raise InputError(
            f"KV cache overflow: {length} cached + {num_new} new tokens > max_len "
            f"{max_len}. Shorten the prompt or max_new_tokens, or raise --max-model-len.")


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_len: int,
                 batch: int = 1, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        shape = (num_layers, batch, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.length = 0

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]

    def check_room(self, num_new: int) -> None:
        check_room(self.length, num_new, self.max_len)

    def advance(self, num_new: int) -> None:
        self.check_room(num_new)
        self.length += num_new

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"truncate to {length} outside [0, {self.length}]")
        self.length = length

    def keep(self, start: int, kept: torch.Tensor) -> None:
        """Keep only block slots `start + kept` (sorted, relative to start), compacted to start.."""
        n = int(kept.numel())
        src = kept.to(self.k.device) + start
        self.k[:, :, :, start:start + n] = self.k.index_select(3, src)
        self.v[:, :, :, start:start + n] = self.v.index_select(3, src)
        self.length = start + n

    def reset(self) -> None:
        self.length = 0

    def take_rows(self, rows: torch.Tensor) -> "KVCache":
        """A new cache of batch rows `rows` (same max_len, dtype, device) holding their live slots."""
        num_layers, _, num_kv_heads, max_len, head_dim = self.k.shape
        out = KVCache(num_layers, num_kv_heads, head_dim, max_len, len(rows), self.k.dtype, self.k.device)
        live = slice(0, self.length)
        out.k[:, :, :, live] = self.k[:, rows, :, live]
        out.v[:, :, :, live] = self.v[:, rows, :, live]
        out.length = self.length
        return out
