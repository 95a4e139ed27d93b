"""The target/draft contract, checked where a draft meets its target.

Each check compares one field of the pair and yields an eagle3.checks.Check (pass | warn | fail) that
carries the field, the value found, the value expected and the fix. `run_checks` returns them all (for `eagle3 doctor`);
`check_pair` raises the first error as a ContractError and returns the warnings.

| check        | rule                                                                                   |
|--------------|----------------------------------------------------------------------------------------|
| algorithm    | a user flag (--algorithm) must equal the algorithm read from the checkpoint             |
| hidden       | draft target_hidden_size == target hidden; draft hidden == target hidden when the       |
|              | embedding is shared                                                                    |
| fc width     | EAGLE-3: fc input == len(aux_layer_ids) x target hidden; EAGLE-1/2: fc input == 2H      |
| layer ids    | EAGLE-3: non-empty, each in [0, L-1] ("input to layer i"), distinct, ascending          |
| vocab        | draft vocab_size == target V; Vd <= V; lm_head rows == Vd; every draft id + d2t[id] in  |
|              | [0, V) and distinct; t2d is [V], marks exactly those ids                                |
| attention    | head_dim even, heads divisible by kv heads; rope theta and max position vs the target   |
| embedding    | a draft that shares the target's embedding must have it attached                       |

The runtime half of the contract (the width of what reaches fc, asserted every step) lives in
DraftBase.check_features (draft.py): the silent skip of fc behind the zero-acceptance incident cannot happen.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Protocol

import torch

from ..checks import Check, compared, from_error
from ..engines import IDS_KEY, SGLANG, VLLM
from ..errors import ContractError, InputError
from ..models.config import ModelConfig

if TYPE_CHECKING:
    from .model import DraftBase


class EmbeddingInfo(Protocol):
    """What the contract reads of a checkpoint's inspection (formats.DraftInfo has it)."""
    embedding_source: str        # "target" | "checkpoint"
    embedding_attached: bool

ALGORITHM_NAMES = {"eagle3": "eagle3", "eagle-3": "eagle3", "eagle_3": "eagle3",
                   "eagle": "eagle", "eagle1": "eagle", "eagle2": "eagle", "eagle-1": "eagle",
                   "eagle-2": "eagle"}


def engine_flags(algorithm: str) -> str:
    """How each place names `algorithm` ("eagle3" | "eagle"): our flag, SGLang's, vLLM's."""
    return (f"--algorithm {algorithm.upper()} (SGLang: {SGLANG.method_option} "
            f"{SGLANG.methods[algorithm]}; vLLM: method {VLLM.methods[algorithm]})")


def normalize_algorithm(name: str) -> str:
    key = name.strip().lower()
    if key not in ALGORITHM_NAMES:
        raise InputError(f"algorithm {name!r}: use EAGLE3 or EAGLE (EAGLE-1/2)")
    return ALGORITHM_NAMES[key]


def algorithm_mismatch_error(requested: str, found: str) -> ContractError:
    """The zero-acceptance incident and its mirror image, as an error that names the flag to use."""
    why = {
        "eagle3": "this EAGLE-3 draft fuses several captured target layers through fc; run as EAGLE it "
                  "gets one hidden state, and an engine that skips fc on a width mismatch accepts "
                  "nothing without an error (the zero-acceptance incident)",
        "eagle": "this EAGLE-1/2 draft reads only the target's last hidden state; it has no fc over "
                 "captured layers and cannot run as EAGLE-3",
    }[found]
    return ContractError("algorithm", requested.upper(), found.upper(),
                         f"use {engine_flags(found)}. {why}")


def ok(name: str, field: str, value: Any) -> Check:
    return compared(name, True, field, value, value, "")


# ---------------------------------------------------------------------------- individual checks
def check_algorithm(draft: "DraftBase", algorithm: Optional[str]) -> list[Check]:
    found = draft.config.algorithm
    if algorithm is None:
        return [ok("algorithm", "algorithm", found.upper())]
    requested = normalize_algorithm(algorithm)
    if requested == found:
        return [ok("algorithm", "algorithm", found.upper())]
    err = algorithm_mismatch_error(requested, found)
    return [from_error("algorithm", err)]


def check_hidden(target: ModelConfig, draft: "DraftBase", info: Optional["EmbeddingInfo"]) -> list[Check]:
    cfg = draft.config
    out = [compared("hidden", cfg.target_hidden_size == target.hidden_size, "target_hidden_size",
                   cfg.target_hidden_size, target.hidden_size,
                   "this draft reads features of another width: it was trained for another target")]
    if info is not None and info.embedding_source == "target":
        out.append(compared("hidden", cfg.hidden_size == target.hidden_size, "hidden_size",
                           cfg.hidden_size, target.hidden_size,
                           "a draft that shares the target's embedding must be as wide as the target"))
    return out


def check_fc(target: ModelConfig, draft: "DraftBase") -> list[Check]:
    cfg, found = draft.config, draft.fc.weight.shape[1]
    if cfg.algorithm == "eagle":
        return [compared("fc width", found == 2 * cfg.hidden_size, "fc.weight input width", found,
                        2 * cfg.hidden_size, "an EAGLE-1/2 fc reads cat(embedding, hidden)")]
    ids = list(cfg.aux_layer_ids)
    want = len(ids) * target.hidden_size
    return [compared("fc width", found == want, "fc.weight input width", found,
                    f"{len(ids)} captured layers {ids} x target hidden {target.hidden_size} = {want}",
                    f"the draft's fc fuses {found // max(target.hidden_size, 1)} states of width "
                    f"{target.hidden_size}; capture exactly the layers it was trained on (set its "
                    f"{IDS_KEY}) and pair it with its own target")]


def check_layer_ids(target: ModelConfig, draft: "DraftBase") -> list[Check]:
    cfg = draft.config
    if cfg.algorithm == "eagle":
        return [ok("layer ids", "aux_layer_ids", "none (EAGLE-1/2 reads the last hidden state)")]
    ids, n = list(cfg.aux_layer_ids), target.num_layers
    defaults = list(target.default_aux_layer_ids)
    out = [
        compared("layer ids", bool(ids) and all(0 <= i < n for i in ids), "aux_layer_ids", ids,
                f"ids in [0, {n - 1}] ('input to layer i')",
                f"this target has {n} layers; its default ids are {defaults}. Ids read from an "
                "eagle_config are output-of-layer ids (+1 on load); a draft for a deeper target "
                "does not fit this one"),
        compared("layer ids", len(set(ids)) == len(ids) and ids == sorted(ids), "aux_layer_ids order",
                ids, "distinct, ascending", "list each captured layer once, low to high"),
    ]
    if len(ids) != 3:
        out.append(compared("layer ids", False, "aux_layer_ids count", len(ids), 3,
                            "SGLang (fc = 3 x Ht) and llama.cpp (exactly 3 extract layers) serve only "
                            "3-layer drafts; vLLM and this project read any count", bad="warn"))
    return out


def vocab_map_checks(target: ModelConfig, draft: "DraftBase") -> list[Check]:
    cfg, vocab = draft.config, target.vocab_size
    d2t, t2d = draft.d2t.detach().cpu().long(), draft.t2d.detach().cpu().bool()
    targets = torch.arange(d2t.numel()) + d2t
    in_range = bool(((targets >= 0) & (targets < vocab)).all())
    out = [
        compared("vocab", tuple(d2t.shape) == (cfg.draft_vocab_size,), "d2t shape", tuple(d2t.shape),
                (cfg.draft_vocab_size,), "d2t has one offset per draft id"),
        compared("vocab", in_range, "d2t targets (draft_id + d2t[draft_id])",
                f"[{int(targets.min())}, {int(targets.max())}]" if targets.numel() else "[]",
                f"[0, {vocab - 1}]", "d2t maps into another vocabulary: the draft was built for "
                "another target"),
        compared("vocab", targets.unique().numel() == targets.numel(), "d2t targets distinct",
                targets.numel() - targets.unique().numel(), 0, "two draft ids map to one target id; "
                "rebuild d2t from the sorted draft vocabulary"),
    ]
    if tuple(t2d.shape) != (vocab,):
        return out + [compared("vocab", False, "t2d shape", tuple(t2d.shape), (vocab,),
                               "t2d is a mask over the target vocabulary")]
    marked = bool(t2d[targets.clamp(0, vocab - 1)].all()) and int(t2d.sum()) == targets.numel()
    return out + [compared("vocab", marked and in_range, "t2d", f"{int(t2d.sum())} ids marked",
                          f"exactly the {targets.numel()} d2t targets",
                          "t2d and d2t disagree; derive t2d from d2t")]


def check_vocab(target: ModelConfig, draft: "DraftBase") -> list[Check]:
    cfg, vocab = draft.config, target.vocab_size
    head_rows = draft.lm_head.weight.shape[0]
    want_rows = cfg.draft_vocab_size if cfg.algorithm == "eagle3" else vocab
    out = [
        compared("vocab", cfg.vocab_size == vocab, "vocab_size", cfg.vocab_size, vocab,
                f"this draft was built for a target with a {cfg.vocab_size}-token vocabulary; pair "
                "it with that target (or retrain it for this one)"),
        compared("vocab", cfg.draft_vocab_size <= vocab, "draft_vocab_size", cfg.draft_vocab_size,
                f"<= {vocab}", "the draft vocabulary must be a subset of the target's"),
        compared("vocab", head_rows == want_rows, "lm_head rows", head_rows, want_rows,
                "lm_head must have one row per draft-vocabulary id"),
    ]
    if cfg.vocab_size != vocab:
        return out  # the map checks below would only repeat the same mismatch
    return out + vocab_map_checks(target, draft)


def check_attention(target: ModelConfig, draft: "DraftBase") -> list[Check]:
    cfg = draft.config
    return [
        compared("attention", cfg.head_dim % 2 == 0 and cfg.head_dim > 0, "head_dim", cfg.head_dim,
                "a positive even number", "rotary embeddings rotate pairs of dims"),
        compared("attention", cfg.num_kv_heads > 0 and cfg.num_heads % cfg.num_kv_heads == 0,
                "num_heads / num_kv_heads", f"{cfg.num_heads}/{cfg.num_kv_heads}",
                "num_heads divisible by num_kv_heads", "fix num_key_value_heads in config.json"),
        compared("attention", cfg.rope.theta > 0, "rope_theta", cfg.rope.theta, "> 0",
                "fix rope_theta in config.json"),
        compared("attention", cfg.rope == target.rope, "rope", cfg.rope, target.rope,
                "drafts normally share the target's rope settings; check rope_theta/rope_scaling",
                bad="warn"),
        compared("attention", cfg.max_position >= target.max_position, "max_position_embeddings",
                cfg.max_position, f">= {target.max_position} (the target's)",
                "positions past the draft's rotary table raise at run time; raise "
                "max_position_embeddings in the draft config", bad="warn"),
    ]


def check_embedding(draft: "DraftBase", target: Optional[torch.nn.Module],
                    info: Optional["EmbeddingInfo"]) -> list[Check]:
    shared = info is None or info.embedding_source == "target"
    if info is not None and shared and not info.embedding_attached:
        return [compared("embedding", False, "embed_tokens", "not attached", "the target's embedding",
                         "call formats.attach_target(loaded, target) or load_draft(..., target=model)")]
    if target is None or not shared:
        source = info.embedding_source if info else "unknown"
        return [ok("embedding", "embed_tokens source", source)]
    mine, theirs = draft.embed_tokens.weight, target.embed_tokens.weight
    same = mine.shape == theirs.shape and (mine.data_ptr() == theirs.data_ptr()
                                           or torch.equal(mine.detach().cpu(), theirs.detach().cpu()))
    return [compared("embedding", same, "embed_tokens",
                     "the target's embedding" if same else "differs from the target's",
                     "the target's embedding", "the draft shares the target's embedding; attach it")]


# ---------------------------------------------------------------------------- entry points
def run_checks(target_config: ModelConfig, draft: "DraftBase", algorithm: Optional[str] = None,
               target: Optional[torch.nn.Module] = None,
               info: Optional["EmbeddingInfo"] = None) -> list[Check]:
    """Every contract check on a (target, draft) pair, as data: nothing is raised for a failed check."""
    checks = check_algorithm(draft, algorithm) + check_hidden(target_config, draft, info)
    checks += check_fc(target_config, draft) + check_layer_ids(target_config, draft)
    checks += check_vocab(target_config, draft) + check_attention(target_config, draft)
    return checks + check_embedding(draft, target, info)


def check_pair(target_config: ModelConfig, draft: "DraftBase", algorithm: Optional[str] = None,
               target: Optional[torch.nn.Module] = None,
               info: Optional["EmbeddingInfo"] = None) -> list[Check]:
    """Raise the first broken rule as a ContractError; return the warnings."""
    checks = run_checks(target_config, draft, algorithm, target, info)
    for check in checks:
        if check.status == "fail":
            raise check.as_error()
    return [c for c in checks if c.status == "warn"]
