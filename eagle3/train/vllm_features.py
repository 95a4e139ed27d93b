"""Target features captured by vLLM, read into the offline feature store.

vLLM (its `extract_hidden_states` speculative method) runs the target and hands the states of chosen
layers to a KV connector, which writes one file per prompt. Two file layouts are read:

| layout | tensors | layer ids |
|---|---|---|
| ours (vllm_connector.py, `eagle3-vllm-rows/1`) | aux [T, k*H], last [T, H], token_ids [T] | in its metadata |
| vLLM's ExampleHiddenStatesConnector (also speculators' `hs_<i>.safetensors`) | hidden_states [T, n, H], token_ids [T] | not recorded: the caller gives the list it launched vLLM with |

Layer numbering: vLLM's id i is the residual stream entering layer i (its Llama forward appends
`hidden_states + residual` after layer i-1), the same "input to layer i" as ours and HF's
output_hidden_states[i]; id L is the last layer's output before the final norm. So a draft with
aux_layer_ids A needs vLLM's list A + [L]: the aux rows, then the state the teacher is made of
(the store's `hidden` = final norm of it, `next_ids` = argmax of lm_head over it, computed here with
the target's own norm and lm_head, which the trainer loads anyway). A list in another numbering or
without L is refused with a ContractError naming the list to launch with; `check_numbering`
compares one conversation against this process's own capture, so a layer off by one is caught
even where the file records nothing.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import NamedTuple, Optional, Sequence

import torch
from safetensors import safe_open

from ..engines import IDS_KEY
from ..errors import ContractError, LoadError
from ..models.llama import LlamaModel
from .features import Features, Sample, target_features
from .vllm_rows import ROWS_FORMAT, split_rows

CHILD_SCRIPT = Path(__file__).with_name("vllm_capture_child.py")


class Capture(NamedTuple):
    """One prompt's states as vLLM captured them, split into the store's rows."""
    token_ids: torch.Tensor           # [T] int64
    aux: torch.Tensor                 # [T, k*H] the ids below L, low -> high
    last: Optional[torch.Tensor]      # [T, H] id L (pre-norm), None when not captured
    layer_ids: tuple[int, ...]        # vLLM's list (input numbering)
    path: str


def vllm_layer_ids(aux_layer_ids: Sequence[int], num_layers: int) -> list[int]:
    """The list to launch vLLM with for a draft fusing `aux_layer_ids` (ours = vLLM's numbering)."""
    return [int(i) for i in aux_layer_ids] + [num_layers]


# ---------------------------------------------------------------------------- reading files
def read_capture(path: str | Path, num_layers: int, layer_ids: Optional[Sequence[int]] = None) -> Capture:
    """A capture file of either layout. `layer_ids`: the list vLLM ran with; required for the
    example connector's files (they do not record it), checked against ours (they do)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta, names = f.metadata() or {}, set(f.keys())
            tensors = {n: f.get_tensor(n) for n in names}
    except Exception as e:                   # noqa: BLE001  safetensors raises its own error type
        raise LoadError(f"{path}: not a readable safetensors capture ({type(e).__name__}: {e})") from None
    if meta.get("format") == ROWS_FORMAT:
        return _ours(path, meta, tensors, num_layers, layer_ids)
    if {"hidden_states", "token_ids"} <= names:
        return _example(path, tensors, num_layers, layer_ids)
    raise LoadError(f"{path}: tensors {sorted(names)}: neither our connector's rows (aux, last, "
                    "token_ids) nor vLLM's hidden-states layout (hidden_states, token_ids)")


def _ours(path, meta: dict, tensors: dict, num_layers: int, given: Optional[Sequence[int]]) -> Capture:
    recorded = tuple(json.loads(meta["layer_ids"]))
    if given is not None and tuple(given) != recorded:
        raise ContractError(f"vLLM {IDS_KEY}", f"{list(recorded)} in {path}",
                            list(given), "the file records the list vLLM ran with; give no "
                            "--layer-ids for our connector's files, or the list it was launched with")
    if int(meta["num_hidden_layers"]) != num_layers:
        raise ContractError("num_hidden_layers", f"{meta['num_hidden_layers']} in {path} (model "
                            f"{meta.get('model')})", num_layers,
                            "these states come from another model: capture with this target")
    return Capture(tensors["token_ids"].long(), tensors["aux"], tensors.get("last"), recorded, str(path))


def _example(path, tensors: dict, num_layers: int, given: Optional[Sequence[int]]) -> Capture:
    states = tensors["hidden_states"]                       # [T, n, H]
    if given is None:
        raise LoadError(f"{path}: vLLM's hidden-states files do not record their layer ids. Fix: "
                        f"give the {IDS_KEY} vLLM was launched with "
                        "(--layer-ids, input to layer i)")
    if states.dim() != 3 or states.shape[1] != len(given):
        raise ContractError("hidden_states shape", f"{tuple(states.shape)} in {path}",
                            f"[T, {len(given)}, H] for layer ids {list(given)}",
                            "give the layer-id list vLLM was launched with")
    rows = split_rows(states, list(given), num_layers)
    return Capture(tensors["token_ids"].long(), rows["aux"], rows.get("last"), tuple(given), str(path))


# ---------------------------------------------------------------------------- contract
def check_layer_ids(cap: Capture, target: LlamaModel, aux_layer_ids: Sequence[int]) -> None:
    """vLLM's list must be the draft's aux ids (same numbering) then L; the widths must be Ht."""
    cfg = target.config
    want = vllm_layer_ids(aux_layer_ids, cfg.num_layers)
    found = list(cap.layer_ids)
    if found != want:
        raise ContractError(f"vLLM {IDS_KEY}", f"{found} in {cap.path}", want,
                            _ids_fix(found, want, cfg.num_layers))
    width = len(aux_layer_ids) * cfg.hidden_size
    if cap.aux.shape[-1] != width or cap.last is None or cap.last.shape[-1] != cfg.hidden_size:
        raise ContractError("captured width", f"aux {tuple(cap.aux.shape)}, last "
                            f"{None if cap.last is None else tuple(cap.last.shape)} in {cap.path}",
                            f"aux [T, {width}], last [T, {cfg.hidden_size}]",
                            "these states come from another model: capture with this target")


def _ids_fix(found: list[int], want: list[int], num_layers: int) -> str:
    launch = f"launch vLLM with {IDS_KEY}={want}"
    if [i + 1 for i in found] == want or [i + 1 for i in found] == want[:-1]:
        return (f"{found} are 'output of layer i' ids (SpecForge, SGLang's eagle_config); vLLM numbers "
                f"'input to layer i' like this project: {launch}")
    if found == want[:-1]:
        return (f"the list lacks {num_layers} (the last layer's output), which the teacher is made "
                f"of: {launch}")
    return f"{launch} (the draft's aux ids, then L = {num_layers}), or train with aux_layer_ids = {found[:-1]}"


def check_tokens(cap: Capture, sample: Sample) -> None:
    ids = sample.ids.long()
    if len(cap.token_ids) != len(ids) or not torch.equal(cap.token_ids, ids):
        n = min(len(ids), len(cap.token_ids))
        diff = (cap.token_ids[:n] != ids[:n]).nonzero()
        at = int(diff[0]) if len(diff) else n
        raise ContractError("capture token_ids", f"{len(cap.token_ids)} tokens in {cap.path}, first "
                            f"difference at {at}", f"the conversation's {len(ids)} tokens",
                            "the captures belong to other conversations (or another order or "
                            "max_len): capture these conversations again")


@torch.inference_mode()
def check_numbering(target: LlamaModel, sample: Sample, cap: Capture, aux_layer_ids: Sequence[int],
                    tolerance: float = 0.1) -> dict[int, float]:
    """Each captured aux layer must be closest to this process's own capture of the SAME id, not a
    neighbour: vLLM's numbering checked on the target itself. Returns {id: typical_rel}. Measured on
    SmolLM2 (vLLM bf16 against ours fp32): ~0.02 against the same layer, ~0.45 against a neighbour."""
    num_layers, h = target.config.num_layers, target.config.hidden_size
    near = sorted({j for i in aux_layer_ids for j in (i - 1, i, i + 1) if 0 <= j < num_layers})
    ours = target_features(target, [sample], near)[0].aux.float()           # [T, len(near)*H]
    errors = {}
    for slot, i in enumerate(aux_layer_ids):
        theirs = cap.aux[:, slot * h:(slot + 1) * h].float()
        rel = {j: typical_rel(theirs, ours[:, near.index(j) * h:(near.index(j) + 1) * h]) for j in near
               if abs(j - i) <= 1}
        best = min(rel, key=rel.get)
        if rel[best] > tolerance:
            raise ContractError(f"vLLM capture of layer id {i}", f"typical relative error {rel[best]:.3g} "
                                f"or more against our layers {sorted(rel)}", f"< {tolerance} against layer {i}",
                                "these are not this target's residual streams: capture with the "
                                "same checkpoint (and a dtype of at least bfloat16)")
        if best != i:
            raise ContractError(f"vLLM capture of layer id {i}", f"closest to our layer {best} "
                                f"(typical relative error {rel[best]:.3g}; {rel[i]:.3g} against layer {i})",
                                f"layer {i}", "the engine numbers its capture differently from 'input "
                                "to layer i': shift the ids it is launched with by "
                                f"{i - best:+d}, or capture with this project's target instead")
        errors[i] = rel[i]
    return errors


def typical_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """median |a - b| / median |b|: the residual stream's few massive dims (values in the
    thousands, where bf16 rounds by whole units) do not decide it, unlike a max."""
    return float((a - b).abs().median() / b.abs().median().clamp_min(1e-12))


# ---------------------------------------------------------------------------- rows -> features
@torch.inference_mode()
def capture_features(target: LlamaModel, sample: Sample, cap: Capture) -> Features:
    """The store's rows for one conversation: aux as captured, the teacher from the last state."""
    check_tokens(cap, sample)
    hidden = target.norm(cap.last.to(target.norm.weight.dtype))            # [T, Ht]
    return Features(cap.aux, hidden, target.lm_head(hidden).argmax(-1))


def capture_source(target: LlamaModel, captures: Sequence[str | Path], aux_layer_ids: Sequence[int],
                   layer_ids: Optional[Sequence[int]] = None, verify: bool = True):
    """A `features=` function for store.build_part: conversation i's rows from captures[i]. The
    first file's layer ids are checked against the target (and numerically with `verify`)."""
    num_layers = target.config.num_layers
    checked = []

    def features(start: int, part: Sequence[Sample]) -> list[Features]:
        if start + len(part) > len(captures):
            raise ContractError("captures", f"{len(captures)} files", f"one per conversation "
                                f"({start + len(part)} at least)", "capture every conversation")
        out = []
        for k, sample in enumerate(part):
            cap = read_capture(captures[start + k], num_layers, layer_ids)
            check_layer_ids(cap, target, aux_layer_ids)
            if verify and not checked:
                check_tokens(cap, sample)
                checked.append(check_numbering(target, sample, cap, aux_layer_ids))
            out.append(capture_features(target, sample, cap))
        return out
    return features


# ---------------------------------------------------------------------------- running vLLM
def run_vllm_capture(python: Path, env: dict[str, str], model_dir: Path, prompts: Sequence[Sequence[int]],
                     layer_ids: Sequence[int], out_dir: Path, dtype: str = "bfloat16",
                     max_model_len: int = 2048, enforce_eager: bool = True,
                     connector: Optional[dict] = None, log_path: Optional[Path] = None,
                     skip_tokenizer_init: bool = False) -> list[Path]:
    """Prefill `prompts` in vLLM (the venv of `python`, `env` from bench.vllm_peer.child_env) with
    our connector; the capture files in prompt order. A failed run raises with the log's tail."""
    out_dir = out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    job = {"model": str(model_dir), "layer_ids": list(layer_ids), "prompts": [list(map(int, p)) for p in prompts],
           "out_dir": str(out_dir), "dtype": dtype, "max_model_len": max_model_len,
           "enforce_eager": enforce_eager, "seed": 0, "connector": connector,
           "skip_tokenizer_init": skip_tokenizer_init}
    (out_dir / "job.json").write_text(json.dumps(job))
    log_path = log_path or out_dir / "vllm.log"
    env = {**env, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    with open(log_path, "w") as log:
        rc = subprocess.run([str(python), str(CHILD_SCRIPT), str(out_dir / "job.json")], env=env,
                            stdout=log, stderr=subprocess.STDOUT, cwd=out_dir).returncode
    if rc != 0:
        tail = log_path.read_text(errors="replace")[-3000:]
        raise LoadError(f"vLLM capture failed (exit {rc}); log {log_path}:\n{tail}")
    return read_index(out_dir)


def read_index(out_dir: Path) -> list[Path]:
    """The capture files of a run, in prompt order (index.json written by the child)."""
    path = out_dir / "index.json"
    if not path.is_file():
        raise LoadError(f"{path}: missing (the capture run did not finish)")
    return [Path(e["path"]) for e in sorted(json.loads(path.read_text()), key=lambda e: e["index"])]
