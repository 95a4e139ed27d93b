"""InferenceDraft: an EAGLE-3 or EAGLE-1/2 draft rebuilt once for fast drafting (the inference layout).

The draft modules (draft.model) train and stay the reference; `build_draft_layout(draft, ...)` reads
their weights into this object (fc, lm_head and the layer's projections in PackedLinears, the layer as
a runtime FastLayer on a backend chosen once) and leaves the module as it is. Same call contract as
DraftBase.forward, and the same feature-width contract, checked on every call by the module's own
check_features.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .. import kernels
from ..errors import InputError
from ..models.kv_cache import KVCache, SlotCache, SlotRows
from ..models.llama import as_block, rows_of
from ..runtime.backend import Backend, choose_backend
from ..runtime.layer import FastLayer, norm_of
from ..runtime.linear import PackedLinear
from ..runtime.quant import quantize_q4
from .model import DraftBase, DraftConfig, DraftOutput, Eagle3Draft, block_mask

# A q4 draft's blocks of up to this many rows run the codes, larger ones the bf16 weights: the
# one-byte integer dots beat bf16 on AMX at a few rows and draw level by 12 (SmolLM2's draft
# forward, docs/kernels.md), where each block's float steps outweigh the bytes
Q4_ROWS = 12


class InferenceDraft:
    def __init__(self, draft: DraftBase, backend: Backend, quantize: bool = False):
        # quantize: every linear as 4-bit codes with one-byte inputs (runtime.quant.quantize_q4;
        # `--draft-weights q4`), blocks past the backend's kernel rows on the weight dtype
        self.reference = draft                         # config, vocabulary maps, contract checks
        self.config: DraftConfig = draft.config
        self.backend = backend
        self.quantized = quantize
        q4 = (lambda w: [quantize_q4(w)]) if quantize else (lambda w: None)
        layer_codes = _q4_codes if quantize else (lambda layer: None)
        self.embed_tokens = draft.embed_tokens
        self.cos, self.sin = draft.rotary.cos, draft.rotary.sin
        self.eagle3 = isinstance(draft, Eagle3Draft)
        fc_bias = None if self.eagle3 else draft.fc.bias
        self.fc = PackedLinear(draft.fc.weight, fc_bias, backend, q4(draft.fc.weight))
        self.lm_head = PackedLinear(draft.lm_head.weight, None, backend, q4(draft.lm_head.weight))
        if self.eagle3:
            mid = draft.midlayer
            self.input_norm, self.hidden_norm = norm_of(mid.input_layernorm), norm_of(mid.hidden_norm)
            self.norm = norm_of(draft.norm)
            self.pre_fc_norm = norm_of(draft.pre_fc_norm) if draft.pre_fc_norm is not None else None
            self.layer = FastLayer(mid.self_attn, mid.mlp, None, mid.post_attention_layernorm, backend,
                                   layer_codes(mid))
            self.extra = [FastLayer(l.self_attn, l.mlp, l.input_layernorm, l.post_attention_layernorm, backend,
                                    layer_codes(l)) for l in draft.extra_layers]
        else:
            layer = draft.layers[0]
            self.layer = FastLayer(layer.self_attn, layer.mlp, None, layer.post_attention_layernorm, backend,
                                   layer_codes(layer))
            self.extra = []

    @property
    def device(self) -> torch.device:
        return self.backend.device

    @property
    def weights_name(self) -> str:
        """What the linears run: "q4" (4-bit codes, one-byte inputs) or the weight dtype."""
        return "q4" if self.quantized else str(self.backend.weight_dtype)

    @property
    def linears(self) -> list[PackedLinear]:
        return [self.fc, *self.layer.linears, *(l for x in self.extra for l in x.linears), self.lm_head]

    def new_cache(self, max_len: int, batch: int = 1) -> KVCache:
        cfg = self.config
        return KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, max_len, batch, torch.float32, self.device)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.reference.to_target_ids(draft_ids)

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache, *,
                 features: Optional[torch.Tensor] = None, hidden: Optional[torch.Tensor] = None,
                 attn_mask: Optional[torch.Tensor] = None,
                 logits_rows: Optional[torch.Tensor | slice] = None) -> DraftOutput:
        """As DraftBase.forward: one draft forward over a block [B, T], KV appended at cache.length."""
        input_ids, positions = as_block(input_ids, positions)
        seq = input_ids.shape[1]
        self.reference.check_inputs(features, hidden)
        h = hidden if features is None else (self.fuse(features) if self.eagle3 else features)
        cache.check_room(seq)
        mask = block_mask(cache, seq, attn_mask, input_ids.device)
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        k_buf, v_buf = cache.layer(0)
        emb = self.embed_tokens(input_ids)
        if self.eagle3:
            rms = self.backend.rms_norm
            x_in = torch.cat([rms(emb, *self.input_norm), rms(h, *self.hidden_norm)], dim=-1)
            out = self.layer(h, x_in, cos, sin, k_buf, v_buf, cache.length, mask)
            for i, layer in enumerate(self.extra):
                out = layer(out, None, cos, sin, *cache.layer(i + 1), cache.length, mask)
        else:
            out = self.layer(self.fc(torch.cat([emb, h], dim=-1)), None, cos, sin, k_buf, v_buf,
                             cache.length, mask)
        cache.advance(seq)
        if self.eagle3 and self.config.norm_output:
            return DraftOutput(self._logits(out, logits_rows), self.backend.rms_norm(out, *self.norm))
        return DraftOutput(self._logits(out, logits_rows), out)

    @torch.inference_mode()
    def forward_rows(self, input_ids: torch.Tensor, rows: SlotRows, cache: SlotCache, *,
                     features: Optional[torch.Tensor] = None, hidden: Optional[torch.Tensor] = None,
                     logit_rows: Optional[torch.Tensor] = None) -> DraftOutput:
        """The drafts of several sequences in one forward (an EAGLE-3 draft inside the batch), each
        block appended at its own slot's length, every linear called once over all rows:
        input_ids [N] in the order of rows.blocks (rows.positions: each row's rotary position),
        features [N, F] or hidden [N, H]. -> DraftOutput(logits of each block's last row, or of
        `logit_rows` [n, V]; the hidden handed to the next step [N, H])."""
        if not self.eagle3:
            raise InputError("drafting several sequences in one forward takes an EAGLE-3 draft")
        if input_ids.numel() != rows.num_rows:
            raise ValueError(f"input_ids has {input_ids.numel()} tokens, rows plan {rows.num_rows}")
        self.reference.check_inputs(features, hidden)
        n = rows.num_rows
        h = (self.fuse(features) if features is not None else hidden).reshape(1, n, -1)
        cos, sin = self.cos[rows.positions].view(1, 1, n, -1), self.sin[rows.positions].view(1, 1, n, -1)
        rms = self.backend.rms_norm
        emb = self.embed_tokens(input_ids.view(1, -1))
        x_in = torch.cat([rms(emb, *self.input_norm), rms(h, *self.hidden_norm)], dim=-1)
        out = self.layer.forward_rows(h, cos, sin, *cache.layer(0), rows, x_in=x_in)
        for i, layer in enumerate(self.extra):
            out = layer.forward_rows(out, cos, sin, *cache.layer(i + 1), rows)
        cache.commit(rows)
        last = out[0, rows.last if logit_rows is None else logit_rows]
        feedback = rms(out[0], *self.norm) if self.config.norm_output else out[0]
        return DraftOutput(self.lm_head(rms(last, *self.norm)), feedback)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        if self.pre_fc_norm is not None:
            features = self.backend.rms_norm(features, *self.pre_fc_norm)
        return self.fc(features)

    def _logits(self, h: torch.Tensor, logits_rows) -> Optional[torch.Tensor]:
        h = rows_of(h, logits_rows)
        if h is None:
            return None
        if self.eagle3:
            h = self.backend.rms_norm(h, *self.norm)
        return self.lm_head(h)

    forward = __call__


def build_draft_layout(draft: DraftBase, weight_dtype: torch.dtype = torch.float32,
                       backend: Optional[Backend] = None, quantize: bool = False) -> InferenceDraft:
    """The inference layout of `draft` (left as it is): GEMM weights in `weight_dtype`. quantize:
    the linears as 4-bit codes on the kernels, with bf16 for blocks past Q4_ROWS rows (its small-M
    kernel up to backend.SMALL_ROWS, oneDNN past it: a catch-up after a long suffix-only stretch,
    a prompt); with fp32 the codes serve every block the kernels take."""
    device = draft.embed_tokens.weight.device
    why = q4_unavailable(draft) if quantize else None
    if why is not None:    # codes without the kernels' integer dots would run another path unsaid
        raise InputError(f"draft_weights=q4: {why}; use draft_weights=bf16 or fp32 (or auto)")
    backend = backend or choose_backend(device, weight_dtype)
    if quantize and weight_dtype == torch.bfloat16:
        backend = dataclasses.replace(backend, row_cap=Q4_ROWS)
    return InferenceDraft(draft, backend, quantize)


def q4_unavailable(draft: Optional[torch.nn.Module] = None) -> Optional[str]:
    """Why a draft cannot run as q4 here (None: it can): the kernels, their integer dot products
    (AVX512-VNNI), and input widths in blocks of 32."""
    if kernels.quant_linear() is None:
        return f"the eagle3 kernels are not available ({kernels.why()})"
    if not kernels.integer_dots():
        return ("the kernels run no integer dot products here (no AVX512-VNNI, or EAGLE3_VNNI=0), "
                "which q4 drafts run on")
    widths = sorted({m.in_features for m in draft.modules() if isinstance(m, torch.nn.Linear)}) if draft else []
    odd = [w for w in widths if w % 32]
    if odd:
        return f"the draft has linears of input width {odd[0]}, not a multiple of the 32-input blocks"
    return None


def _q4_codes(layer: torch.nn.Module) -> dict:
    """A decoder layer's projections as q4 codes by weight name ("self_attn.q_proj.weight")."""
    return {name: quantize_q4(p) for name, p in layer.named_parameters() if name.endswith("_proj.weight")}
