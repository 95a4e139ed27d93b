"""Training samples and target features (captured aux states, final hidden, greedy next token).

A sample is one conversation: ids = prompt + response, loss_mask = response positions. The frozen
target turns a batch of samples into features, either online (every training step) or once into
safetensors shards (FeatureCache). Teacher logits are not stored (V floats per token): the final
normed hidden state is, and the trainer recomputes the draft-vocab columns with the target lm_head;
the full-vocabulary argmax (needed for the position mask) is stored as `next_ids`.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, NamedTuple, Optional, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file

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


# ---------------------------------------------------------------------------- on-disk cache
@dataclass(frozen=True)
class CacheInfo:
    aux_layer_ids: tuple[int, ...]
    num_samples: int
    shard_size: int
    dtype: str


class FeatureCache:
    """Features of sample i live in shard i // shard_size as rows [offsets[j], offsets[j+1])."""

    def __init__(self, root: Path):
        self.root = root
        meta = json.loads((root / "cache.json").read_text())
        self.info = CacheInfo(tuple(meta["aux_layer_ids"]), meta["num_samples"], meta["shard_size"],
                              meta["dtype"])
        self._open: dict[int, tuple] = {}

    @staticmethod
    def complete(root: Path, aux_ids: Sequence[int], num_samples: int) -> bool:
        meta = root / "cache.json"
        if not meta.is_file():
            return False
        m = json.loads(meta.read_text())
        return tuple(m["aux_layer_ids"]) == tuple(aux_ids) and m["num_samples"] == num_samples

    def _shard(self, k: int):
        if k not in self._open:
            f = safe_open(str(self.root / f"shard-{k:05d}.safetensors"), framework="pt")
            self._open[k] = (f, f.get_tensor("offsets").tolist())
        return self._open[k]

    def get(self, i: int) -> Features:
        f, off = self._shard(i // self.info.shard_size)
        j = i % self.info.shard_size
        lo, hi = off[j], off[j + 1]
        return Features(f.get_slice("aux")[lo:hi], f.get_slice("hidden")[lo:hi],
                        f.get_slice("next_ids")[lo:hi].long())


def build_cache(target: LlamaModel, samples: Sequence[Sample], aux_ids: Sequence[int], root: Path,
                shard_size: int = 64, batch_size: int = 8, dtype: torch.dtype = torch.bfloat16,
                progress=None) -> FeatureCache:
    """Write every sample's features to shards (resumable: finished shards are kept)."""
    root.mkdir(parents=True, exist_ok=True)
    num_shards = (len(samples) + shard_size - 1) // shard_size
    bar = progress(total=len(samples)) if progress else None
    for k in range(num_shards):
        part = samples[k * shard_size:(k + 1) * shard_size]
        path = root / f"shard-{k:05d}.safetensors"
        if not _shard_ok(path, part):
            _write_shard(target, part, aux_ids, path, batch_size, dtype)
        if bar:
            bar.update(len(part))
    meta = {"aux_layer_ids": list(aux_ids), "num_samples": len(samples), "shard_size": shard_size,
            "dtype": str(dtype).replace("torch.", "")}
    (root / "cache.json").write_text(json.dumps(meta))
    return FeatureCache(root)


def _shard_ok(path: Path, part: Sequence[Sample]) -> bool:
    """A shard is reused only if it holds exactly these samples' lengths (a partial one is rewritten)."""
    if not path.is_file():
        return False
    with safe_open(str(path), framework="pt") as f:
        lengths = f.get_tensor("offsets").diff().tolist()
    return lengths == [len(s.ids) for s in part]


def _write_shard(target, part, aux_ids, path: Path, batch_size: int, dtype) -> None:
    feats: list[Features] = []
    order = sorted(range(len(part)), key=lambda i: len(part[i].ids))   # less padding per batch
    done: dict[int, Features] = {}
    for i in range(0, len(order), batch_size):
        idx = order[i:i + batch_size]
        for j, f in zip(idx, target_features(target, [part[j] for j in idx], aux_ids, dtype)):
            done[j] = f
    feats = [done[j] for j in range(len(part))]
    lengths = torch.tensor([len(f.next_ids) for f in feats])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    tensors = {"aux": torch.cat([f.aux for f in feats]).contiguous(),
               "hidden": torch.cat([f.hidden for f in feats]).contiguous(),
               "next_ids": torch.cat([f.next_ids for f in feats]).int().contiguous(), "offsets": offsets}
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    save_file(tensors, str(tmp))
    os.replace(tmp, path)


class FeatureSource:
    """Features for sample indices: from a FeatureCache, or computed online by the target."""

    def __init__(self, samples: Sequence[Sample], aux_ids: Sequence[int],
                 cache: Optional[FeatureCache] = None, target: Optional[LlamaModel] = None):
        if (cache is None) == (target is None):
            raise ValueError("give exactly one of cache= or target=")
        self.samples, self.aux_ids, self.cache, self.target = samples, tuple(aux_ids), cache, target

    def batch(self, indices: Sequence[int], width: Optional[int] = None) -> Batch:
        samples = [self.samples[i] for i in indices]
        if self.cache is not None:
            feats = [self.cache.get(i) for i in indices]
        else:
            feats = target_features(self.target, samples, self.aux_ids)
        return collate(samples, feats, width)


def iter_lengths(samples: Sequence[Sample]) -> Iterator[int]:
    return (len(s.ids) for s in samples)
