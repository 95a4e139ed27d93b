"""Training samples and target features (captured aux states, final hidden, greedy next token).

A sample is one conversation: ids = prompt + response, loss_mask = response positions. The frozen
target turns a batch of samples into features, either online (every training step) or once into
the offline feature store (store.py). Teacher logits are never materialised per token: the final
normed hidden state is kept, and the trainer computes the draft-vocab columns with the target
lm_head; the full-vocabulary argmax (needed for the position mask) is kept as `next_ids`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple, Optional, Sequence

import torch

from ..errors import LoadError
from ..models.llama import LlamaModel


class Sample(NamedTuple):
    ids: torch.Tensor        # [T] int64
    loss_mask: torch.Tensor  # [T] bool, True on assistant tokens


class Features(NamedTuple):
    aux: torch.Tensor        # [T, k*Ht] captured residual streams
    hidden: torch.Tensor     # [T, Ht] final normed hidden (teacher logits = lm_head(hidden))
    next_ids: torch.Tensor   # [T] int64 target argmax over the full vocabulary


class Batch(NamedTuple):
    ids: torch.Tensor        # [B, T] int64 (right padded with 0)
    loss_mask: torch.Tensor  # [B, T] bool
    valid: torch.Tensor      # [B, T] bool, False on padding
    aux: torch.Tensor        # [B, T, k*Ht]
    hidden: torch.Tensor     # [B, T, Ht]
    next_ids: torch.Tensor   # [B, T] int64


def load_conversations(path: Path, max_len: int) -> list[Sample]:
    """Read regenerated conversations (regen.py JSONL) into samples truncated to max_len tokens."""
    if not path.is_file():
        raise LoadError(f"{path}: no conversations file. Fix: run the data step first")
    samples = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue                                  # half-written last line of a running job
        prompt, resp = rec["prompt_ids"], rec["response_ids"]
        ids = torch.tensor(prompt + resp, dtype=torch.long)[:max_len]
        mask = torch.zeros(len(prompt) + len(resp), dtype=torch.bool)
        mask[len(prompt):] = True
        if mask[:max_len].any():
            samples.append(Sample(ids, mask[:max_len]))
    return samples


def load_conversation_files(paths: Sequence[Path], max_len: int) -> list[Sample]:
    """Samples of several conversation files, in order (a run's `data` list)."""
    return [s for path in paths for s in load_conversations(path, max_len)]


def pad_stack(rows: Sequence[torch.Tensor], width: int, value=0) -> torch.Tensor:
    out = rows[0].new_full((len(rows), width) + tuple(rows[0].shape[1:]), value)
    for b, r in enumerate(rows):
        out[b, :len(r)] = r
    return out


@torch.inference_mode()
def target_features(target: LlamaModel, samples: Sequence[Sample], aux_ids: Sequence[int],
                    dtype: torch.dtype = torch.float32) -> list[Features]:
    """Run the frozen target over right-padded samples (causal: padding is never a key of a real row)."""
    width = max(len(s.ids) for s in samples)
    ids = pad_stack([s.ids for s in samples], width)
    cache = target.new_cache(width, len(samples))
    out = target(ids, torch.arange(width), cache, logits_rows=torch.empty(0, dtype=torch.long),
                 capture_ids=aux_ids)
    feats = []
    for b, s in enumerate(samples):
        n = len(s.ids)
        hidden = out.hidden[b, :n]
        next_ids = target.lm_head(hidden).argmax(-1)
        feats.append(Features(out.aux[b, :n].to(dtype), hidden.to(dtype), next_ids))
    return feats


def collate(samples: Sequence[Sample], feats: Sequence[Features], width: Optional[int] = None) -> Batch:
    width = width or max(len(s.ids) for s in samples)
    valid = pad_stack([torch.ones(len(s.ids), dtype=torch.bool) for s in samples], width, False)
    return Batch(pad_stack([s.ids for s in samples], width), pad_stack([s.loss_mask for s in samples], width, False),
                 valid, pad_stack([f.aux.float() for f in feats], width),
                 pad_stack([f.hidden.float() for f in feats], width), pad_stack([f.next_ids for f in feats], width))


class FeatureSource:
    """Features for sample indices: from a feature store (store.FeatureStore: anything with
    get(i) -> Features), or computed online by the target."""

    def __init__(self, samples: Sequence[Sample], aux_ids: Sequence[int], store=None,
                 target: Optional[LlamaModel] = None):
        if (store is None) == (target is None):
            raise ValueError("give exactly one of store= or target=")
        self.samples, self.aux_ids, self.store, self.target = samples, tuple(aux_ids), store, target

    def batch(self, indices: Sequence[int], width: Optional[int] = None) -> Batch:
        samples = [self.samples[i] for i in indices]
        if self.store is not None:
            feats = [self.store.get(i) for i in indices]
        else:
            feats = target_features(self.target, samples, self.aux_ids)
        return collate(samples, feats, width)

