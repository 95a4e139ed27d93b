"""Native decoder-only Llama-family model: Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM (one class, flags).

Feature capture convention ("input to layer i", EAGLE reference / SGLang internals / vLLM):
capture id i is the residual stream *entering* decoder layer i, before any norm, which equals index
i of HF `output_hidden_states` (index 0 = embeddings). Valid ids: 0 .. num_layers-1. The default
EAGLE-3 ids are 2, L//2, L-3. Captured states are concatenated low to high on the last dim.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch
from torch import nn

from .kv_cache import KVCache
from .config import ModelConfig, check_capture_ids
from .layers import MLP, Attention, RMSNorm, Rotary, causal_block_mask


class ForwardOutput(NamedTuple):
    logits: Optional[torch.Tensor]   # [B, R, V] for the requested rows (None if no rows requested)
    hidden: torch.Tensor             # [B, T, H] final hidden state after the final norm
    aux: Optional[torch.Tensor]      # [B, T, len(capture_ids) * H] captured residual streams, or None


def as_block(input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T] or [B, T], positions [T] or [B, T] -> both [B, T] (a forward's block)."""
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if positions.dim() == 1:
        positions = positions[None].expand(*input_ids.shape)
    return input_ids, positions


def rows_of(hidden: torch.Tensor, logits_rows) -> Optional[torch.Tensor]:
    """hidden [B, T, H] at the rows whose logits are wanted (None = all; an empty index = none)."""
    if logits_rows is None:
        return hidden
    if isinstance(logits_rows, torch.Tensor) and logits_rows.numel() == 0:
        return None
    return hidden[:, logits_rows]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg.hidden_size, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
                                   cfg.head_dim, cfg.qkv_bias, cfg.o_bias,
                                   cfg.rms_norm_eps if cfg.qk_norm else None)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, h, cos, sin, k_buf, v_buf, start, mask):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, k_buf, v_buf, start, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    """Target model, the reference and training path (runtime.target builds the inference layout
    from its weights and never modifies it). Weight names follow HF
    (`model.layers.N.self_attn.q_proj.weight`, ...)."""

    def __init__(self, cfg: ModelConfig, max_position: Optional[int] = None):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = Rotary(cfg.rope, cfg.head_dim, max_position or cfg.max_position)

    # ------------------------------------------------------------------ helpers
    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def new_cache(self, max_len: int, batch: int = 1) -> KVCache:
        p = self.embed_tokens.weight
        return KVCache(self.config.num_layers, self.config.num_kv_heads, self.config.head_dim,
                       max_len, batch, p.dtype, p.device)

    def check_capture_ids(self, capture_ids: Sequence[int]) -> None:
        check_capture_ids(capture_ids, self.config.num_layers, self.config.default_aux_layer_ids)

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                attn_mask: Optional[torch.Tensor] = None,
                logits_rows: Optional[torch.Tensor | slice] = None,
                capture_ids: Sequence[int] = ()) -> ForwardOutput:
        """Run a block of tokens through the model, appending their KV at `cache.length`.

        input_ids, positions: [B, T] (positions may be [T], shared). attn_mask: bool, broadcastable
        to [B, 1, T, cache.length + T], True = may attend; None = plain causal. logits_rows: rows of
        the block whose logits are needed (index tensor or slice); None = all rows.
        capture_ids: layer ids to capture ("input to layer i"), ascending.
        """
        input_ids, positions = as_block(input_ids, positions)
        seq = input_ids.shape[1]
        start = cache.length
        cache.check_room(seq)
        if attn_mask is None and seq > 1:
            attn_mask = causal_block_mask(start, seq, input_ids.device)
        capture = set(capture_ids)
        if capture:
            self.check_capture_ids(capture_ids)
        cos, sin = self.rotary(positions)
        h = self.embed_tokens(input_ids)
        feats = []
        for i, layer in enumerate(self.layers):
            if i in capture:
                feats.append(h)
            k_buf, v_buf = cache.layer(i)
            h = layer(h, cos, sin, k_buf, v_buf, start, attn_mask)
        cache.advance(seq)
        hidden = self.norm(h)
        wanted = rows_of(hidden, logits_rows)
        logits = None if wanted is None else self.lm_head(wanted)
        aux = torch.cat(feats, dim=-1) if feats else None
        return ForwardOutput(logits, hidden, aux)
