"""Shared building blocks: RMSNorm, rotary embeddings, GQA attention over a static cache, SiLU MLP.

Target models and the EAGLE drafts are both built from these, so a numerical fix lands once.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .config import RopeConfig


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], with linear or llama3 scaling applied."""
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if rope.scaling_type == "linear":
        return (inv / rope.factor).float()
    if rope.scaling_type == "llama3":
        low_wavelen = rope.original_max_position / rope.low_freq_factor
        high_wavelen = rope.original_max_position / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled).float()
    return inv.float()


class Rotary(nn.Module):
    """Precomputed cos/sin tables indexed by absolute position (HF's rotate-half layout)."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_position: int):
        super().__init__()
        inv = rope_inv_freq(rope, head_dim)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [B, T] -> cos, sin [B, 1, T, D] (broadcast over heads)
        # the bound check is free on CPU; on CUDA it would be a host sync per forward (the callers
        # bound positions by the cache size, which never exceeds the table)
        if positions.device.type == "cpu" and int(positions.max()) >= self.cos.shape[0]:
            raise IndexError(f"position {int(positions.max())} >= rotary table size {self.cos.shape[0]}")
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [B, heads, T, D]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """GQA self-attention whose keys/values live in a caller-owned static cache buffer (SDPA).

    The reference and training path; the inference layout (runtime.layer) reads these weights."""

    def __init__(self, hidden_in: int, hidden_out: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, qkv_bias: bool = False, o_bias: bool = False,
                 qk_norm_eps: Optional[float] = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(hidden_in, num_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden_in, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden_in, num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_out, bias=o_bias)
        self.q_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None

    def project_qkv(self, x: torch.Tensor):
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                k_buf: torch.Tensor, v_buf: torch.Tensor, start: int,
                mask: Optional[torch.Tensor]) -> torch.Tensor:
        # x [B, T, hidden_in]; k_buf/v_buf [B, kv_heads, S, D]; mask bool [B|1, 1, T, start+T] or None
        bsz, seq, _ = x.shape
        end = start + seq
        q = self._rotate_and_cache(x, cos, sin, k_buf, v_buf, start)
        return self.o_proj(self.attend(q, k_buf, v_buf, end, mask).transpose(1, 2).reshape(bsz, seq, -1))

    def _rotate_and_cache(self, x, cos, sin, k_buf, v_buf, start: int) -> torch.Tensor:
        """q [B, H, T, D] rotated; k (rotated) and v written into rows start.. of the buffers."""
        bsz, seq, _ = x.shape
        q, k, v = self.project_qkv(x)
        q = q.view(bsz, seq, self.num_heads, self.head_dim)
        k = k.view(bsz, seq, self.num_kv_heads, self.head_dim)
        v = v.view(bsz, seq, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary(q.transpose(1, 2), cos, sin)
        k_buf[:, :, start:start + seq] = apply_rotary(k.transpose(1, 2), cos, sin)
        v_buf[:, :, start:start + seq] = v.transpose(1, 2)
        return q

    def attend(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, end: int,
               mask: Optional[torch.Tensor]) -> torch.Tensor:
        """softmax(q k^T) v over the cache prefix [:end]: q [B, H, T, D] -> [B, H, T, D]."""
        return F.scaled_dot_product_attention(
            q, k_buf[:, :, :end], v_buf[:, :, :end], attn_mask=mask,
            enable_gqa=self.num_kv_heads != self.num_heads)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def causal_block_mask(start: int, seq: int, device: torch.device) -> torch.Tensor:
    """Plain causal mask for a block of `seq` new tokens after `start` cached ones: [1, 1, seq, start+seq]."""
    cols = torch.arange(start + seq, device=device)
    rows = torch.arange(start, start + seq, device=device)
    return (cols[None, :] <= rows[:, None])[None, None]


def tree_block_mask(start: int, tree_mask: torch.Tensor) -> torch.Tensor:
    """Prefix fully visible + `tree_mask` [T, T] (bool, row sees col) among the new block: [1, 1, T, start+T]."""
    seq = tree_mask.shape[0]
    prefix = torch.ones(seq, start, dtype=torch.bool, device=tree_mask.device)
    return torch.cat([prefix, tree_mask.bool()], dim=1)[None, None]
