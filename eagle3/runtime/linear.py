"""PackedLinear: y = x W^T + b with the weight stored once in each layout its backend calls.

On the SmolLM2 shapes (tools/bench_kernels.py; figures in docs/kernels.md) the eagle3 small-M
kernel beats oneDNN for small blocks and matches it near 32 rows, oneDNN with a prepacked weight
beats torch's x @ W.T from 2 rows on, and torch's GEMV over an [in, out] weight is fine for one row
on one thread. Verify forwards have several rows, decode forwards one, so a PackedLinear keeps the
layouts its backend needs and picks by rows: blocks of up to `backend.kernel_rows` rows go to the
kernel (every row's result independent of the block: a row-stable target sends every verify block
there), the rest to oneDNN. bf16 weights take fp32 activations in and out.

With `codes` (a GGUF target under `--weights gguf`: runtime.quant), the small-M kernel runs the
file's own integer codes (csrc/linear_quant.cpp) and blocks past it take the fp32 weight, which is
the same model exactly (the dequantised file).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from .. import kernels
from .backend import SMALL_ROWS, Backend, onednn_available

PACK_ROWS_HINT = 8


class PackedLinear:
    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], backend: Backend,
                 codes: Optional[Sequence] = None):
        weight = weight.detach()
        self.out_features, self.in_features = weight.shape
        self.weight_dtype = backend.weight_dtype
        self.bias = None if bias is None else bias.detach().float().clone()
        self.torch_weight = weight if backend.name == "torch" else None
        self.small = None              # the small-M kernel, where this backend and dtype have one
        self.quant_types: tuple[str, ...] = ()
        self.integer_dots = False      # codes on integer dot products (csrc/linear_quant_vnni.cpp)
        self.amx = False               # bf16 on AMX tile multiplies (csrc/linear_amx.cpp run_amx)
        self.one_digit = False         # codes meet inputs rounded to one byte per block (byte_tile)
        if backend.kernels is not None and codes:
            self.small = kernels.quant_linear()
            vnni = kernels.integer_dots()
            # one-byte inputs where every part allows them (`--weights gguf`, a draft's quantize_q4)
            # and integer dots run; else integer dots on exact digits for the 4-bit codes only
            self.one_digit = vnni and all(c.int8_inputs for c in codes)
            self.integer_dots = self.one_digit or (vnni and any(c.kernel_part()[0] == 4 for c in codes))
            self.small_weight = kernels.pack_quant([c.kernel_part() for c in codes], self.integer_dots,
                                                   self.one_digit)
            self.quant_types = tuple(c.ggml_type for c in codes)
        elif backend.kernels is not None and (self.weight_dtype != torch.bfloat16 or self.in_features % 2 == 0):
            self.small, self.amx = self._dtype_kernel()
        self.small_rows = backend.kernel_rows if self.small is not None else 0
        self.small_dtype = torch.float32 if self.quant_types else self.weight_dtype   # codes take fp32
        # codes capped below SMALL_ROWS (a q4 draft's backend.row_cap): the blocks past the cap and
        # up to SMALL_ROWS take the weight dtype's small-M kernel (bf16 on AMX: at 16 rows a q4
        # draft forward is faster there than on oneDNN or on the codes)
        self.mid = None
        if self.quant_types and self.small_rows < SMALL_ROWS and self.weight_dtype == torch.bfloat16:
            kernel, _ = self._dtype_kernel()
            if kernel is not None:
                self.mid = (kernel, kernels.pack_weight(weight, self.weight_dtype))
        if not self.quant_types:
            self.small_weight = kernels.pack_weight(weight, self.weight_dtype) if self.small else None
        self.onednn = None
        if backend.name != "torch" and onednn_available():
            self.onednn = torch.ops.mkldnn._reorder_linear_weight(
                weight.contiguous().to(self.weight_dtype), PACK_ROWS_HINT)
        # [in, out] fp32 GEMV for one-row calls on one thread (and CPUs without oneDNN)
        self.weight_t = None
        small_on_onednn = self.small and self.onednn is not None
        if backend.name != "torch" and self.weight_dtype == torch.float32 and not small_on_onednn:
            self.weight_t = weight.t().contiguous()

    def _dtype_kernel(self):
        """The weight dtype's small-M kernel (None where it cannot run here) and whether it is bf16
        on AMX tiles (where the machine has them: fixed for this weight's life)."""
        amx = (self.weight_dtype == torch.bfloat16 and kernels.amx()
               and self.in_features % kernels.AMX_WIDTH == 0)
        return kernels.small_linear(self.weight_dtype, amx), amx

    @property
    def kernel_ready(self) -> bool:
        return self.small is not None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows <= self.small_rows:
            flat = x.reshape(rows, self.in_features).to(self.small_dtype).contiguous()
            y = self.small(flat, self.small_weight, self.bias, self.out_features)
            return y.view(*x.shape[:-1], self.out_features)
        if self.mid is not None and rows <= SMALL_ROWS:
            kernel, packed = self.mid
            y = kernel(x.reshape(rows, self.in_features).to(self.weight_dtype).contiguous(), packed, self.bias,
                       self.out_features)
            return y.view(*x.shape[:-1], self.out_features)
        if self.torch_weight is not None:
            return F.linear(x, self.torch_weight, self.bias)
        if self.weight_dtype != torch.float32:  # low-precision weights, fp32 activations in and out
            flat = x.reshape(rows, self.in_features).to(self.weight_dtype)
            if rows == 1:  # oneDNN's one-row kernel rounds differently: run it as two rows
                flat = torch.cat([flat, flat])
            y = torch.ops.mkldnn._linear_pointwise(flat, self.onednn, None, "none", [], "")[:rows].float()
            y = y if self.bias is None else y + self.bias
            return y.view(*x.shape[:-1], self.out_features)
        if self.onednn is None or (rows == 1 and torch.get_num_threads() == 1 and self.weight_t is not None):
            y = x @ self.weight_t
            return y if self.bias is None else y + self.bias
        flat = x.reshape(rows, self.in_features)
        y = torch.ops.mkldnn._linear_pointwise(flat, self.onednn, self.bias, "none", [], "")
        return y.view(*x.shape[:-1], self.out_features)

    def weight_bytes(self) -> int:
        """Bytes of weight one call reads (the layout a decode step uses)."""
        if self.quant_types:
            return self.small_weight.numel()
        return self.out_features * self.in_features * self.weight_dtype.itemsize


def fused_linear(weights: list[torch.Tensor], biases: list[Optional[torch.Tensor]],
                 backend: Backend, codes: Optional[Sequence] = None) -> PackedLinear:
    """One PackedLinear over concatenated outputs (q/k/v, gate/up); codes: one per part, or None."""
    bias = torch.cat(biases) if biases[0] is not None else None
    return PackedLinear(torch.cat(weights, dim=0), bias, backend, codes)
