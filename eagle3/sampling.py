"""Sampling parameters and the one function that turns logits into the distribution we sample from.

Speculative verification uses the same `target_probs`, so "lossless" means: the output distribution
equals plain sampling from exactly this processed distribution (temperature, then top-k, then top-p).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from .errors import InputError

# Temperatures below this decode greedily (vLLM uses the same 1e-5). `logits / T` overflows fp32 to
# inf once T < ~1e-38 (softmax then has no finite mass), and long before that the distribution is
# one-hot for any logit gap above ~1e-3, so argmax is the limit the caller asked for.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0          # 0 (or anything below GREEDY_BELOW) = greedy
    top_p: float = 1.0
    top_k: int = 0                    # 0 = off
    seed: Optional[int] = None
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()        # stop strings (not included in the output)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)  # added to the model's eos ids
    ignore_eos: bool = False
    speculative: bool = True          # False: decoded plainly even where a draft or suffix index
                                      # could guess (the output is the same either way)

    def __post_init__(self):
        if not self.temperature >= 0:
            raise InputError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InputError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def greedy(self) -> bool:
        """Plain decoding, speculative decoding and the verifier all take the argmax path."""
        return self.temperature < GREEDY_BELOW

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        g = torch.Generator(device=device)
        g.manual_seed(self.seed if self.seed is not None else torch.seed())
        return g


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., V] logits -> [..., V] probabilities after temperature, top-k and top-p (not for greedy)."""
    x = logits.float() / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        probs = top_p_filter(probs, params.top_p)
    return probs


def top_p_filter(probs: torch.Tensor, top_p: float, head: int = 256) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p; renormalise.

    Sorting the full vocabulary is slow on a CPU; the nucleus almost always lies within the
    `head` largest probabilities, so those are sorted first and the full sort is the exact fallback.
    """
    k = min(head, probs.shape[-1])
    sorted_p, order = torch.topk(probs, k, dim=-1)             # descending
    if k < probs.shape[-1] and bool((sorted_p.sum(-1) < top_p).any()):
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
    before = torch.cumsum(sorted_p, dim=-1) - sorted_p         # mass strictly before each token
    sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)
    out = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return out / out.sum(dim=-1, keepdim=True)


def sample_next(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> torch.Tensor:
    """[..., V] -> [...] token ids (argmax when greedy)."""
    if params.greedy:
        return logits.argmax(dim=-1)
    probs = target_probs(logits, params)
    return sample_rows(probs.reshape(-1, probs.shape[-1]), gen).view(probs.shape[:-1])


def sample_each(logits: torch.Tensor, params: Sequence[SamplingParams],
                gens: Sequence[torch.Generator]) -> list[int]:
    """One token per row of [N, V] logits, row i with its own params and generator (the rows of
    a batched decode step): the token sample_next gives row i alone, in one call per group of rows
    that share temperature, top-k and top-p (each row is processed and summed on its own, so it
    gets the same bits; each generator draws its one number as it would alone)."""
    if logits.shape[0] != len(params) or len(params) != len(gens):
        raise ValueError(f"{logits.shape[0]} rows, {len(params)} params, {len(gens)} generators")
    out = [0] * len(params)
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault(None if p.greedy else (p.temperature, p.top_k, p.top_p), []).append(i)
    for key, rows in groups.items():
        sub = logits[rows]
        if key is None:
            tokens = sub.argmax(dim=-1)
        else:
            tokens = sample_rows(target_probs(sub, params[rows[0]]), [gens[i] for i in rows])
        for i, t in zip(rows, tokens.tolist()):
            out[i] = t
    return out


def sample_rows(weights: torch.Tensor, gen: torch.Generator | Sequence[torch.Generator]) -> torch.Tensor:
    """One draw per row of non-negative weights [T, V] -> [T], by inverse CDF in fp64 (torch's
    multinomial is an order of magnitude slower on a wide CPU row). Zero weights
    are never drawn: a u * total that rounds up to the total maps to the last nonzero weight.
    gen: one generator for every row, or one per row (each draws one number)."""
    cdf = weights.double().cumsum(dim=-1)                             # [T, V]
    total = cdf[:, -1:].contiguous()
    if cdf.device.type == "cpu" and not bool((torch.isfinite(total) & (total > 0)).all()):
        # (checked on the CPU only: on CUDA it would be a host sync per draw)
        raise RuntimeError("sampling weights have no finite positive mass in some row (NaN or inf "
                           "logits, or every token filtered out)")
    if isinstance(gen, torch.Generator):
        u = torch.rand(cdf.shape[0], 1, generator=gen, device=cdf.device, dtype=cdf.dtype)
    else:
        u = torch.cat([torch.rand(1, 1, generator=g, device=cdf.device, dtype=cdf.dtype) for g in gen])
    idx = torch.searchsorted(cdf, u * total, right=True)              # first cdf > u * total
    last = torch.searchsorted(cdf, total, right=False)                # first cdf == total
    return torch.minimum(idx, last).squeeze(1)
