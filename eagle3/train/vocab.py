"""Draft vocabulary from assistant-token frequencies: d2t (offsets) and t2d (membership mask).

The Vd most frequent target ids over the loss-masked (assistant) positions are kept and sorted
ascending: used[i] is draft id i's target id, d2t[i] = used[i] - i, t2d[j] = j in used. Ties in
frequency break toward the lower id, so the result is deterministic. When Vd == V the mapping is the
identity (d2t all zero, t2d all true).
"""
from __future__ import annotations

from typing import Iterable, NamedTuple

import torch

from ..errors import ContractError


class DraftVocab(NamedTuple):
    used: torch.Tensor    # [Vd] int64 target ids, ascending
    d2t: torch.Tensor     # [Vd] int64, target_id = draft_id + d2t[draft_id]
    t2d: torch.Tensor     # [V] bool


def count_tokens(sequences: Iterable[torch.Tensor], vocab_size: int) -> torch.Tensor:
    """Sum of bincounts over 1-D id tensors (the assistant tokens only): [V] int64."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids in sequences:
        counts += torch.bincount(ids.long().flatten(), minlength=vocab_size)[:vocab_size]
    return counts


def build_vocab(counts: torch.Tensor, draft_vocab_size: int) -> DraftVocab:
    vocab_size = counts.numel()
    if not 0 < draft_vocab_size <= vocab_size:
        raise ContractError("draft_vocab_size", draft_vocab_size, f"in [1, {vocab_size}]",
                            "pick a draft vocabulary no larger than the target's")
    # stable sort on -count keeps ascending id order among equal counts
    order = torch.sort(-counts, stable=True).indices
    used = order[:draft_vocab_size].sort().values
    d2t = used - torch.arange(draft_vocab_size)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used] = True
    return DraftVocab(used, d2t, t2d)


def coverage(counts: torch.Tensor, sizes: Iterable[int]) -> dict[int, float]:
    """Fraction of counted tokens covered by the top-Vd ids, for each Vd in sizes."""
    cum = torch.sort(counts, descending=True).values.cumsum(0).double()
    total = float(cum[-1]) or 1.0
    return {int(v): float(cum[min(v, len(cum)) - 1]) / total for v in sizes}
