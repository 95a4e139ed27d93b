"""InferenceTarget: a Llama-family target rebuilt once for fast decoding (the inference layout).

models.llama.LlamaModel stays the reference and training model; `build_target(model, ...)` reads its
weights into this separate object (fused projections in PackedLinears, one FastLayer per decoder
layer, a backend chosen once: runtime.backend) and never modifies the model. Same forward contract as
LlamaModel (models.target.Target), so the decoders take either.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..errors import InputError
from ..models.config import ModelConfig, check_capture_ids
from ..models.kv_cache import KVCache, SlotCache, SlotRows
from ..models.layers import causal_block_mask
from ..models.llama import ForwardOutput, LlamaModel, as_block, rows_of
from .backend import Backend, choose_backend
from .layer import KERNEL_KV, FastLayer, norm_of
from .linear import PackedLinear
from .quant import GgufWeights, check_codes


class InferenceTarget:
    def __init__(self, model: LlamaModel, backend: Backend, gguf: Optional[GgufWeights] = None,
                 kv_cache_dtype: str = "auto"):
        self.config: ModelConfig = model.config
        self.backend = backend
        codes = gguf.codes if gguf is not None and backend.kernels is not None else {}
        # the GGUF types the linears run (the unpacked codes are not kept: the packed linears hold them)
        self.gguf: Optional[list[str]] = sorted({qc.ggml_type for qc in codes.values()}) if codes else None
        self.embed_tokens = model.embed_tokens          # shared, read only (a lookup)
        self.cos, self.sin = model.rotary.cos, model.rotary.sin
        self.layers = [FastLayer(l.self_attn, l.mlp, l.input_layernorm, l.post_attention_layernorm, backend,
                                 _layer_codes(codes, i))
                       for i, l in enumerate(model.layers)]
        self.norm = norm_of(model.norm)
        head = codes.get("lm_head.weight")
        self.lm_head = PackedLinear(model.lm_head.weight, None, backend, [head] if head is not None else None)
        self.kv_dtype = kv_dtype_for(kv_cache_dtype, backend, self.linears)
        self.stack = self._layer_stack()

    def _layer_stack(self):
        """csrc/kernels.h LayerStack: a block of one sequence (up to kernel_rows rows) through every
        layer in one parallel region, where each layer runs on the one-call path with one-digit GGUF
        codes (else None)."""
        calls = [layer.one_call for layer in self.layers]
        if self.backend.kernels is None or not calls or any(c is None for c in calls):
            return None
        stack = self.backend.kernels.LayerStack(calls, self.config.hidden_size, self.config.head_dim)
        return stack if stack.applies else None

    def _stack_takes(self, rows: int, cache) -> bool:
        """Whether a forward of `rows` rows over `cache` runs in the LayerStack's one region."""
        return self.stack is not None and rows <= self.backend.kernel_rows and cache.k.dtype in KERNEL_KV

    @property
    def device(self) -> torch.device:
        return self.backend.device

    @property
    def weights_name(self) -> str:
        """What the linears run: "gguf:<types>" on the file's codes (", int8 inputs" where they meet
        inputs rounded to one byte, ", int8 dot" where 4-bit codes run on exact integer digits),
        else the weight dtype (", amx" where bf16 runs on AMX tiles)."""
        types = sorted({t for l in self.linears for t in l.quant_types})
        if not types:
            return str(self.backend.weight_dtype) + (", amx" if any(l.amx for l in self.linears) else "")
        if any(l.one_digit for l in self.linears):
            return "gguf:" + "+".join(types) + ", int8 inputs"
        return "gguf:" + "+".join(types) + (", int8 dot" if any(l.integer_dots for l in self.linears) else "")

    @property
    def linears(self) -> list[PackedLinear]:
        return [l for layer in self.layers for l in layer.linears] + [self.lm_head]

    def new_cache(self, max_len: int, batch: int = 1) -> KVCache:
        cfg = self.config
        return KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, max_len, batch,
                       self.kv_dtype, self.device)

    def new_slot_cache(self, max_len: int, slots: int) -> SlotCache:
        cfg = self.config
        return SlotCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, max_len, slots,
                         self.kv_dtype, self.device)

    def check_capture_ids(self, capture_ids: Sequence[int]) -> None:
        check_capture_ids(capture_ids, self.config.num_layers, self.config.default_aux_layer_ids)

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [B, T] -> cos, sin [B, 1, T, D]
        if positions.device.type == "cpu" and int(positions.max()) >= self.cos.shape[0]:
            raise IndexError(f"position {int(positions.max())} >= rotary table size {self.cos.shape[0]}")
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                 attn_mask: Optional[torch.Tensor] = None,
                 logits_rows: Optional[torch.Tensor | slice] = None,
                 capture_ids: Sequence[int] = ()) -> ForwardOutput:
        """As LlamaModel.forward: a block [B, T] appended at cache.length, with feature capture.
        A causal block longer than the kernels serve row-stably (a long prompt's prefill) runs in
        pieces of `prefill_rows`, its logits too: every row then takes the kernels' path and gets
        the bits it would get decoded alone, and a piece's activations stay in cache (a long
        prompt prefills no slower than in one piece on oneDNN's linears)."""
        input_ids, positions = as_block(input_ids, positions)
        seq = input_ids.shape[1]
        cache.check_room(seq)
        capture = set(capture_ids)
        if capture:
            self.check_capture_ids(capture_ids)
        piece = self.prefill_rows if attn_mask is None else seq
        hs, feats = [], []
        for s in range(0, seq, piece):
            h, f = self._block(input_ids[:, s:s + piece], positions[:, s:s + piece], cache, attn_mask, capture)
            hs.append(h)
            feats.append(f)
        hidden = self.backend.rms_norm(_joined(hs, 1), *self.norm)
        wanted = rows_of(hidden, logits_rows)
        logits = None
        if wanted is not None:
            logits = _joined([self.lm_head(wanted[:, s:s + piece])
                              for s in range(0, max(wanted.shape[1], 1), piece)], 1)
        aux = _joined([torch.cat(f, dim=-1) for f in feats], 1) if capture else None
        return ForwardOutput(logits, hidden, aux)

    forward = __call__

    @property
    def prefill_rows(self) -> int:
        """The longest causal block run in one piece: the kernels' row-stable limit where they
        serve every row (row-stable layouts), else any length (oneDNN takes large blocks)."""
        rows = self.backend.kernel_rows
        return rows if self.backend.row_stable and rows else 1 << 62

    def _block(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
               attn_mask: Optional[torch.Tensor], capture: set) -> tuple[torch.Tensor, list]:
        """The layers over one block appended at cache.length: (last hidden, captured inputs)."""
        seq = input_ids.shape[1]
        start = cache.length
        if attn_mask is None and seq > 1:
            attn_mask = causal_block_mask(start, seq, input_ids.device)
        attn_mask = self.backend.prepare_mask(attn_mask)
        cos, sin = self.rotary(positions)
        h = self.embed_tokens(input_ids)
        if self._stack_takes(seq, cache) and cache.k.shape[1] == 1:
            # a block of one sequence (a decode step, a verify block): every layer in one C++ call
            # and one parallel region
            h, aux = self.stack.decode(h.contiguous(), cos.contiguous(), sin.contiguous(), cache.k, cache.v,
                                       start, None if attn_mask is None else attn_mask.contiguous(), sorted(capture))
            cache.advance(seq)
            return h, [aux] if capture else []
        feats = []
        for i, layer in enumerate(self.layers):
            if i in capture:
                feats.append(h)
            k_buf, v_buf = cache.layer(i)
            h = layer(h, None, cos, sin, k_buf, v_buf, start, attn_mask)
        cache.advance(seq)
        return h, feats

    @torch.inference_mode()
    def forward_rows(self, input_ids: torch.Tensor, rows: SlotRows, cache: SlotCache,
                     logit_rows: Optional[torch.Tensor] = None, capture_ids: Sequence[int] = ()):
        """Continuous batching: the rows of several sequences in one forward, each block appended
        at its own slot's length (`cache.plan`), every linear called once over all rows. Returns
        the logits of each block's last row [num_blocks, V], or of `logit_rows` (indices into the
        forward's rows: a checked chain's every row); on a row-stable layout each equals its
        sequence's own forward bit for bit. With capture_ids: (logits, aux), aux [N, k*H] the
        inputs of those layers at every row, as __call__ captures them (a draft's features)."""
        # input_ids [N] in the order of rows.blocks
        if input_ids.numel() != rows.num_rows:
            raise ValueError(f"input_ids has {input_ids.numel()} tokens, rows plan {rows.num_rows}")
        capture = set(capture_ids)
        if capture:
            self.check_capture_ids(capture_ids)
        cos, sin = self.rotary(rows.positions.view(1, -1))
        h = self.embed_tokens(input_ids.view(1, -1).to(self.device))
        feats = []
        one = rows.blocks[0] if len(rows.blocks) == 1 else None   # its slot runs as a plain cache
        if one is not None:           # its own mask over the slot's keys: a tree's, or causal
            mask = self.backend.prepare_mask(
                rows.mask[..., :one.start + one.rows].contiguous() if rows.mask is not None else
                None if one.rows == 1 else causal_block_mask(one.start, one.rows, h.device))
        if self._stack_takes(rows.num_rows, cache):
            # every layer in one C++ call and one parallel region: a block of one slot as a single
            # sequence's, rows of several slots each at its own
            c, s = cos.contiguous(), sin.contiguous()
            if one is not None:
                h, aux = self.stack.decode(h.contiguous(), c, s, cache.k[:, one.slot:one.slot + 1],
                                           cache.v[:, one.slot:one.slot + 1], one.start,
                                           None if mask is None else mask.contiguous(), sorted(capture))
            else:
                h, aux = self.stack.decode(h.contiguous(), c, s, cache.k, cache.v, 0,
                                           None if rows.mask is None else rows.mask.contiguous(), sorted(capture),
                                           rows.slot, rows.index, rows.keys)
            feats = [aux] if capture else []
        else:
            for i, layer in enumerate(self.layers):
                if i in capture:
                    feats.append(h)
                k_buf, v_buf = cache.layer(i)
                if one is not None:   # a batch of one decodes as fast as the single-sequence engine
                    h = layer(h, None, cos, sin, k_buf[one.slot:one.slot + 1], v_buf[one.slot:one.slot + 1],
                              one.start, mask)
                else:
                    h = layer.forward_rows(h, cos, sin, k_buf, v_buf, rows)
        cache.commit(rows)
        last = h[0, (rows.last if logit_rows is None else logit_rows).to(self.device)]
        logits = self.lm_head(self.backend.rms_norm(last, *self.norm))
        return (logits, torch.cat(feats, dim=-1)[0]) if capture else logits


def build_target(model: LlamaModel, weight_dtype: torch.dtype = torch.float32,
                 row_stable: bool = False, backend: Optional[Backend] = None,
                 gguf: Optional[GgufWeights] = None, kv_cache_dtype: str = "auto") -> InferenceTarget:
    """The inference layout of `model` (which is left as it is). weight_dtype=bf16 stores the GEMM
    weights in bf16 (activations stay fp32); row_stable=True makes every op compute a row in one
    fixed order whatever the block, so verify == one-token decode bit for bit (runtime.backend).
    gguf: the integer codes of the file the model was dequantised from (runtime.quant), checked
    against the model's weights; the kernels then run them (fp32 weights serve without kernels).
    kv_cache_dtype: "auto", "fp16" or "fp32" (kv_dtype_for)."""
    device = model.embed_tokens.weight.device
    if gguf is not None:
        check_codes(gguf, dict(model.named_parameters(remove_duplicate=False)))
    return InferenceTarget(model, backend or choose_backend(device, weight_dtype, row_stable), gguf,
                           kv_cache_dtype)


def kv_dtype_for(choice: str, backend: Backend, linears: Sequence[PackedLinear]) -> torch.dtype:
    """The KV cache's elements. "auto": fp16 where the linears meet inputs rounded to one byte on
    the kernels (the GGUF fast path; llama.cpp's default cache type beside its 8-bit activations:
    half the bytes attention reads), else the backend's. "fp32": the backend's (fp32, or fp64 where
    the row-stable fallback attends in fp64). "fp16": fp16 (the kernels read it widened to fp32;
    without them torch widens it)."""
    if choice == "fp16" or (choice == "auto" and backend.kernels is not None
                            and any(l.one_digit for l in linears)):
        return torch.float16
    if choice not in ("auto", "fp32"):
        raise InputError(f"kv_cache_dtype={choice!r}: choose auto, fp16 or fp32")
    return backend.kv_dtype


def _joined(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The pieces of a block joined along `dim` (one piece: itself, no copy on the decode path)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _layer_codes(codes: dict, index: int) -> dict:
    prefix = f"layers.{index}."
    return {k[len(prefix):]: v for k, v in codes.items() if k.startswith(prefix)}
