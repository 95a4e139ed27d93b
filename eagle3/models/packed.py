"""Inference-time weight layout for the CPU: fused projections and prepacked GEMM weights.

Measured on the 2-core AVX2 CPU (fp32, SmolLM2 shapes, one thread; `python /tmp`-style microbench
kept in scripts/bench_runtime.py): torch's default x @ W.T is fine for one row when W is stored
[in, out] (lm_head 49152x576: 7-11 ms vs 24 ms in the [out, in] layout), but for 2-16 rows MKL
falls off (8 rows: 33 ms) while oneDNN with a prepacked weight takes 14-15 ms. Verification
forwards have several rows, decode forwards one, so PackedLinear keeps both layouts and picks per
call. With 2 threads oneDNN also wins for one row (SmolLM2 decode forward 38.5 ms vs 47-50 ms with
the [in, out] GEMV, which does not scale past one thread here), so the GEMV layout serves only
one-row calls on one thread. On other devices (CUDA) it is a plain linear. Fusing q/k/v and gate/up
halves the GEMM count.

Small blocks (decode, tree verify, the draft's levels) go to eagle3.kernels where the CPU has
AVX-512: ~1.6-2x oneDNN's speed for 1-8 rows, ~1.1-1.3x at 16-32 (scripts/bench_kernels.py, 2
threads), and every row's result independent of the call's other rows. A plain target sends blocks of up to
SMALL_ROWS rows there (above, oneDNN is faster); a row-stable one sends every block of up to
STABLE_ROWS rows (any verify tree: num_draft_tokens is bounded by it), so verify == decode bit
for bit in its linear layers, and only long prefills take oneDNN.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

PACK_ROWS_HINT = 8
SMALL_ROWS = 32          # plain: the kernel for blocks up to this many rows (faster than oneDNN
                         # at 1-32 rows on 2 threads, scripts/bench_kernels.py)
STABLE_ROWS = 256        # row-stable: the kernel for every block up to this many rows


def _onednn_ok() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class PackedLinear(nn.Module):
    """y = x W^T + b: small blocks through eagle3.kernels (where the CPU has them), the rest
    through oneDNN with a prepacked weight; on CPUs without either, the [in, out] GEMV layout."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                 weight_dtype: torch.dtype = torch.float32, small_rows: int = SMALL_ROWS):
        super().__init__()
        from .. import kernels
        weight = weight.detach()
        self.out_features, self.in_features = weight.shape
        self.weight_dtype = weight_dtype
        self.register_buffer("weight_t", weight.t().contiguous(), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone(), persistent=False)
        self.packed = None
        if weight.device.type == "cpu" and weight.dtype == torch.float32 and _onednn_ok():
            w = weight.contiguous().to(weight_dtype)
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT)
        even = weight_dtype != torch.bfloat16 or self.in_features % 2 == 0
        cpu = weight.device.type == "cpu"
        self.small = kernels.small_linear(weight_dtype) if cpu and even else None
        self.small_rows = small_rows
        self.small_weight = kernels.pack_weight(weight, weight_dtype) if self.small else None
        if weight_dtype != torch.float32:
            if self.packed is None:
                raise ValueError(f"{weight_dtype} weights need oneDNN on the CPU")
            self.weight_t = None  # every call goes through the bf16 kernels
        elif self.small is not None and self.packed is not None:
            self.weight_t = None  # small-M kernel for few rows, oneDNN for the rest

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if self.small is not None and rows <= self.small_rows:
            flat = x.reshape(rows, self.in_features).to(self.weight_dtype).contiguous()
            y = self.small(flat, self.small_weight, self.bias, self.out_features)
            return y.view(*x.shape[:-1], self.out_features)
        if self.weight_dtype != torch.float32:  # low-precision weights, fp32 activations in and out
            flat = x.reshape(rows, self.in_features).to(self.weight_dtype)
            if rows == 1:  # oneDNN's one-row kernel rounds differently: run it as two rows
                flat = torch.cat([flat, flat])
            y = torch.ops.mkldnn._linear_pointwise(flat, self.packed, None, "none", [], "")[:rows].float()
            y = y if self.bias is None else y + self.bias
            return y.view(*x.shape[:-1], self.out_features)
        if self.packed is None or (rows == 1 and torch.get_num_threads() == 1):
            y = x @ self.weight_t
            return y if self.bias is None else y + self.bias
        flat = x.reshape(rows, self.in_features)
        y = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
        return y.view(*x.shape[:-1], self.out_features)


def _cat_linear(*layers: nn.Linear, weight_dtype: torch.dtype, small_rows: int) -> PackedLinear:
    weight = torch.cat([l.weight for l in layers], dim=0)
    biases = [l.bias for l in layers]
    bias = torch.cat(biases) if biases[0] is not None else None
    return PackedLinear(weight, bias, weight_dtype, small_rows)


@torch.no_grad()
def pack_for_inference(model: nn.Module, weight_dtype: torch.dtype = torch.float32,
                       row_stable: bool = False) -> nn.Module:
    """Fuse q/k/v and gate/up and swap every nn.Linear for a PackedLinear, in place (frozen models).

    weight_dtype=torch.bfloat16 stores the GEMM weights in bf16 (activations stay fp32): half the
    memory traffic, and fast on CPUs with AVX512-BF16. The model then differs numerically from
    the fp32 checkpoint. Every bf16 input rounding amplifies a last-bit difference, so a verify
    block (many rows) and single-token decode only agree when each row's result is independent of
    the call's other rows: PackedLinear runs one-row calls as two rows (oneDNN's one-row kernel
    rounds differently), and row_stable=True (for a target whose greedy speculative output must
    equal its plain decoding) makes the attention row-stable too (layers.row_stable_attention).
    """
    from .. import kernels
    from .layers import MLP, Attention, RMSNorm
    small_rows = STABLE_ROWS if row_stable else SMALL_ROWS
    cpu = next(model.parameters()).device.type == "cpu"
    fused = kernels.fused_ops() if cpu else None
    if row_stable and fused is None and hasattr(model, "kv_dtype"):
        model.kv_dtype = torch.float64           # row-stable attention reads fp64 without a copy
    for module in list(model.modules()):
        if isinstance(module, RMSNorm) and fused is not None:
            module.fused = fused[0]
        if isinstance(module, Attention):
            module.row_stable = row_stable
            module.fused = fused[1] if fused is not None else None
            module.fused_rows = small_rows
            module.fused_rope = kernels.rope_qkv() if cpu else None
        if isinstance(module, Attention) and isinstance(module.q_proj, nn.Linear):
            module.qkv = _cat_linear(module.q_proj, module.k_proj, module.v_proj,
                                     weight_dtype=weight_dtype, small_rows=small_rows)
            module.o_proj = PackedLinear(module.o_proj.weight, module.o_proj.bias, weight_dtype, small_rows)
            del module.q_proj, module.k_proj, module.v_proj
        elif isinstance(module, MLP) and isinstance(module.gate_proj, nn.Linear):
            module.gate_up = _cat_linear(module.gate_proj, module.up_proj, weight_dtype=weight_dtype,
                                         small_rows=small_rows)
            module.down_proj = PackedLinear(module.down_proj.weight, None, weight_dtype, small_rows)
            del module.gate_proj, module.up_proj
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, PackedLinear(child.weight, child.bias, weight_dtype, small_rows))
    from ..draft.model import Eagle3Layer
    from .llama import DecoderLayer
    for module in model.modules():
        if isinstance(module, (DecoderLayer, Eagle3Layer)):
            fuse_layer(module, kernels.decoder_layer() if cpu else None)
    return model


def fuse_layer(layer: nn.Module, kernel) -> None:
    """Give a decoder layer (target, or an EAGLE-3 midlayer) `fused`: the kernels' one-call layer,
    bit for bit the modules' path (tests/test_kernels.py), for blocks every linear sends to the
    small-M kernel. Layers the kernel does not cover (q/k norms, no kernels) keep the modules."""
    attn, mlp = layer.self_attn, layer.mlp
    linears = [getattr(attn, "qkv", None), attn.o_proj, getattr(mlp, "gate_up", None), mlp.down_proj]
    if (kernel is None or attn.q_norm is not None or attn.fused is None or attn.fused_rope is None
            or not all(isinstance(l, PackedLinear) and l.small is not None for l in linears)
            or len({l.weight_dtype for l in linears}) != 1 or layer.input_layernorm.fused is None
            or mlp.gate_up.bias is not None or mlp.down_proj.bias is not None):
        return
    qkv, o, gate_up, down = linears
    bf16 = qkv.weight_dtype == torch.bfloat16
    norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm

    def fused(h, x_in, cos, sin, k_buf, v_buf, start, mask):
        return kernel(h, x_in, norm1.weight, qkv.small_weight, qkv.bias, o.small_weight, o.bias,
                      norm2.weight, gate_up.small_weight, down.small_weight, cos, sin, k_buf, v_buf,
                      start, mask, norm1.eps, norm2.eps, attn.num_heads, attn.num_kv_heads,
                      down.in_features, bf16)

    layer.fused = fused
    layer.fused_rows = min(l.small_rows for l in linears)
