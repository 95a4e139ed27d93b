"""The backend of an inference layout, chosen once when the layout is built.

| backend  | where                        | linear (small blocks / large)          | norm, rotary + cache write, attention                      | a decoder layer                          |
|----------|------------------------------|----------------------------------------|------------------------------------------------------------|------------------------------------------|
| `avx512` | CPUs with the eagle3 kernels | small-M kernel / oneDNN prepacked      | kernels (attention: kernel up to `kernel_rows` queries, or always when row-stable; SDPA for a plain prefill) | one C++ call for blocks <= `kernel_rows` |
| `onednn` | other CPUs (AVX2), or `EAGLE3_KERNELS=0` | oneDNN prepacked (fp32: [in, out] GEMV for one row on one thread) | torch; attention fp64 row-stable when row-stable, else SDPA | composite (one op at a time)            |
| `torch`  | CUDA and other devices       | `F.linear`                             | torch; SDPA                                                | composite                                |

`row_stable` (a bf16 target whose speculative output must equal its plain decoding bit for bit):
every op computes a row in one fixed order whatever the block, so a verify block's logits equal
one-token decode. On `avx512` the kernels are row-stable for blocks up to STABLE_ROWS (every verify
tree fits); on `onednn` attention runs in fp64 over an fp64 KV cache (row_stable_attention).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from .. import kernels

SMALL_ROWS = 32          # plain: the kernels serve blocks up to this many rows (faster than oneDNN
                         # at 1-32 rows on 2 threads, tools/bench_kernels.py)
STABLE_ROWS = 256        # row-stable: the kernels serve every block up to this many rows


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


@dataclass(frozen=True)
class Backend:
    name: str                          # avx512 | onednn | torch (the table above)
    device: torch.device
    weight_dtype: torch.dtype          # GEMM weights (activations stay fp32)
    row_stable: bool
    kernels: Optional[object] = None   # the built eagle3 kernels (avx512 only)
    one_call_layers: bool = True       # avx512: a decoder layer in one C++ call (False: op by op,
                                       # same bits; tests compare the two)
    fused_rope: bool = True            # avx512: rotary + cache write in one kernel (False: torch ops)
    row_cap: Optional[int] = None      # kernel_rows at most this (a q4 draft: draft.inference)

    @property
    def kernel_rows(self) -> int:
        """Blocks of up to this many rows go to the kernels (0 without them)."""
        if self.kernels is None:
            return 0
        rows = STABLE_ROWS if self.row_stable else SMALL_ROWS
        return rows if self.row_cap is None else min(rows, self.row_cap)

    @property
    def kv_dtype(self) -> torch.dtype:
        """fp64 where attention is fp64 row-stable (it then reads the cache without a copy)."""
        return torch.float64 if self.row_stable and self.kernels is None else torch.float32

    # ------------------------------------------------------------------ ops
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.rms_norm(x.contiguous(), weight, eps)
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a fused gate_up block [.., 2I] -> [.., I] (the kernels' own e^x, the
        same in the one-call layer, where they run; torch's silu elsewhere)."""
        if self.kernels is not None:
            return self.kernels.silu_mul(gate_up.contiguous())
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  mask: Optional[torch.Tensor]) -> torch.Tensor:
        """softmax(q k^T / sqrt(D)) v: q [B, H, T, D], k/v [B, Hkv, S, D] -> [B, H, T, D]."""
        if self.kernels is not None and (self.row_stable or q.shape[2] <= SMALL_ROWS):
            return self.kernels.attention(q.contiguous(), k, v, None if mask is None else mask.contiguous())
        if self.row_stable:
            return row_stable_attention(q, k, v, mask)
        if k.dtype != q.dtype:         # an fp16 cache: SDPA takes one dtype
            k, v = k.to(q.dtype), v.to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])

    def prepare_mask(self, mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Once per forward: fp64 row-stable attention takes an additive fp64 mask."""
        if mask is not None and self.kv_dtype == torch.float64 and mask.dtype == torch.bool:
            return additive_mask(mask)
        return mask


def choose_backend(device: torch.device | str, weight_dtype: torch.dtype = torch.float32,
                   row_stable: bool = False) -> Backend:
    """The fastest backend this machine has for these weights (see the table above)."""
    device = torch.device(device)
    if device.type != "cpu":
        if weight_dtype != torch.float32 or row_stable:
            raise ValueError(f"{weight_dtype} / row-stable weights are built for the CPU only")
        return Backend("torch", device, weight_dtype, row_stable)
    if weight_dtype != torch.float32 and not onednn_available():   # blocks past kernel_rows
        raise ValueError(f"{weight_dtype} weights need oneDNN on the CPU; use fp32 weights")
    built = kernels.state().module
    if built is not None:   # bf16 linears without AVX512-BF16 take oneDNN (PackedLinear.small is None)
        return Backend("avx512", device, weight_dtype, row_stable, built)
    return Backend("onednn", device, weight_dtype, row_stable)


def row_stable_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Attention whose result for a query row does not depend on the other rows of the call.

    q [B, H, T, D] fp32; k/v [B, Hkv, S, D] (fp64 caches skip a conversion); mask None, bool
    (True = may attend) or additive float, broadcastable to [B, 1, T, S]. SDPA's CPU kernels and
    fp32 GEMMs pick their blocking by the number of query rows, so a token's output in an 8-token
    verify block differs in the last bits from the same token decoded alone. Here scores, softmax
    and the weighted sum run in fp64 and round to fp32 once at the end: reordering a sum of fp64
    terms moves it by ~1e-16, which survives the rounding to fp32 with negligible probability.
    With bf16 GEMM weights (where any input bit flips a bf16 rounding and the difference grows
    layer by layer) this keeps verify and decode bit-identical. Costs ~2x SDPA's time.
    """
    b, h, t, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    g = h // hkv                                   # query heads per KV head (GQA): rows g*t
    qd = (q.double() * (1.0 / math.sqrt(d))).reshape(b, hkv, g * t, d)
    scores = torch.matmul(qd, k.double().transpose(-1, -2))                 # [B, Hkv, g*T, S]
    if mask is not None:
        if mask.dtype == torch.bool:
            mask = additive_mask(mask)
        # rows are (head in group, query): the [B|1, 1, T, S] mask broadcasts over both head axes
        scores.view(b, hkv, g, t, s).add_(mask.to(torch.float64).unsqueeze(2))
    out = torch.matmul(torch.softmax(scores, dim=-1), v.double())
    return out.view(b, h, t, d).float()


def additive_mask(mask: torch.Tensor) -> torch.Tensor:
    """bool (True = may attend) -> fp64 0 / -inf."""
    return torch.zeros(mask.shape, dtype=torch.float64, device=mask.device).masked_fill_(
        ~mask, float("-inf"))
