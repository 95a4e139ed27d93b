"""The offline feature store: a target's features for a dataset, computed once, read by every run.

What is stored, per token: the captured aux states (k*Ht), the target's final normed hidden state
(Ht) and its argmax over the full vocabulary (int32). The teacher distribution is NOT stored as
logits: the trainer computes it exactly as lm_head(hidden) over the draft vocabulary's rows. That
costs Ht values per token instead of Vd (SmolLM2: 576 vs 12288 bf16 values, 21x less than
draft-vocab logits and 85x less than full-vocabulary ones), loses nothing (top-k would truncate the
soft target), and keeps the store independent of the draft vocabulary, so a vocabulary ablation
reuses it. Stored in bf16 by default (the trainer's autocast runs in bf16 anyway).

Layout: <root>/<part>/ per data file (a run composes parts: regenerated + dataset replies + a
held-out file), each part a list of safetensors shards of `shard_size` conversations and a
manifest `store.json`. Every shard names in its metadata the target fingerprint, the capture ids,
the dtype and the hash of its own conversations, so a resumed build keeps only shards that match
and a store built for another target, other layers or other data is refused (ContractError naming
the field) instead of being read.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import ContractError, LoadError
from .features import Features, Sample, target_features

FORMAT = "eagle3-feature-store/1"
TEACHER = "final normed hidden state (teacher = lm_head(hidden) over any draft vocabulary) + full-vocab argmax"


# ---------------------------------------------------------------------------- identities
def target_fingerprint(target: torch.nn.Module) -> str:
    """sha256 over every parameter and buffer of the target (name, shape, dtype, bytes)."""
    h = hashlib.sha256()
    for name, t in sorted(target.state_dict().items()):
        t = t.detach().contiguous().cpu()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def samples_hash(samples: Sequence[Sample]) -> str:
    """sha256 over the conversations as the trainer reads them (ids and loss mask, after max_len)."""
    h = hashlib.sha256()
    for s in samples:
        h.update(s.ids.to(torch.int64).numpy().tobytes())
        h.update(s.loss_mask.to(torch.uint8).numpy().tobytes())
        h.update(b"|")
    return h.hexdigest()


@dataclass(frozen=True)
class PartKey:
    """What a part's features depend on; every field is checked when a part is opened or resumed."""
    target: str                      # target_fingerprint
    aux_layer_ids: tuple[int, ...]   # "input to layer i"
    dtype: str

    def meta(self) -> dict[str, str]:
        return {"format": FORMAT, "target": self.target, "aux_layer_ids": json.dumps(list(self.aux_layer_ids)),
                "dtype": self.dtype}

    def check(self, meta: dict, where: str) -> None:
        ids = meta.get("aux_layer_ids", [])             # a list in store.json, JSON text in a shard
        found = {"format": meta.get("format"), "target": meta.get("target"),
                 "aux_layer_ids": tuple(json.loads(ids) if isinstance(ids, str) else ids),
                 "dtype": meta.get("dtype")}
        want = {"format": FORMAT, **asdict(self)}
        for field, value in want.items():
            if found[field] != value:
                raise ContractError(f"feature store {field}", f"{found[field]} in {where}", value,
                                    "this store was built for another target, capture layers or "
                                    "dtype: give the run its own features_dir, or delete the part "
                                    "to rebuild it")


# ---------------------------------------------------------------------------- reading
class StorePart:
    """Features of one data file: sample i lives in shard i // shard_size, rows [off[j], off[j+1])."""

    def __init__(self, root: Path, key: PartKey, samples: Sequence[Sample]):
        path = root / "store.json"
        if not path.is_file():
            raise LoadError(f"{root}: no store.json (the part was never finished). Fix: build it "
                            "(eagle3 train --set features=store, or scripts/cache_features.py)")
        self.root, self.manifest = root, json.loads(path.read_text())
        key.check(self.manifest, str(path))
        n = self.manifest["num_samples"]
        if len(samples) != n or samples_hash(samples) != self.manifest["samples_sha256"]:
            raise ContractError("feature store data", f"{n} conversations hashed "
                                f"{self.manifest['samples_sha256'][:12]} in {path}",
                                f"{len(samples)} conversations hashed {samples_hash(samples)[:12]}",
                                "the conversations file or max_len changed since the store was built: "
                                "rebuild the part (it resumes, keeping shards that still match)")
        self.shard_size = self.manifest["shard_size"]
        self._open: dict[int, tuple] = {}

    def _shard(self, k: int):
        if k not in self._open:
            f = safe_open(str(self.root / f"shard-{k:05d}.safetensors"), framework="pt")
            self._open[k] = (f, f.get_tensor("offsets").tolist())
        return self._open[k]

    def get(self, i: int) -> Features:
        f, off = self._shard(i // self.shard_size)
        j = i % self.shard_size
        lo, hi = off[j], off[j + 1]
        return Features(f.get_slice("aux")[lo:hi], f.get_slice("hidden")[lo:hi],
                        f.get_slice("next_ids")[lo:hi].long())


class FeatureStore:
    """Several parts read as one sample list (a run's data files in order)."""

    def __init__(self, parts: Sequence[tuple[StorePart, int]]):
        self.parts = list(parts)                       # (part, number of samples)
        self.starts = [sum(n for _, n in self.parts[:k]) for k in range(len(self.parts))]

    def get(self, i: int) -> Features:
        for (part, n), start in zip(self.parts, self.starts):
            if start <= i < start + n:
                return part.get(i - start)
        raise IndexError(f"sample {i} is past the store's {sum(n for _, n in self.parts)} samples")


# ---------------------------------------------------------------------------- building
# (index of the first sample, the shard's samples) -> their features, in order
FeatureFn = Callable[[int, Sequence[Sample]], list[Features]]


def build_part(target, samples: Sequence[Sample], key: PartKey, root: Path, shard_size: int = 64,
               batch_size: int = 8, progress: Optional[Callable] = None,
               features: Optional[FeatureFn] = None, source: str = "this process") -> StorePart:
    """Write a part's shards (resumable: a shard is kept when its metadata and samples match),
    then its manifest. Returns the opened part. `features`: where the rows come from (default:
    the target run here, `batch_size` conversations at a time); `source` says so in the manifest."""
    root.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, key.dtype)
    features = features or (lambda start, part: own_features(target, part, key, batch_size, dtype))
    num_shards = (len(samples) + shard_size - 1) // shard_size
    bar = progress(total=len(samples)) if progress else None
    sizes = {"aux": 0, "hidden": 0, "next_ids": 0}
    for k in range(num_shards):
        part = samples[k * shard_size:(k + 1) * shard_size]
        path = root / f"shard-{k:05d}.safetensors"
        if not _shard_ok(path, part, key):
            _write_shard(features(k * shard_size, part), part, key, path, dtype)
        with safe_open(str(path), framework="pt") as f:
            for name in sizes:
                sizes[name] += f.get_slice(name).get_shape()[0] * _row_bytes(f, name)
        if bar:
            bar.update(len(part))
    if bar:
        bar.close()
    tokens = sum(len(s.ids) for s in samples)
    manifest = {**key.meta(), "aux_layer_ids": list(key.aux_layer_ids), "teacher": TEACHER, "source": source,
                "num_samples": len(samples), "tokens": tokens, "shard_size": shard_size,
                "samples_sha256": samples_hash(samples), "bytes": sizes,
                "bytes_per_token": round(sum(sizes.values()) / max(1, tokens), 1)}
    tmp = root / f"store.json.tmp{os.getpid()}"
    tmp.write_text(json.dumps(manifest, indent=2))
    os.replace(tmp, root / "store.json")
    return StorePart(root, key, samples)


def _row_bytes(f, name: str) -> int:
    shape = f.get_slice(name).get_shape()
    per = 1
    for s in shape[1:]:
        per *= s
    return per * {"BF16": 2, "F16": 2, "F32": 4, "I32": 4, "I64": 8}[f.get_slice(name).get_dtype()]


def part_complete(root: Path, key: PartKey, samples: Sequence[Sample]) -> bool:
    try:
        StorePart(root, key, samples)
        return True
    except (LoadError, ContractError):
        return False


def _shard_ok(path: Path, part: Sequence[Sample], key: PartKey) -> bool:
    """A shard is kept only if it was built for this key from exactly these conversations. A shard
    built for another target or layers raises: silently rewriting it would hide a wrong features_dir."""
    if not path.is_file():
        return False
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    key.check(meta, str(path))
    return meta.get("samples_sha256") == samples_hash(part)


def own_features(target, part: Sequence[Sample], key: PartKey, batch_size: int, dtype) -> list[Features]:
    """The target run in this process, shortest conversations batched together (less padding)."""
    order = sorted(range(len(part)), key=lambda i: len(part[i].ids))
    done: dict[int, Features] = {}
    for i in range(0, len(order), batch_size):
        idx = order[i:i + batch_size]
        for j, f in zip(idx, target_features(target, [part[j] for j in idx], key.aux_layer_ids, dtype)):
            done[j] = f
    return [done[j] for j in range(len(part))]


def _write_shard(feats: Sequence[Features], part: Sequence[Sample], key: PartKey, path: Path, dtype) -> None:
    for s, f in zip(part, feats):
        if len(f.next_ids) != len(s.ids):
            raise ContractError("feature rows", f"{len(f.next_ids)} rows", f"{len(s.ids)} tokens",
                                "each conversation needs one feature row per token")
    feats = [Features(f.aux.to(dtype), f.hidden.to(dtype), f.next_ids) for f in feats]
    lengths = torch.tensor([len(f.next_ids) for f in feats])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    tensors = {"aux": torch.cat([f.aux for f in feats]).contiguous(),
               "hidden": torch.cat([f.hidden for f in feats]).contiguous(),
               "next_ids": torch.cat([f.next_ids for f in feats]).int().contiguous(), "offsets": offsets}
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    save_file(tensors, str(tmp), metadata={**key.meta(), "samples_sha256": samples_hash(part)})
    os.replace(tmp, path)


def part_name(path: Path) -> str:
    """A data file's part directory: its stem and a hash of its resolved path."""
    return f"{path.stem}-{hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:10]}"
