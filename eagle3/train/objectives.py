"""Per-row TTT training objectives: tensors in, tensors out (ttt.py applies masks and step weights).

p = the target's distribution over the draft vocabulary (the teacher, renormalised over Vd), q = the
draft's. alpha = sum_v min(p_v, q_v) is the acceptance rate of one sampled draft token under
speculative sampling (Leviathan et al.), so 1 - alpha is the total variation TV(p, q).

| objective | per-row loss | source |
|---|---|---|
| kl      | H(p, q) = -sum p log q (soft cross-entropy; KL + H(p), same gradient) | EAGLE-3 / SpecForge |
| lk      | lam * KL(p||q) + (1 - lam) * (1 - alpha), lam = exp(-eta * mean alpha), detached | LK losses (arXiv 2602.23881), the adaptive blend |
| hass    | H(p, q) + w * (-sum_{v in top-K(p)} p_v log q_v) | HASS: harmonized objective distillation |
| griffin | H(p, q), rows dropped at step k once an earlier step's top-K missed the fed token | GRIFFIN: token-alignable training |

Simplifications, by design:
- alpha is measured over the draft vocabulary with p renormalised there (the teacher the trainer
  already has); the real overlap also loses the target's mass outside Vd, a constant for the draft.
- lk: lam is one detached scalar per TTT step and batch (mean alpha over that step's scored rows),
  eta = 3: KL drives the cold start (alpha ~ 0, lam ~ 1), TV takes over as the overlap grows.
- hass: HASS's other half, harmonized context alignment (the draft sees its own earlier features
  while trained on later positions), is what EAGLE-3's training-time test unroll already does for
  every objective here; only the top-K distillation term is added.
- griffin: only its training strategy (the alignment mask); its draft-architecture changes are not
  part of this draft.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

OBJECTIVES = ("kl", "lk", "hass", "griffin")


@dataclass(frozen=True)
class ObjectiveConfig:
    name: str = "kl"
    lk_eta: float = 3.0           # lk: lam = exp(-eta * mean alpha)
    hass_topk: int = 10           # hass: the target's top-K tokens distilled again
    hass_weight: float = 1.0      # hass: weight of that term
    griffin_topk: int = 4         # griffin: a step is aligned when its top-K holds the fed token (tree top_k)

    def __post_init__(self):
        if self.name not in OBJECTIVES:
            raise ValueError(f"objective={self.name!r}: choose one of {', '.join(OBJECTIVES)}")


def soft_ce(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    # [N, Vd], [N, Vd] -> [N]
    return -torch.linalg.vecdot(p_log.exp(), q_log)


def kl(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    # [N, Vd], [N, Vd] -> [N]; KL(p || q) >= 0, 0 iff p == q
    return torch.linalg.vecdot(p_log.exp(), p_log - q_log)


def overlap(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    # [N, Vd], [N, Vd] -> [N]: alpha = sum_v min(p_v, q_v) in [0, 1]
    return torch.minimum(p_log, q_log).exp().sum(-1)


def lk_loss(p_log: torch.Tensor, q_log: torch.Tensor, weight: torch.Tensor, eta: float) -> torch.Tensor:
    """[N] LK loss per row; `weight` [N] (the rows that count) sets the detached blend weight."""
    alpha = overlap(p_log, q_log)
    with torch.no_grad():
        mean_alpha = (alpha * weight).sum() / weight.sum().clamp_min(1e-9)
        lam = torch.exp(-eta * mean_alpha)
    return lam * kl(p_log, q_log) + (1 - lam) * (1 - alpha)


def topk_ce(p_log: torch.Tensor, q_log: torch.Tensor, k: int) -> torch.Tensor:
    # [N, Vd] -> [N]: -sum over the target's top-k tokens of p_v log q_v
    idx = p_log.topk(min(k, p_log.shape[-1]), dim=-1).indices
    return -(p_log.gather(-1, idx).exp() * q_log.gather(-1, idx)).sum(-1)


def row_loss(cfg: ObjectiveConfig, p_log: torch.Tensor, q_log: torch.Tensor,
             weight: torch.Tensor) -> torch.Tensor:
    """[N] per-row loss of one TTT step (griffin's mask is applied by the caller through `weight`)."""
    if cfg.name == "lk":
        return lk_loss(p_log, q_log, weight, cfg.lk_eta)
    if cfg.name == "hass":
        return soft_ce(p_log, q_log) + cfg.hass_weight * topk_ce(p_log, q_log, cfg.hass_topk)
    return soft_ce(p_log, q_log)                      # kl, griffin


@torch.no_grad()
def aligned(q_log: torch.Tensor, to_target_ids, fed_ids: torch.Tensor, k: int) -> torch.Tensor:
    """[N] bool: the draft's top-k at this step holds the token the next step is fed (GRIFFIN)."""
    top = to_target_ids(q_log.topk(min(k, q_log.shape[-1]), dim=-1).indices)   # [N, k] target ids
    return (top == fed_ids[:, None]).any(-1)
