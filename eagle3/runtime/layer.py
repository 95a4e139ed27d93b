"""One decoder layer of an inference layout (a Llama target layer, or an EAGLE midlayer).

Built once from a reference layer's weights (models.layers / draft.model modules, read, never
modified): q/k/v and gate/up fused into one PackedLinear each. A forward is one of two paths, chosen
by the block's rows only:

    one call   blocks <= backend.kernel_rows on `avx512`: csrc/layer.cpp decoder_layer with the layer's
               LayerWeights (the composite path's ops in its order: same bits)
    composite  everything else: norm -> qkv -> rotary + cache write -> attention -> o -> norm ->
               gate_up -> silu * up (backend.silu_mul) -> down, each op through the backend

`x_in` (the attention's input when it is not norm1(h)): an EAGLE-3 midlayer attends over
cat(norm(embedding), norm(hidden)) and adds to hidden; an EAGLE-1 layer attends over h itself.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ..models.kv_cache import SlotRows
from ..models.layers import Attention, MLP, RMSNorm, apply_rotary, causal_block_mask
from .backend import Backend
from .linear import PackedLinear, fused_linear

KERNEL_KV = (torch.float32, torch.float16)   # the cache elements the kernels read and write


class Norm(NamedTuple):
    weight: torch.Tensor
    eps: float


def norm_of(module: RMSNorm) -> Norm:
    return Norm(module.weight.detach(), module.eps)


class FastLayer:
    def __init__(self, attn: Attention, mlp: MLP, norm1: Optional[RMSNorm], norm2: RMSNorm,
                 backend: Backend, codes: Optional[dict] = None):
        # codes: GGUF integer codes by weight name within the layer ("self_attn.q_proj.weight"),
        # for `--weights gguf` (runtime.quant); a fused linear takes them when all its parts have them
        self.backend = backend
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.norm1 = norm_of(norm1) if norm1 is not None else None
        self.norm2 = norm_of(norm2)
        self.q_norm = norm_of(attn.q_norm) if attn.q_norm is not None else None
        self.k_norm = norm_of(attn.k_norm) if attn.k_norm is not None else None
        of = lambda *names: _codes_of(codes, names)
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        self.qkv = fused_linear([p.weight for p in projections], [p.bias for p in projections], backend,
                                of("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"))
        self.o_proj = PackedLinear(attn.o_proj.weight, attn.o_proj.bias, backend, of("self_attn.o_proj"))
        self.gate_up = fused_linear([mlp.gate_proj.weight, mlp.up_proj.weight], [None, None], backend,
                                    of("mlp.gate_proj", "mlp.up_proj"))
        self.down_proj = PackedLinear(mlp.down_proj.weight, None, backend, of("mlp.down_proj"))
        self.one_call = self._one_call_weights()

    @property
    def linears(self) -> tuple[PackedLinear, ...]:
        return self.qkv, self.o_proj, self.gate_up, self.down_proj

    def _one_call_weights(self):
        """csrc/kernels.h LayerWeights where the one-call layer covers this layer, else None."""
        b = self.backend
        if (b.kernels is None or not b.one_call_layers or not b.fused_rope or self.q_norm is not None
                or not all(l.kernel_ready for l in self.linears)
                or len({l.amx for l in self.linears}) > 1):   # LayerWeights holds one path
            return None
        norm1 = self.norm1 or Norm(self.norm2.weight, self.norm2.eps)   # unused when x_in is given
        return b.kernels.LayerWeights(
            norm1=norm1.weight, qkv_w=self.qkv.small_weight, qkv_b=self.qkv.bias,
            o_w=self.o_proj.small_weight, o_b=self.o_proj.bias, norm2=self.norm2.weight,
            gate_up_w=self.gate_up.small_weight, down_w=self.down_proj.small_weight,
            eps1=norm1.eps, eps2=self.norm2.eps, num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, intermediate=self.down_proj.in_features,
            bf16=self.backend.weight_dtype == torch.bfloat16, amx=self.qkv.amx)

    def __call__(self, h: torch.Tensor, x_in: Optional[torch.Tensor], cos: torch.Tensor,
                 sin: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, start: int,
                 mask: Optional[torch.Tensor]) -> torch.Tensor:
        # h [B, T, H] residual stream; x_in [B, T, *] or None (= norm1(h), or h without norm1)
        if x_in is None and self.norm1 is None:
            x_in = h
        if self.one_call is not None and h.shape[0] * h.shape[1] <= self.backend.kernel_rows:
            return self.backend.kernels.decoder_layer(h.contiguous(), x_in, self.one_call, cos, sin,
                                                      k_buf, v_buf, start, mask)
        x = x_in if x_in is not None else self.backend.rms_norm(h, *self.norm1)
        h = h + self.attention(x, cos, sin, k_buf, v_buf, start, mask)
        return h + self.down_proj(self.backend.silu_mul(self.gate_up(self.backend.rms_norm(h, *self.norm2))))

    def attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_buf: torch.Tensor,
                  v_buf: torch.Tensor, start: int, mask: Optional[torch.Tensor]) -> torch.Tensor:
        bsz, seq, _ = x.shape
        b = self.backend
        if b.kernels is not None and b.fused_rope and self.q_norm is None and k_buf.dtype in KERNEL_KV:
            # split, rotary, cache write and the q layout in one call, same bits as _rotate_and_cache
            q = b.kernels.rope_qkv(self.qkv(x).view(bsz * seq, -1), cos, sin, k_buf, v_buf, start,
                                   self.num_heads, self.num_kv_heads)
        else:
            q = self._rotate_and_cache(x, cos, sin, k_buf, v_buf, start)
        end = start + seq
        a = b.attention(q, k_buf[:, :, :end], v_buf[:, :, :end], mask)
        return self.o_proj(a.transpose(1, 2).reshape(bsz, seq, -1))

    def _rotate_and_cache(self, x, cos, sin, k_buf, v_buf, start: int) -> torch.Tensor:
        """q [B, H, T, D] rotated; k (rotated) and v written into rows start.. of the buffers."""
        bsz, seq, _ = x.shape
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(bsz, seq, self.num_heads, self.head_dim)
        k = k.view(bsz, seq, self.num_kv_heads, self.head_dim)
        v = v.view(bsz, seq, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.backend.rms_norm(q, *self.q_norm), self.backend.rms_norm(k, *self.k_norm)
        q = apply_rotary(q.transpose(1, 2), cos, sin)
        k_buf[:, :, start:start + seq] = apply_rotary(k.transpose(1, 2), cos, sin)
        v_buf[:, :, start:start + seq] = v.transpose(1, 2)
        return q

    # ------------------------------------------------------------------ rows of several sequences
    def forward_rows(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     k_buf: torch.Tensor, v_buf: torch.Tensor, rows: SlotRows,
                     x_in: Optional[torch.Tensor] = None) -> torch.Tensor:
        """A layer over the rows of several sequences (continuous batching), each with its own
        cache slot: one call per linear over all rows, attention per sequence (SlotRows). The
        composite path's ops, so a row gets the bits it gets in its sequence's own forward; as one
        C++ call (decoder_layer with the rows) where the one-call layer applies. x_in: as in
        __call__ (an EAGLE-3 midlayer's attention input), on the composite path."""
        # h [1, N, H]; cos, sin [1, 1, N, D]; k_buf, v_buf [slots, Hkv, S, D]
        if (x_in is None and self.one_call is not None and self.norm1 is not None
                and h.shape[1] <= self.backend.kernel_rows and k_buf.dtype in KERNEL_KV):
            return self.backend.kernels.decoder_layer(h.contiguous(), None, self.one_call, cos, sin, k_buf,
                                                      v_buf, 0, rows.mask, rows.slot, rows.index, rows.keys)
        if x_in is None:
            x_in = h if self.norm1 is None else self.backend.rms_norm(h, *self.norm1)
        h = h + self.attention_rows(x_in, cos, sin, k_buf, v_buf, rows)
        return h + self.down_proj(self.backend.silu_mul(self.gate_up(self.backend.rms_norm(h, *self.norm2))))

    def attention_rows(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       k_buf: torch.Tensor, v_buf: torch.Tensor, rows: SlotRows) -> torch.Tensor:
        n = x.shape[1]
        b = self.backend
        fused = b.kernels is not None and k_buf.dtype in KERNEL_KV
        if fused and b.fused_rope and self.q_norm is None:
            q = b.kernels.rope_qkv(self.qkv(x).view(n, -1), cos, sin, k_buf, v_buf, 0, self.num_heads,
                                   self.num_kv_heads, rows.slot, rows.index)
        else:
            q = self._rotate_and_cache_rows(x, cos, sin, k_buf, v_buf, rows)
        if fused:
            a = b.kernels.attention(q.contiguous(), k_buf, v_buf, rows.mask, rows.slot, rows.keys)
        else:
            a = self._attend_each(q, k_buf, v_buf, rows)
        return self.o_proj(a.transpose(1, 2).reshape(1, n, -1))

    def _rotate_and_cache_rows(self, x, cos, sin, k_buf, v_buf, rows: SlotRows) -> torch.Tensor:
        """q [1, H, N, D] rotated; each row's k (rotated) and v written at its slot and index."""
        n = x.shape[1]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(1, n, self.num_heads, self.head_dim)
        k = k.view(1, n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.backend.rms_norm(q, *self.q_norm), self.backend.rms_norm(k, *self.k_norm)
        slot, index = rows.slot.to(k_buf.device), rows.index.to(k_buf.device)
        k_buf[slot, :, index] = apply_rotary(k.transpose(1, 2), cos, sin)[0].transpose(0, 1).to(k_buf.dtype)
        v_buf[slot, :, index] = v.view(n, self.num_kv_heads, self.head_dim).to(v_buf.dtype)
        return apply_rotary(q.transpose(1, 2), cos, sin)

    def _attend_each(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                     rows: SlotRows) -> torch.Tensor:
        """Without the kernels: the backend's attention once per sequence over its slot's prefix
        (a Python loop over sequences, attention only), with its block's causal (or tree) mask."""
        out = torch.empty_like(q)
        for blk in rows.blocks:
            r, end = slice(blk.first_row, blk.first_row + blk.rows), blk.start + blk.rows
            if rows.mask is not None:
                mask = self.backend.prepare_mask(rows.mask[:, :, r, :end].contiguous())
            else:
                mask = None if blk.rows == 1 else self.backend.prepare_mask(
                    causal_block_mask(blk.start, blk.rows, q.device))
            out[:, :, r] = self.backend.attention(q[:, :, r], k_buf[blk.slot:blk.slot + 1, :, :end],
                                                  v_buf[blk.slot:blk.slot + 1, :, :end], mask)
        return out


def _codes_of(codes: Optional[dict], names: tuple[str, ...]) -> Optional[list]:
    """The parts' codes in order, or None unless every part has them."""
    if not codes:
        return None
    parts = [codes.get(f"{n}.weight") for n in names]
    return parts if all(p is not None for p in parts) else None
