"""Offline training data made by vLLM's speculators library, read for `eagle3 train`.

Two layouts (read from vllm-project/speculators: scripts/data_generation_offline.py,
data_generation/{vllm_hidden_states_generator,custom_worker,config_generator,offline}.py,
train/vocab_mapping.py, scripts/{prepare_data,build_vocab_mapping,train,launch_vllm}.py):

| layout | per conversation | ids, loss mask | layer ids and their numbering |
|---|---|---|---|
| "pt" (releases 0.3-0.4) | `data_<i>.pt`: {input_ids [T], hidden_states: list of [T, H], loss_mask [T]} | in the file | `data_config.json` hidden_states.layer_ids, OUTPUT of layer i (its worker hooked each layer's output); default [2, L//2, L-3, L-1] |
| "hs" (later releases) | `hidden_states/hs_<i>.safetensors`: vLLM's example-connector file {hidden_states [T, n, H], token_ids [T]} | the prepared dataset beside it (Arrow, `input_ids`, `loss_mask`; needs pyarrow) | vLLM's `extract_hidden_states`, INPUT of layer i; not recorded: launch_vllm.py's default [2, L//2, L-3, L] unless given |

Both end in the last layer's output before the final norm (speculators' verifier_last_hidden_states),
from which the teacher is made here as for vLLM captures (vllm_features.py). Beside them:
`token_freq.pt` ({token id: count over loss-masked tokens}) and `d2t.npy` / `t2d.npy` (the draft
vocabulary, our convention: target = draft id + d2t, t2d a membership mask). The draft vocabulary
comes from d2t/t2d when present, else from token_freq.pt, else from the data; its size must match
draft_vocab_size. The aux ids (input numbering, without L) become the draft's aux_layer_ids.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import NamedTuple, Optional, Sequence

import torch

from ..errors import ContractError, InputError, LoadError
from ..models.llama import LlamaModel
from .features import Features, Sample
from .vllm_features import Capture, capture_features, check_layer_ids, check_numbering, read_capture
from .vocab import DraftVocab, build_vocab

DATA_CONFIG = "data_config.json"
PT_FILE = re.compile(r"data_(\d+)\.pt$")
HS_FILE = re.compile(r"hs_(\d+)\.safetensors$")


class SpeculatorsData(NamedTuple):
    root: Path
    layout: str                        # "pt" | "hs"
    files: list[Path]                  # one per conversation, in index order
    samples: list[Sample]              # ids and loss mask, truncated to max_len
    layer_ids: tuple[int, ...]         # input numbering, ending with L
    vocab: Optional[DraftVocab]        # from d2t/t2d or token_freq.pt; None: build from the data

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        return self.layer_ids[:-1]


# ---------------------------------------------------------------------------- reading
def read_speculators_data(root: str | Path, num_layers: int, vocab_size: int, draft_vocab_size: int,
                          max_len: int, layer_ids: Optional[Sequence[int]] = None) -> SpeculatorsData:
    """The conversations, their files, layer ids (input numbering) and vocabulary of a speculators
    data directory. `layer_ids`: for the "hs" layout, the list vLLM was launched with."""
    root = Path(root)
    if not root.is_dir():
        raise LoadError(f"{root}: no such speculators data directory")
    if (root / DATA_CONFIG).is_file() or _indexed(root, PT_FILE):
        layout, files, samples, ids = _pt_layout(root, num_layers, max_len, layer_ids)
    elif _indexed(root / "hidden_states", HS_FILE) or _indexed(root, HS_FILE):
        layout, files, samples, ids = _hs_layout(root, num_layers, max_len, layer_ids)
    else:
        raise LoadError(f"{root}: neither speculators layout (data_config.json with data_<i>.pt, or "
                        "hidden_states/hs_<i>.safetensors beside a prepared dataset)")
    if not ids or ids[-1] != num_layers:
        raise ContractError("speculators layer ids", f"{list(ids)} (input numbering) in {root}",
                            f"the draft's aux ids then {num_layers} (the last layer's output)",
                            "generate the data with the last layer included (speculators' "
                            "--include-last-layer, its default)")
    return SpeculatorsData(root, layout, files, samples, tuple(ids),
                           read_vocab(root, vocab_size, draft_vocab_size))


def _indexed(folder: Path, pattern: re.Pattern) -> list[Path]:
    if not folder.is_dir():
        return []
    found = {int(m[1]): p for p in folder.iterdir() if (m := pattern.match(p.name))}
    if found and sorted(found) != list(range(len(found))):
        missing = sorted(set(range(max(found) + 1)) - set(found))[:5]
        raise LoadError(f"{folder}: conversation files are not numbered 0..{max(found)} (missing "
                        f"{missing}...): a generation run did not finish; rerun it to fill them")
    return [found[i] for i in sorted(found)]


def _pt_layout(root: Path, num_layers: int, max_len: int, given):
    cfg = json.loads((root / DATA_CONFIG).read_text()) if (root / DATA_CONFIG).is_file() else {}
    stored = (cfg.get("hidden_states") or {}).get("layer_ids")
    if stored is None and given is None:
        raise LoadError(f"{root}: no {DATA_CONFIG} to say which layers data_<i>.pt holds. Fix: give "
                        "the layer ids the data was generated with (output of layer i)")
    output_ids = list(stored if stored is not None else given)
    if stored is not None and given is not None and list(given) != output_ids:
        raise ContractError("speculators layer ids", f"{output_ids} in {root / DATA_CONFIG}", list(given),
                            "the data records its layer ids: give none, or the recorded ones")
    files = _indexed(root, PT_FILE)
    samples = [_pt_sample(path, max_len) for path in files]
    return "pt", files, samples, [i + 1 for i in output_ids]        # output of i = input of i + 1


def _pt_sample(path: Path, max_len: int) -> Sample:
    d = load_pt(path, mmap=True)            # the ids and mask only: the hidden states stay on disk
    for key in ("input_ids", "loss_mask", "hidden_states"):
        if key not in d:
            raise LoadError(f"{path}: no {key!r} (keys {sorted(d)}): not a speculators data file")
    return Sample(d["input_ids"].long()[:max_len], d["loss_mask"].bool()[:max_len])


def load_pt(path: Path, mmap: bool = False) -> dict:
    """A data_<i>.pt file's dict of tensors. mmap: map the file and read only the tensors used
    (torch.save's zip format; a file in the legacy format is read whole)."""
    try:
        try:
            d = torch.load(str(path), map_location="cpu", weights_only=True, mmap=mmap)
        except RuntimeError:
            if not mmap:
                raise
            d = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:                                 # noqa: BLE001  torch.load raises many types
        raise LoadError(f"{path}: not a plain tensor file; refused by torch.load(weights_only=True) "
                        f"({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(d, dict):
        raise LoadError(f"{path}: expected a dict of tensors")
    return d


def _hs_layout(root: Path, num_layers: int, max_len: int, given):
    folder = root / "hidden_states" if (root / "hidden_states").is_dir() else root
    files = _indexed(folder, HS_FILE)
    rows = read_prepared(root if folder != root else root.parent)
    if len(rows) < len(files):
        raise ContractError("speculators data", f"{len(files)} hidden-state files in {folder}",
                            f"at most the {len(rows)} prepared conversations",
                            "the files belong to another prepared dataset")
    samples = [Sample(torch.tensor(ids, dtype=torch.long)[:max_len], torch.tensor(mask).bool()[:max_len])
               for ids, mask in rows[:len(files)]]
    ids = list(given) if given is not None else [2, num_layers // 2, num_layers - 3, num_layers]
    return "hs", files, samples, ids


def read_prepared(folder: Path) -> list[tuple[list[int], list[int]]]:
    """(input_ids, loss_mask) rows of a dataset saved by speculators' prepare_data.py (HF datasets
    save_to_disk: Arrow stream files data-*.arrow, in order)."""
    shards = sorted(folder.glob("data-*-of-*.arrow"))
    if not shards:
        raise LoadError(f"{folder}: no prepared dataset (data-*-of-*.arrow from prepare_data.py)")
    try:
        import pyarrow as pa
    except ImportError:
        raise LoadError("reading speculators' prepared dataset (Arrow) needs pyarrow: pip install "
                        "pyarrow") from None
    rows = []
    for shard in shards:
        with pa.memory_map(str(shard)) as f:
            table = pa.ipc.open_stream(f).read_all()
        rows += list(zip(table.column("input_ids").to_pylist(), table.column("loss_mask").to_pylist()))
    return rows


def read_vocab(root: Path, vocab_size: int, draft_vocab_size: int) -> Optional[DraftVocab]:
    """d2t.npy / t2d.npy when both exist, else token_freq.pt, else None (count the data)."""
    d2t_path, t2d_path, freq_path = root / "d2t.npy", root / "t2d.npy", root / "token_freq.pt"
    if d2t_path.is_file() != t2d_path.is_file():
        raise LoadError(f"{root}: only one of d2t.npy / t2d.npy: give both, or neither")
    if d2t_path.is_file():
        import numpy as np
        d2t = torch.from_numpy(np.load(d2t_path)).long()
        t2d = torch.from_numpy(np.load(t2d_path)).bool()
        used = d2t + torch.arange(d2t.numel())
        if t2d.numel() != vocab_size:
            raise ContractError("t2d.npy", f"{t2d.numel()} entries in {root}", f"the target vocabulary "
                                f"{vocab_size}", "this data's vocabulary map belongs to another target")
        if d2t.numel() != draft_vocab_size:
            raise ContractError("d2t.npy", f"{d2t.numel()} draft ids in {root}", f"draft_vocab_size "
                                f"{draft_vocab_size}", f"train with --set draft_vocab_size={d2t.numel()}, "
                                "or remove d2t.npy / t2d.npy to build a map from token_freq.pt")
        if not torch.equal(t2d.nonzero().flatten(), used):
            raise ContractError("d2t.npy / t2d.npy", "maps naming different tokens", "the same tokens",
                                "rebuild both from token_freq.pt")
        return DraftVocab(used, d2t, t2d)
    if freq_path.is_file():
        freq = torch.load(str(freq_path), map_location="cpu", weights_only=True)
        counts = torch.zeros(vocab_size, dtype=torch.long)
        for token, count in freq.items():
            if not 0 <= int(token) < vocab_size:
                raise ContractError("token_freq.pt", f"token id {token} in {root}", f"< {vocab_size}",
                                    "the frequencies belong to another tokenizer")
            counts[int(token)] = int(count)
        return build_vocab(counts, draft_vocab_size)
    return None


# ---------------------------------------------------------------------------- features
def read_rows(data: SpeculatorsData, index: int, num_layers: int) -> Capture:
    path = data.files[index]
    if data.layout == "hs":
        return read_capture(path, num_layers, data.layer_ids)
    d = load_pt(path)
    states = torch.stack(list(d["hidden_states"]), 1)                # [T, n, H]
    if states.shape[1] != len(data.layer_ids):
        raise ContractError("hidden_states", f"{states.shape[1]} layers in {path}",
                            f"{len(data.layer_ids)} ({DATA_CONFIG} layer ids)",
                            "the file and data_config.json disagree: regenerate the data")
    return Capture(d["input_ids"].long(), states[:, :-1].reshape(states.shape[0], -1), states[:, -1],
                   data.layer_ids, str(path))


def truncated(cap: Capture, n: int) -> Capture:
    """The first n rows (a causal target's states for a prefix are the prefix's states)."""
    return cap._replace(token_ids=cap.token_ids[:n], aux=cap.aux[:n],
                        last=None if cap.last is None else cap.last[:n])


def speculators_features(target: LlamaModel, data: SpeculatorsData, verify: bool = True):
    """A `features=` function for store.build_part over the data's conversations, in order."""
    num_layers, checked = target.config.num_layers, []

    def features(start: int, part: Sequence[Sample]) -> list[Features]:
        out = []
        for k, sample in enumerate(part):
            cap = truncated(read_rows(data, start + k, num_layers), len(sample.ids))
            check_layer_ids(cap, target, data.aux_layer_ids)
            if verify and not checked:
                checked.append(check_numbering(target, sample, cap, data.aux_layer_ids))
            out.append(capture_features(target, sample, cap))
        return out
    return features


def aux_ids_for(configured: Optional[Sequence[int]], data: SpeculatorsData) -> tuple[int, ...]:
    """The run's aux_layer_ids: the data's, which a configured list must equal."""
    if configured is not None and tuple(configured) != data.aux_layer_ids:
        raise ContractError("aux_layer_ids", list(configured), list(data.aux_layer_ids),
                            f"the speculators data in {data.root} holds layers "
                            f"{list(data.aux_layer_ids)} (input to layer i): drop aux_layer_ids from "
                            "the config, or regenerate the data at the layers you want")
    return data.aux_layer_ids


def check_not_empty(data: SpeculatorsData) -> None:
    if not data.samples:
        raise InputError(f"{data.root}: no conversations")
