"""The gate: a candidate draft replaces the served one only if its expected acceptance on held-out
captured traffic beats the served draft's by a margin, and only if its weights are finite.

Expected tau is the training-time test's estimate on the stored features and replies (train.
trainer.evaluate): per TTT step k the fraction of held-out positions where the draft's top token
equals the target's (the greedy acceptance of step k given steps < k were right), chained:
tau = 1 + sum_k prod_{j<=k} acc_j. A chain, not the served tree: a tree accepts at least as much
as its top-1 chain, so the estimate ranks drafts as the tree would while under-stating tau.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence

import torch

from ..train.features import FeatureSource
from ..train.trainer import evaluate
from ..train.ttt import TTTConfig, TTTModel

GATE_STEPS = 4          # chain depth of the estimate (the default tree drafts 5 levels)


class Verdict(NamedTuple):
    passed: bool
    candidate_tau: float
    served_tau: float
    reason: str


def non_finite(draft: torch.nn.Module) -> Optional[str]:
    """The first parameter holding a NaN or an infinity (None: all finite)."""
    for name, p in draft.named_parameters():
        if not torch.isfinite(p).all():
            return name
    return None


def expected_tau(draft, lm_head_weight: torch.Tensor, source: FeatureSource, indices: Sequence[int],
                 batch_size: int = 8, steps: int = GATE_STEPS) -> dict:
    """evaluate()'s figures ("acc" per step, "chain_accept", "est_tau") of `draft` on `indices`."""
    model = TTTModel(draft, lm_head_weight, TTTConfig(num_steps=steps, step_decay=1.0))
    return evaluate(model, source, list(indices), batch_size)


def judge(candidate: dict, served: Optional[dict], margin: float, bad_param: Optional[str] = None) -> Verdict:
    """Pass when finite and est_tau >= served est_tau * (1 + margin); no served draft counts 1.0."""
    served_tau = served["est_tau"] if served else 1.0
    cand_tau = candidate.get("est_tau", float("nan"))
    if bad_param is not None:
        return Verdict(False, cand_tau, served_tau, f"non-finite weights in {bad_param}")
    if not math.isfinite(cand_tau):
        return Verdict(False, cand_tau, served_tau, "its expected tau is not a number")
    need = served_tau * (1 + margin)
    if cand_tau < need:
        return Verdict(False, cand_tau, served_tau,
                       f"expected tau {cand_tau:.3f} < {need:.3f} (served {served_tau:.3f} + {margin:.0%})")
    return Verdict(True, cand_tau, served_tau,
                   f"expected tau {cand_tau:.3f} >= {need:.3f} (served {served_tau:.3f} + {margin:.0%})")
