"""Training-time test (TTT): the draft unrolled for `num_steps` steps, SpecForge conventions.

Alignment (per sample, right padded): ids and teacher are shifted left by one (last row: token 0 and
an all-zero logit row); features and loss mask are not shifted; the last loss-mask row is zeroed.
Row i pairs the feature of token i with the embedding of token i+1 and learns the target's
distribution for token i+2, gated by loss_mask[i].

Step k (0-based), row i:
    ids[i+k], teacher[i+k], position mask and loss mask at i+k (zero past the end)
    hidden = fc(aux[i]) at k = 0, else the previous step's pre-norm output at row i (not detached)
    RoPE position i+k; keys are cached after RoPE
    keys: step-0 keys at rows j <= i (valid only)  +  the key at row i of every step s = 1..k
Loss_k = sum_i pmask_k[i] * CE(softmax_Vd(teacher[i+k]), draft[i]) / (B*T);  total = sum_k w^k loss_k
pmask = t2d[teacher argmax over V] & loss_mask. Accuracy_k counts over loss_mask_k rows.
The per-row CE is the default objective ("kl"); objectives.py holds the others (lk, hass, griffin).
griffin also drops row i at step k once step j < k scored row i and its top-K missed ids[i+j+1],
the token step j+1 is fed. Accuracy is the same for every objective.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
from torch import nn

from ..models.layers import apply_rotary
from ..draft.model import Eagle3Draft
from .features import Batch
from .objectives import ObjectiveConfig, aligned, row_loss


@dataclass(frozen=True)
class TTTConfig:
    num_steps: int = 7
    step_decay: float = 0.8
    feature_noise: float = 0.0    # training only: aux + noise * RMS(aux row) * N(0, 1)
    objective: ObjectiveConfig = ObjectiveConfig()


class Aligned(NamedTuple):
    ids: torch.Tensor             # [B, T] token i+1 at row i (0 past the end)
    aux: torch.Tensor             # [B, T, k*Ht] feature of token i at row i
    teacher_hidden: torch.Tensor  # [B, T, Ht] target final hidden of token i+1 (0 past the end)
    teacher_argmax: torch.Tensor  # [B, T] target argmax over V for token i+2
    loss_mask: torch.Tensor       # [B, T] bool
    valid: torch.Tensor           # [B, T] bool


class StepStats(NamedTuple):
    loss: torch.Tensor            # [] weighted total (already divided by the denominator)
    step_loss: torch.Tensor       # [num_steps] unweighted per-step losses (detached)
    correct: torch.Tensor         # [num_steps] correct predictions over loss-masked rows
    counted: torch.Tensor         # [num_steps] loss-masked rows


def shift_left(x: torch.Tensor, k: int) -> torch.Tensor:
    # x [B, T, ...] -> row i holds x[i+k]; zero past the end
    if k == 0:
        return x
    out = torch.zeros_like(x)
    out[:, :-k] = x[:, k:]
    return out


def align(batch: Batch) -> Aligned:
    """Apply the SpecForge alignment to a right-padded batch."""
    lengths = batch.valid.sum(1)                                    # [B]
    loss_mask = batch.loss_mask & batch.valid
    rows = torch.arange(batch.ids.shape[1])
    loss_mask = loss_mask & (rows[None, :] != (lengths - 1)[:, None])   # zero each sample's last row
    return Aligned(shift_left(batch.ids, 1), batch.aux, shift_left(batch.hidden, 1),
                   shift_left(batch.next_ids, 1), loss_mask, batch.valid)


def expand_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    # [B, kv_heads, T, D] -> [B, heads, T, D]
    return x.repeat_interleave(num_heads // x.shape[1], dim=1)


class TTTModel(nn.Module):
    """Wraps an Eagle3Draft (its weights) and computes the unrolled TTT loss; DDP wraps this."""

    def __init__(self, draft: Eagle3Draft, teacher_head: torch.Tensor, cfg: TTTConfig = TTTConfig()):
        super().__init__()
        self.draft, self.cfg = draft, cfg
        self.fc_update_scale: Optional[torch.Tensor] = None   # [k*Ht] per-column AdamW update factor
        used = draft.d2t + torch.arange(draft.d2t.numel())
        # target lm_head rows of the draft vocabulary [Vd, Ht] (frozen teacher)
        self.register_buffer("teacher_head", teacher_head[used].detach().clone(), persistent=False)

    # ------------------------------------------------------------------ attention of one step
    def qkv(self, x: torch.Tensor, positions: torch.Tensor, attn):
        # x [B, T, 2H] (midlayer) or [B, T, H] -> q [B, heads, T, D], k/v [B, kv_heads, T, D] (q, k after RoPE)
        bsz, seq, _ = x.shape
        q = attn.q_proj(x).view(bsz, seq, attn.num_heads, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(bsz, seq, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(bsz, seq, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        cos, sin = self.draft.rotary(positions)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def attend(self, q, keys0, vals0, extra_k, extra_v, mask0) -> torch.Tensor:
        # q [B, h, T, D]; keys0/vals0 [B, h, T, D] step-0; extra_* lists of [B, h, T, D] (same row)
        scale = 1.0 / math.sqrt(q.shape[-1])
        s0 = (q @ keys0.transpose(-1, -2)) * scale                  # [B, h, T, T]
        s0 = s0.masked_fill(~mask0, float("-inf"))
        diag = [(q * k).sum(-1, keepdim=True) * scale for k in extra_k]   # each [B, h, T, 1]
        probs = torch.softmax(torch.cat([s0] + diag, dim=-1), dim=-1)
        seq = keys0.shape[2]
        out = probs[..., :seq] @ vals0
        for s, v in enumerate(extra_v):
            out = out + probs[..., seq + s:seq + s + 1] * v
        return out                                                  # [B, h, T, D]

    def step(self, h: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor, kv: list,
             mask0: torch.Tensor) -> torch.Tensor:
        """One unrolled step: h [B, T, H] in -> pre-norm output [B, T, H]; appends this step's K, V
        (kv: one list of steps per draft layer)."""
        layer = self.draft.midlayer
        x = layer.attn_input(self.draft.embed_tokens(ids), h)
        h = self.layer_step(layer, h, x, positions, kv[0], mask0)
        for i, extra in enumerate(self.draft.extra_layers):          # num_layers > 1
            h = self.layer_step(extra, h, extra.input_layernorm(h), positions, kv[i + 1], mask0)
        return h

    def layer_step(self, layer, h, x, positions, kv: list, mask0) -> torch.Tensor:
        heads = layer.self_attn.num_heads
        q, k, v = self.qkv(x, positions, layer.self_attn)
        kv.append((expand_kv(k, heads), expand_kv(v, heads)))
        (k0, v0), extra = kv[0], kv[1:]
        out = self.attend(q, k0, v0, [e[0] for e in extra], [e[1] for e in extra], mask0)
        bsz, seq, _ = h.shape
        h = h + layer.self_attn.o_proj(out.transpose(1, 2).reshape(bsz, seq, -1))
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def unroll(self, a: Aligned) -> list[torch.Tensor]:
        """Pre-norm outputs of every step: list of [B, T, H]."""
        bsz, seq = a.ids.shape
        causal = torch.ones(seq, seq, dtype=torch.bool, device=a.ids.device).tril()
        mask0 = (causal[None] & a.valid[:, None, :])[:, None]           # [B, 1, T, T]
        h, kv, outs = self.draft.fuse(self.noisy(a.aux)), [[] for _ in range(self.draft.config.num_layers)], []
        for k in range(self.cfg.num_steps):
            positions = (torch.arange(seq, device=a.ids.device) + k)[None].expand(bsz, seq)
            out = self.step(h, shift_left(a.ids, k), positions, kv, mask0)
            outs.append(out)
            h = self.draft.feedback(out)              # norm_output: the post-norm hidden goes on
        return outs

    def noisy(self, aux: torch.Tensor) -> torch.Tensor:
        """Feature noise (training only), relative to each row's RMS: the targets' residual streams
        differ in scale by orders of magnitude between dims and tokens, so an absolute std would be
        lost on some rows and swamp others. Drawn from the global RNG (checkpointed)."""
        if not self.training or self.cfg.feature_noise <= 0:
            return aux
        rms = aux.pow(2).mean(-1, keepdim=True).sqrt()
        return aux + self.cfg.feature_noise * rms * torch.randn_like(aux)

    # ------------------------------------------------------------------ loss
    def forward(self, batch: Batch, denominator: Optional[float] = None) -> StepStats:
        a = align(batch)
        denom = denominator or float(a.ids.numel())
        with torch.no_grad():
            teacher_logp = torch.log_softmax(a.teacher_hidden @ self.teacher_head.T, dim=-1)  # [B, T, Vd]
            pmask = self.draft.t2d[a.teacher_argmax] & a.loss_mask
        obj = self.cfg.objective
        alive = torch.ones_like(a.loss_mask)                            # [B, T] griffin: chain still aligned
        losses, correct, counted = [], [], []
        for k, h in enumerate(self.unroll(a)):
            b, i = shift_left(a.loss_mask, k).nonzero(as_tuple=True)   # rows whose token i+k is scored
            logits = self.draft.lm_head(self.draft.norm(h[b, i]))       # [N, Vd]
            logp = torch.log_softmax(logits.float(), -1)
            weight = pmask[b, i + k] & alive[b, i]
            loss = row_loss(obj, teacher_logp[b, i + k], logp, weight.float())
            losses.append((loss * weight).sum() / denom)
            if obj.name == "griffin" and k + 1 < self.cfg.num_steps:
                fed = shift_left(a.ids, k + 1)[b, i]                    # the token step k+1 embeds
                alive[b, i] &= aligned(logp, self.draft.to_target_ids, fed, obj.griffin_topk)
            with torch.no_grad():
                pred = self.draft.to_target_ids(logp.argmax(-1))       # fp32: argmax on bf16 is slow
                correct.append((pred == a.teacher_argmax[b, i + k]).sum())
                counted.append(torch.tensor(len(pred)))
        weights = torch.tensor([self.cfg.step_decay ** k for k in range(len(losses))])
        step_loss = torch.stack(losses)
        return StepStats((weights * step_loss).sum(), step_loss.detach(), torch.stack(correct),
                         torch.stack(counted))
