"""Draft checkpoint formats: read four published layouts, write three, never guess silently.

Sources read: SafeAILab/EAGLE eagle/model/cnets.py, cnets1.py, traineagle3/config.json;
sgl-project/SpecForge modeling/draft/llama3_eagle.py, export/to_sglang.py, configs/*-eagle3.json;
sgl-project/sglang srt/models/llama_eagle3.py and the models' set_eagle3_layers_to_capture (+1);
vllm-project/vllm model_executor/models/llama_eagle3.py, transformers_utils/configs/speculators/algos.py,
eagle3_utils.get_eagle3_aux_layers_from_config; vllm-project/speculators models/eagle3/{config,core}.py,
convert/eagle/eagle3_converter.py; llama.cpp conversion/llama.py and src/models/eagle3.cpp as vendored in
llama-cpp-python 0.3.36.

Layouts (markers, layer prefix, where each stores its layer ids and in which numbering) and what each
serving engine reads are one table in eagle3/engines.py. This module reads ids as we do: the top-level
list (input to layer i), the eagle_config list (output of layer i, +1), and when both are stored they
must name the same layers or loading fails; neither -> the defaults 2, L//2, L-3 for the target.
Either layer prefix, midlayer. or layers.0., is read in every EAGLE-3 layout, as vLLM and llama.cpp do.

Embedding: absent in eagle and specforge checkpoints (SpecForge's exporter drops it; EAGLE-1/2 checkpoints
sometimes store it), optional in vllm and speculators (older speculators releases store it).

Variant flags (one table, VARIANT_FLAGS below): each has the value we implement; any other value raises
UnsupportedError naming the flag. `norm_output` means different things: SpecForge default true = final
norm before lm_head (ours), false = no final norm; speculators default false, true = feed the post-norm
hidden back across steps (Eagle 3.1). The Eagle 3.1 switches (`norm_before_fc`, speculators' `norm_output`)
are read and written in the speculators and vLLM layouts, where vLLM >= 0.22 reads them (engines.py);
their norm's weight is `input_norm.weight` there and `pre_fc_norm.weight` in our module.
`norm_before_residual` defaults to false in the speculators library and llama.cpp but to TRUE in
vLLM's speculators reader, so a speculators config without it is ambiguous and is rejected.

Weights: model.safetensors (or a sharded index), else legacy pytorch_model.bin through
torch.load(weights_only=True). Key mapping is strict: an unknown key, a missing key or a shape mismatch
raises naming the key and both shapes. Optional keys and what replaces them:
  embed_tokens.weight -> the target's embedding (attach_target); required when target_hidden_size differs
                         from hidden_size.
  d2t, t2d            -> identity when draft_vocab_size == vocab_size; t2d is derived from d2t (and d2t
                         from t2d, ascending ids) otherwise; both absent with a smaller draft vocab raises.
  lm_head.weight      -> EAGLE-1/2 only: the target's lm_head (attach_target).
  verifier_norm.weight, verifier_lm_head.weight (speculators training-only copies of the target): dropped.
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple, Optional

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..engines import (EAGLE3_ARCHITECTURES, IDS_KEY, LAYOUTS, NESTED_KEY, NESTED_OUTPUT,
                       SPECULATORS_KEY, TOP_INPUT, eagle31_flags, is_speculators)
from ..errors import ContractError, InputError, LoadError, UnsupportedError
from ..models.config import ModelConfig, RopeConfig
from ..models.target import TargetFacts
from ..runtime.loader import read_hf_config, read_safetensors
from .contract import algorithm_mismatch_error, normalize_algorithm
from ..models.layers import Rotary
from .model import DraftBase, DraftConfig, build_draft

WRITABLE_FORMATS = ("specforge", "speculators", "eagle")


def export_format(cfg: DraftConfig) -> str:
    """The layout a trained draft is written in: speculators when it carries the Eagle 3.1 norms
    (the one writable layout that records them), else specforge (SGLang, vLLM and llama.cpp)."""
    return "speculators" if cfg.norm_before_fc or cfg.norm_output else "specforge"

# flag -> {algorithm, format or "*": value we implement}, looked up in that order; a missing flag takes the
# listed value unless marked REQUIRED.
REQUIRED = object()
EAGLE31 = object()          # an Eagle 3.1 switch (speculators' meaning): read into DraftConfig, either value
# the 3.1 norm over the fused features: speculators' and vLLM's weight name -> our module's
EAGLE31_KEYS = {"input_norm.weight": "pre_fc_norm.weight"}
EAGLE31_LAYOUTS = ("speculators", "vllm")
VARIANT_FLAGS: dict[str, dict[str, Any]] = {
    "norm_before_residual": {"*": False, "speculators": REQUIRED},
    "norm_before_fc": {"speculators": EAGLE31, "vllm": EAGLE31, "*": False},
    "fc_norm": {"*": False},
    "norm_output": {"specforge": True, "speculators": EAGLE31, "vllm": EAGLE31, "*": None},
    "bias": {"eagle": True, "*": False},    # bias on fc (SGLang EAGLE-3 reads it; EAGLE-1/2 fc has one)
    "attention_bias": {"*": False},
    "qkv_bias": {"*": False},
    "mlp_bias": {"*": False},
    "tie_word_embeddings": {"*": False},    # SGLang would then use the embedding as lm_head
    "hidden_act": {"*": "silu"},
    "logit_scale": {"*": 1.0},
    "num_hidden_layers": {"*": 1},
    "use_aux_hidden_state": {"*": True},    # eagle_config: false = no fc (hidden fed as is)
    "parallel_drafting": {"*": False},      # P-EAGLE
    "sliding_window": {"*": None},
}
DROPPED_KEYS = {
    "verifier_norm.weight": "speculators training-only copy of the target's final norm",
    "verifier_lm_head.weight": "speculators training-only copy of the target's lm_head",
}


# ---------------------------------------------------------------------------- records
class LayerIds(NamedTuple):
    ids: tuple[int, ...]            # "input to layer i" convention
    convention: str                 # "input" | "output" | "input+output" | "default" | "none"
    source: str                     # where they were read and why that convention
    stored: Optional[tuple[int, ...]]


@dataclass(frozen=True)
class DraftInfo:
    """What a draft checkpoint turned out to be (every choice made while reading it is recorded)."""
    path: str
    format: str                       # eagle | specforge | vllm | speculators
    architecture: str
    algorithm: str                    # eagle3 | eagle
    algorithm_evidence: str
    aux_layer_ids: tuple[int, ...]    # input convention (empty for EAGLE-1/2)
    layer_id_convention: str
    layer_id_source: str
    stored_layer_ids: Optional[tuple[int, ...]]
    embedding_source: str             # "checkpoint" | "target"
    lm_head_source: str               # "checkpoint" | "target" (EAGLE-1/2 without a stored head)
    embedding_attached: bool
    vocab_size: int                   # target vocabulary V
    draft_vocab_size: int
    hidden_size: int
    target_hidden_size: int
    weights_file: str
    notes: tuple[str, ...] = ()


class Inspected(NamedTuple):
    info: DraftInfo
    config: DraftConfig
    layer_prefix: str                 # the checkpoint's prefix for the draft layer


class LoadedDraft(NamedTuple):
    draft: DraftBase
    info: DraftInfo


# ---------------------------------------------------------------------------- files
def weight_files(path: Path) -> tuple[str, list[Path]]:
    """("safetensors" | "bin", files) for a draft directory."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return "safetensors", [path / s for s in shards]
    if (path / "model.safetensors").is_file():
        return "safetensors", [path / "model.safetensors"]
    if (path / "pytorch_model.bin").is_file():
        return "bin", [path / "pytorch_model.bin"]
    raise LoadError(f"{path}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin")


def read_bin(file: Path) -> dict[str, torch.Tensor]:
    """Legacy pickled weights, through torch.load(weights_only=True) only: nothing else is unpickled."""
    try:
        state = torch.load(str(file), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as e:
        raise LoadError(f"{file}: not a plain tensor checkpoint; refused by "
                        f"torch.load(weights_only=True) ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise LoadError(f"{file}: expected a flat dict of tensors (a state_dict)")
    return state


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    kind, files = weight_files(path)
    return read_bin(files[0]) if kind == "bin" else read_safetensors(files)


def read_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor shapes without reading the data (safetensors headers; .bin is loaded)."""
    kind, files = weight_files(path)
    if kind == "bin":
        return {k: tuple(v.shape) for k, v in read_bin(files[0]).items()}
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        try:
            with safe_open(str(f), "pt") as st:
                shapes.update({k: tuple(st.get_slice(k).get_shape()) for k in st.keys()})
        except (SafetensorError, OSError) as e:
            raise LoadError(f"{f}: corrupt or truncated safetensors file ({e})") from None
    return shapes


# ---------------------------------------------------------------------------- config reading
def detect_format(hf: dict) -> tuple[str, str]:
    """(format, architecture) from config.json alone."""
    arch = (hf.get("architectures") or [""])[0]
    if is_speculators(hf):
        kind = hf[SPECULATORS_KEY]
        if kind != "eagle3":
            raise UnsupportedError(f"speculators_model_type {kind!r} is not implemented; "
                                   "supported: 'eagle3' (EAGLE-1/2 drafts load from the EAGLE layout)")
        return "speculators", arch or "Eagle3Speculator"
    if arch in EAGLE3_ARCHITECTURES:
        return EAGLE3_ARCHITECTURES[arch], arch
    if NESTED_KEY in hf:
        return "specforge", arch
    if arch == "LlamaForCausalLM" and hf.get("num_hidden_layers") == 1:
        return "eagle", arch
    raise UnsupportedError(
        f"architectures {arch!r}: not a draft layout this project reads (EAGLE LlamaForCausalLM with 1 "
        "layer, SpecForge/SGLang LlamaForCausalLMEagle3, vLLM Eagle3LlamaForCausalLM, speculators "
        "Eagle3Speculator). Other families (Qwen3/gpt-oss/DeepSeek draft layers) are not implemented.")


def layer_config(hf: dict, fmt: str) -> dict:
    """The flat Llama hyper-parameters of the draft layer (speculators nest them)."""
    if fmt != "speculators":
        return hf
    inner = hf.get("transformer_layer_config")
    if not isinstance(inner, dict):
        raise LoadError("speculators config: transformer_layer_config missing or not a dict")
    if inner.get("model_type", "llama") != "llama":
        raise UnsupportedError(f"transformer_layer_config.model_type {inner['model_type']!r}: only "
                               "'llama' draft layers are implemented (qwen3 adds q/k norms)")
    return {**inner, **{k: v for k, v in hf.items() if k != "transformer_layer_config"}}


def check_flags(hp: dict, fmt: str, algo: str) -> None:
    """Every known variant flag must hold the value we implement; none is ignored."""
    sources = [hp, hp.get(NESTED_KEY) or {}]
    for flag, rule in VARIANT_FLAGS.items():
        want = rule.get(algo, rule.get(fmt, rule["*"]))
        found = [s[flag] for s in sources if flag in s]
        if not found:
            if want is REQUIRED:
                raise LoadError(
                    f"{flag} is missing from this {fmt} config, and the readers disagree on its default "
                    "(speculators library and llama.cpp: false; vLLM: true). Write it explicitly.")
            continue
        if want is REQUIRED:
            want = rule["*"]
        if want is EAGLE31:
            if any(not isinstance(v, bool) for v in found) or len(set(found)) > 1:
                raise LoadError(f"{flag}: expected one boolean, found {found} ({fmt} layout)")
            continue
        for value in found:
            if value != want and not (want is None and value in (None, False)):
                raise UnsupportedError(f"draft config flag {flag}={value!r} ({fmt} layout) is not "
                                       f"implemented; this project implements {flag}={want!r}")


def resolve_layer_ids(hp: dict, num_aux: int, target: Optional[ModelConfig]) -> LayerIds:
    """Find the stored ids, detect their numbering, and return them in the INPUT convention."""
    top, nested = TOP_INPUT.stored(hp), NESTED_OUTPUT.stored(hp)
    if nested is not None and top is not None:
        if NESTED_OUTPUT.as_input(nested) != top:
            raise ContractError(
                IDS_KEY, f"top-level {list(top)} (input to layer i)",
                f"eagle_config + 1 = {list(NESTED_OUTPUT.as_input(nested))}",
                "the two stored id lists name different layers: SGLang reads eagle_config, vLLM and "
                "llama.cpp read the top level. Re-export the draft with the ids it was trained on")
        return LayerIds(top, "input+output", f"top-level {list(top)} (input to layer i; vLLM, "
                        f"llama.cpp) agrees with eagle_config {list(nested)} (output of layer i; "
                        "SGLang/SpecForge, +1)", top)
    if nested is not None:
        ids = NESTED_OUTPUT.as_input(nested)
        return LayerIds(ids, "output", f"{NESTED_OUTPUT.label} {list(nested)}: SpecForge/SGLang "
                        f"'output of layer i' numbering, +1 -> input ids {list(ids)}", nested)
    if top is not None:
        return LayerIds(top, "input", f"{TOP_INPUT.label} {list(top)}: vLLM/speculators/"
                        "llama.cpp 'input to layer i' numbering, used as is", top)
    return default_ids(num_aux, target)


def default_ids(num_aux: int, target: Optional[ModelConfig]) -> LayerIds:
    if target is None:
        raise LoadError("this draft stores no aux layer ids; pass the target config so the defaults "
                        "2, L//2, L-3 can be computed from the target's layer count L")
    ids = tuple(target.default_aux_layer_ids)
    if num_aux != len(ids):
        raise ContractError("fc.weight input width", f"{num_aux} target states",
                            f"{len(ids)} (the default ids {list(ids)})",
                            "the draft fuses a non-default number of states but stores no layer ids; "
                            f"add {IDS_KEY} (input to layer i) to its config.json")
    return LayerIds(ids, "default", f"no ids stored: the default 2, L//2, L-3 for L={target.num_layers}"
                    f" -> {list(ids)}", None)


# ---------------------------------------------------------------------------- algorithm
def layer_prefix(shapes: dict, fmt: str) -> str:
    found = [p for p in ("midlayer.", "layers.0.") if f"{p}self_attn.q_proj.weight" in shapes]
    if len(found) != 1:
        raise LoadError(f"{fmt} checkpoint: expected exactly one of midlayer.* / layers.0.* with "
                        f"self_attn.q_proj.weight, found {found or 'neither'}")
    return found[0]


def detect_algorithm(hp: dict, fmt: str, shapes: dict) -> tuple[str, str]:
    """("eagle3" | "eagle", evidence) from the weight shapes, cross-checked with the config markers."""
    hidden = int(hp["hidden_size"])
    prefix = layer_prefix(shapes, fmt)
    q_in = shapes[f"{prefix}self_attn.q_proj.weight"][1]
    has_hidden_norm = f"{prefix}hidden_norm.weight" in shapes
    if "fc.weight" not in shapes:
        raise LoadError(f"{fmt} checkpoint: no fc.weight (every EAGLE draft has one)")
    fc_in = shapes["fc.weight"][1]
    if q_in == 2 * hidden and has_hidden_norm:
        algo = "eagle3"
        evidence = (f"attention reads 2H={q_in} (cat(embedding, hidden)) with hidden_norm; fc fuses "
                    f"{fc_in} features")
    elif q_in == hidden and not has_hidden_norm and fc_in == 2 * hidden:
        algo, evidence = "eagle", f"fc is 2H->H ({fc_in}->{hidden}) over cat(embedding, hidden)"
    else:
        raise LoadError(f"{fmt} checkpoint: q_proj input {q_in}, hidden_norm {has_hidden_norm}, fc input "
                        f"{fc_in} match neither EAGLE-3 (2H, hidden_norm) nor EAGLE-1/2 (H, fc 2H)")
    marker = fmt != "eagle" or "draft_vocab_size" in hp
    if marker and algo != "eagle3":
        raise LoadError(f"{fmt} config marks an EAGLE-3 draft but the weights are EAGLE-1/2 ({evidence})")
    return algo, evidence


# ---------------------------------------------------------------------------- DraftConfig
def eagle31_of(hp: dict, fmt: str) -> dict[str, bool]:
    """norm_before_fc / norm_output, read as vLLM reads them, in the layouts that carry them; every
    other layout implements only False (check_flags)."""
    return eagle31_flags(hp) if fmt in EAGLE31_LAYOUTS else {}


def draft_config(hp: dict, algo: str, ids: LayerIds, fmt: str = "") -> DraftConfig:
    hidden = int(hp["hidden_size"])
    heads = int(hp["num_attention_heads"])
    vocab = int(hp["vocab_size"])
    return DraftConfig(
        algorithm=algo, hidden_size=hidden,
        target_hidden_size=int(hp.get("target_hidden_size") or hidden),
        num_heads=heads, num_kv_heads=int(hp.get("num_key_value_heads") or heads),
        head_dim=int(hp.get("head_dim") or hidden // heads),
        intermediate_size=int(hp["intermediate_size"]),
        rms_norm_eps=float(hp.get("rms_norm_eps", 1e-6)), rope=RopeConfig.from_hf(hp),
        max_position=int(hp.get("max_position_embeddings", 2048)), vocab_size=vocab,
        draft_vocab_size=int(hp.get("draft_vocab_size") or vocab) if algo == "eagle3" else vocab,
        aux_layer_ids=ids.ids, **eagle31_of(hp, fmt))


def check_fc_width(cfg: DraftConfig, shapes: dict, ids: LayerIds) -> None:
    if cfg.algorithm != "eagle3":
        return
    found = shapes["fc.weight"][1]
    if found != cfg.fc_in_features:
        raise ContractError(
            "fc.weight input width", found,
            f"{len(cfg.aux_layer_ids)} layers x target_hidden_size {cfg.target_hidden_size} = "
            f"{cfg.fc_in_features}",
            f"the config's layer ids {list(cfg.aux_layer_ids)} ({ids.convention}) do not match what fc "
            f"was trained on ({found // max(cfg.target_hidden_size, 1)} states); fix the ids or "
            "target_hidden_size in config.json")


def check_embedding_rule(cfg: DraftConfig, shapes: dict) -> str:
    if "embed_tokens.weight" in shapes:
        return "checkpoint"
    if cfg.target_hidden_size != cfg.hidden_size:
        raise UnsupportedError(
            f"target_hidden_size={cfg.target_hidden_size} != hidden_size={cfg.hidden_size} without a "
            "stored embed_tokens.weight: the target's embedding cannot be shared; only drafts that ship "
            "their own embedding are implemented for this case")
    return "target"


def head_source(cfg: DraftConfig, shapes: dict) -> str:
    if "lm_head.weight" in shapes:
        return "checkpoint"
    if cfg.algorithm == "eagle3":
        raise LoadError("missing key 'lm_head.weight': an EAGLE-3 draft has its own draft-vocabulary "
                        "head (borrowing the target's, as SGLang does without draft_vocab_size, is not "
                        "implemented)")
    return "target"


# ---------------------------------------------------------------------------- inspect (no tensors)
class Header(NamedTuple):
    path: Path
    format: str
    architecture: str
    hp: dict                          # flat Llama hyper-parameters + EAGLE fields
    shapes: dict[str, tuple[int, ...]]


def read_header(path: str | os.PathLike) -> Header:
    path = Path(path)
    if not (path / "config.json").is_file():
        raise LoadError(f"{path}: not a draft directory (no config.json)")
    hf = read_hf_config(path)
    fmt, arch = detect_format(hf)
    return Header(path, fmt, arch, layer_config(hf, fmt), read_shapes(path))


def layer_ids_for(head: Header, algo: str, target: Optional[ModelConfig]) -> tuple[LayerIds, list[str]]:
    if algo != "eagle3":
        return LayerIds((), "none", "EAGLE-1/2 reads the target's last hidden state only", None), []
    hidden_t = int(head.hp.get("target_hidden_size") or head.hp["hidden_size"])
    ids = resolve_layer_ids(head.hp, head.shapes["fc.weight"][1] // hidden_t, target)
    return ids, off_by_one_notes(ids, target)


def inspect_draft(path: str | os.PathLike, target_config: Optional[ModelConfig] = None,
                  algorithm: Optional[str] = None) -> Inspected:
    """Read config.json and tensor shapes (no weights): what the draft is, and its DraftConfig."""
    head = read_header(path)
    algo, evidence = detect_algorithm(head.hp, head.format, head.shapes)
    if algorithm is not None and normalize_algorithm(algorithm) != algo:
        raise algorithm_mismatch_error(normalize_algorithm(algorithm), algo)
    check_flags(head.hp, head.format, algo)
    ids, notes = layer_ids_for(head, algo, target_config)
    cfg = draft_config(head.hp, algo, ids, head.format)
    check_fc_width(cfg, head.shapes, ids)
    info = DraftInfo(
        path=str(head.path), format=head.format, architecture=head.architecture, algorithm=algo,
        algorithm_evidence=evidence, aux_layer_ids=cfg.aux_layer_ids,
        layer_id_convention=ids.convention, layer_id_source=ids.source, stored_layer_ids=ids.stored,
        embedding_source=check_embedding_rule(cfg, head.shapes),
        lm_head_source=head_source(cfg, head.shapes), embedding_attached=False,
        vocab_size=cfg.vocab_size, draft_vocab_size=cfg.draft_vocab_size,
        hidden_size=cfg.hidden_size, target_hidden_size=cfg.target_hidden_size,
        weights_file=weight_files(head.path)[1][0].name, notes=tuple(notes))
    return Inspected(info, cfg, layer_prefix(head.shapes, head.format))


def off_by_one_notes(ids: LayerIds, target: Optional[ModelConfig]) -> list[str]:
    """A stored id list equal to the OTHER convention's defaults is the classic off-by-one."""
    if target is None or ids.stored is None:
        return []
    input_defaults = tuple(target.default_aux_layer_ids)
    if ids.convention == "output" and ids.stored == input_defaults:
        return [f"eagle_config ids {list(ids.stored)} equal the INPUT-convention defaults; read as "
                f"output ids they capture {list(ids.ids)}. If the draft was trained on the defaults, "
                f"its eagle_config should read {NESTED_OUTPUT.as_stored(input_defaults)}"]
    if ids.convention == "input" and ids.stored == tuple(NESTED_OUTPUT.as_stored(input_defaults)):
        return [f"top-level ids {list(ids.stored)} equal the OUTPUT-convention defaults; read as input "
                f"ids they capture one layer early. Defaults as input ids are {list(input_defaults)}"]
    return []


# ---------------------------------------------------------------------------- load
def module_state(state: dict[str, torch.Tensor], prefix: str, algo: str) -> dict[str, torch.Tensor]:
    """Checkpoint keys -> module keys (EAGLE-3: <prefix>* -> midlayer.*); dropped keys removed."""
    out = {}
    for key, tensor in state.items():
        if key in DROPPED_KEYS:
            continue
        if algo == "eagle3" and key.startswith(prefix):
            key = "midlayer." + key[len(prefix):]
        out[EAGLE31_KEYS.get(key, key)] = tensor
    return out


def vocab_buffers(state: dict, cfg: DraftConfig, notes: list[str]) -> None:
    """Fill in d2t / t2d when the checkpoint omits one or both (see the module docstring)."""
    vocab, draft_vocab = cfg.vocab_size, cfg.draft_vocab_size
    if "d2t" not in state and "t2d" in state:
        used = state["t2d"].bool().nonzero().flatten()
        state["d2t"] = used - torch.arange(used.numel())
        notes.append("d2t derived from t2d (draft ids = target ids in ascending order)")
    if "d2t" not in state:
        if draft_vocab != vocab:
            raise LoadError(f"draft_vocab_size {draft_vocab} < vocab_size {vocab} but the checkpoint has "
                            "neither d2t nor t2d: the draft ids cannot be mapped to target ids")
        state["d2t"] = torch.zeros(draft_vocab, dtype=torch.long)
        notes.append("no d2t: identity mapping (draft vocabulary == target vocabulary)")
    if "t2d" not in state:
        targets = torch.arange(state["d2t"].numel()) + state["d2t"].long()
        valid = targets[(targets >= 0) & (targets < vocab)]  # the contract reports the others
        state["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, valid, True)
        notes.append("t2d derived from d2t")
    state["d2t"], state["t2d"] = state["d2t"].long(), state["t2d"].bool()


def load_strict(draft: DraftBase, state: dict[str, torch.Tensor]) -> None:
    """Every checkpoint key must be a module key of the same shape, and every module key present."""
    want = draft.state_dict()
    for key, tensor in state.items():
        if key not in want:
            raise LoadError(f"unexpected key {key!r} (shape {tuple(tensor.shape)}) in the draft "
                            f"checkpoint; this {draft.config.algorithm} draft has no such weight")
        if tuple(tensor.shape) != tuple(want[key].shape):
            raise LoadError(f"shape mismatch for {key!r}: checkpoint {tuple(tensor.shape)}, draft "
                            f"config expects {tuple(want[key].shape)}")
    missing = [k for k in want if k not in state]
    if missing:
        raise LoadError(f"missing key(s) in the draft checkpoint: {missing[:6]}"
                        f"{' ...' if len(missing) > 6 else ''}")
    draft.load_state_dict({k: v.to(want[k].dtype) for k, v in state.items()}, strict=True)


def optional_keys(state: dict, info: DraftInfo, draft: DraftBase) -> None:
    """Weights that legitimately come from the target: zero placeholders until attach_target."""
    own = draft.state_dict()
    if info.embedding_source == "target":
        state["embed_tokens.weight"] = torch.zeros_like(own["embed_tokens.weight"])
    if info.lm_head_source == "target":
        state["lm_head.weight"] = torch.zeros_like(own["lm_head.weight"])


def empty_draft(cfg: DraftConfig) -> DraftBase:
    """The module without its random init (every weight is loaded next); rotary tables rebuilt."""
    with torch.device("meta"):
        draft = build_draft(cfg)
    draft = draft.to_empty(device="cpu")
    draft.rotary = Rotary(cfg.rope, cfg.head_dim, cfg.max_position)
    return draft


def load_draft(path: str | os.PathLike, target_config: Optional[ModelConfig] = None,
               algorithm: Optional[str] = None, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32, target: Optional[torch.nn.Module] = None
               ) -> LoadedDraft:
    """Load a draft in any supported layout. `algorithm` (a user flag) must agree with the checkpoint.

    The embedding (and an EAGLE-1/2 lm_head) comes from the target unless the checkpoint stores it:
    pass `target=` (a LlamaModel) to attach it here, or call attach_target() later. Check
    `info.embedding_attached` before running a draft whose embedding_source is "target".
    """
    if target is not None and target_config is None:
        target_config = target.config
    info, cfg, prefix = inspect_draft(path, target_config, algorithm)
    state = read_weights(Path(path))
    state = module_state(state, prefix, cfg.algorithm)
    draft = empty_draft(cfg)
    notes = list(info.notes)
    vocab_buffers(state, cfg, notes)
    optional_keys(state, info, draft)
    load_strict(draft, state)
    draft = draft.to(device=device, dtype=dtype).eval()
    loaded = LoadedDraft(draft, replace(info, notes=tuple(notes)))
    return attach_target(loaded, target) if target is not None else loaded


def attach_target(loaded: LoadedDraft, target: torch.nn.Module) -> LoadedDraft:
    """Share the target's embedding (and EAGLE-1/2 lm_head) when the checkpoint does not store them."""
    draft, info = loaded
    if info.embedding_source == "target":
        draft.set_embedding(target.embed_tokens.weight)
    if info.lm_head_source == "target":
        draft.set_lm_head(target.lm_head.weight)
    return LoadedDraft(draft, replace(info, embedding_attached=True))


# ---------------------------------------------------------------------------- save
def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def rope_fields(rope: RopeConfig) -> dict:
    out: dict[str, Any] = {"rope_theta": rope.theta, "rope_scaling": None}
    if rope.scaling_type == "linear":
        out["rope_scaling"] = {"rope_type": "linear", "factor": rope.factor}
    elif rope.scaling_type == "llama3":
        out["rope_scaling"] = {"rope_type": "llama3", "factor": rope.factor,
                               "low_freq_factor": rope.low_freq_factor,
                               "high_freq_factor": rope.high_freq_factor,
                               "original_max_position_embeddings": rope.original_max_position}
    return out


def llama_fields(cfg: DraftConfig, dtype: torch.dtype) -> dict:
    """The one-layer Llama config every layout carries (flat or nested)."""
    return {"model_type": "llama", "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size, "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
            "num_hidden_layers": 1, "rms_norm_eps": cfg.rms_norm_eps, "vocab_size": cfg.vocab_size,
            "max_position_embeddings": cfg.max_position, "hidden_act": "silu",
            "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
            "torch_dtype": dtype_name(dtype), **rope_fields(cfg.rope)}


def as_facts(target: TargetFacts | ModelConfig | None) -> Optional[TargetFacts]:
    if target is None or isinstance(target, TargetFacts):
        return target
    return TargetFacts.of(target)


def ids_are_default(cfg: DraftConfig, target: Optional[TargetFacts]) -> Optional[bool]:
    if target is None:
        return None
    return tuple(cfg.aux_layer_ids) == tuple(target.default_aux_layer_ids)


def write_ids(hf: dict, fmt: str, ids: tuple[int, ...]) -> dict:
    """The ids in every place (and numbering) that an engine serving this layout reads first."""
    for slot in LAYOUTS[fmt].writes:
        slot.write(hf, ids)
    return hf


def specforge_config(cfg: DraftConfig, dtype: torch.dtype, target: Optional[TargetFacts]) -> dict:
    hf = {"architectures": [LAYOUTS["specforge"].architecture], **llama_fields(cfg, dtype),
          "draft_vocab_size": cfg.draft_vocab_size, NESTED_KEY: {"use_aux_hidden_state": True}}
    if cfg.target_hidden_size != cfg.hidden_size:
        hf["target_hidden_size"] = cfg.target_hidden_size
    return write_ids(hf, "specforge", cfg.aux_layer_ids)


def speculators_config(cfg: DraftConfig, dtype: torch.dtype, target: Optional[TargetFacts],
                       speculative_tokens: int) -> dict:
    verifier = {"name_or_path": target.path if target else None,
                "architectures": [target.architecture] if target and target.architecture else []}
    hf = {"architectures": [LAYOUTS["speculators"].architecture], SPECULATORS_KEY: "eagle3",
            "transformer_layer_config": llama_fields(cfg, dtype),
            "draft_vocab_size": cfg.draft_vocab_size, "norm_before_residual": False,
            "norm_before_fc": cfg.norm_before_fc, "fc_norm": False, "norm_output": cfg.norm_output,
            "target_hidden_size": (cfg.target_hidden_size
                                   if cfg.target_hidden_size != cfg.hidden_size else None),
            "torch_dtype": dtype_name(dtype),
            "speculators_config": {
                "algorithm": "eagle3", "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy",
                                      "speculative_tokens": speculative_tokens}],
                "verifier": verifier}}
    return write_ids(hf, "speculators", cfg.aux_layer_ids)


def eagle_config(cfg: DraftConfig, dtype: torch.dtype, target: Optional[TargetFacts]) -> dict:
    hf = {"architectures": [LAYOUTS["eagle"].architecture], **llama_fields(cfg, dtype)}
    if cfg.algorithm == "eagle":
        return hf
    if cfg.target_hidden_size != cfg.hidden_size:
        hf["target_hidden_size"] = cfg.target_hidden_size
    if ids_are_default(cfg, target) is not True:
        raise UnsupportedError(
            f"the EAGLE reference layout cannot record layer ids (its code hard-codes 2, L//2, L-3); "
            f"this draft uses {list(cfg.aux_layer_ids)}"
            + ("" if target else " and no target_info was given to confirm they are the defaults")
            + ". Save it as specforge or speculators instead")
    return {**hf, "draft_vocab_size": cfg.draft_vocab_size}


def checkpoint_state(draft: DraftBase, fmt: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Module keys -> this layout's keys; the target's shared weights are left out."""
    cfg = draft.config
    out = {}
    for key, tensor in draft.state_dict().items():
        if key == "embed_tokens.weight" and cfg.target_hidden_size == cfg.hidden_size:
            continue  # shared with the target (stored only when the widths differ)
        if cfg.algorithm == "eagle" and key in ("lm_head.weight", "d2t", "t2d"):
            continue  # EAGLE-1/2 use the target's head and vocabulary
        prefix = LAYOUTS[fmt].layer_prefix
        if key.startswith("midlayer.") and prefix != "midlayer.":
            key = prefix + key[len("midlayer."):]
        key = {ours: theirs for theirs, ours in EAGLE31_KEYS.items()}.get(key, key)
        out[key] = tensor.detach().to("cpu", dtype if tensor.is_floating_point() else tensor.dtype)
    return {k: v.contiguous() for k, v in out.items()}


def save_draft(draft: DraftBase, out_dir: str | os.PathLike, fmt: str = "specforge",
               target_info: TargetFacts | ModelConfig | None = None, *, speculative_tokens: int = 3,
               dtype: Optional[torch.dtype] = None, legacy_bin: bool = False) -> Path:
    """Write `draft` as a specforge | speculators | eagle directory (atomically); return its path."""
    if fmt not in WRITABLE_FORMATS:
        raise InputError(f"format {fmt!r}: choose one of {', '.join(WRITABLE_FORMATS)}")
    cfg = draft.config
    if cfg.algorithm == "eagle" and fmt != "eagle":
        raise UnsupportedError(f"{fmt} is an EAGLE-3 layout; EAGLE-1/2 drafts are saved as 'eagle'")
    if cfg.num_layers != 1:
        raise UnsupportedError(
            f"this draft has num_layers={cfg.num_layers} (draft_layers): every export layout and "
            "engine runs one; train with draft_layers = 1 to export")
    if (cfg.norm_before_fc or cfg.norm_output) and fmt not in EAGLE31_LAYOUTS:
        raise UnsupportedError(
            f"this draft was trained with the Eagle 3.1 norms (norm_before_fc={cfg.norm_before_fc}, "
            f"norm_output={cfg.norm_output}); the {fmt} layout cannot carry them (SpecForge's "
            "norm_output means the final norm, and SGLang / llama.cpp do not run them). Save it "
            "as speculators (served by vLLM >= 0.22), or train without the norms")
    target = as_facts(target_info)
    dtype = dtype or draft.fc.weight.dtype
    hf = {"specforge": lambda: specforge_config(cfg, dtype, target),
          "speculators": lambda: speculators_config(cfg, dtype, target, speculative_tokens),
          "eagle": lambda: eagle_config(cfg, dtype, target)}[fmt]()
    return write_dir(Path(out_dir), hf, checkpoint_state(draft, fmt, dtype), legacy_bin)


def write_dir(out: Path, hf: dict, state: dict[str, torch.Tensor], legacy_bin: bool) -> Path:
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    if legacy_bin:
        torch.save(state, tmp / "pytorch_model.bin")
    else:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out
