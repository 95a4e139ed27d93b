"""Checks for the catalog's silent failures (doctor/catalog.py) that the launch linter and the pair
checks did not already have: each compares one field, and a finding names it, both values and the
fix.

| check                               | where  | fails (or warns) when                                     |
|-------------------------------------|--------|-----------------------------------------------------------|
| launch.ENGINE.context_length        | launch | the served context is longer than the draft's window       |
| launch.vllm.disable_by_batch_size   | launch | set on a vLLM that ignores it (>= 0.10, or release unknown)|
| launch.vllm.draft_max_model_len     | launch | speculative_config.max_model_len on the V1 engine          |
| launch.sglang.token_map             | launch | --speculative-token-map with EAGLE3 (EAGLE-2 only)         |
| launch.ENGINE.chat_template         | launch | --chat-template differs from the draft's recorded template |
| launch.ENGINE.draft_quantization    | launch | the draft is served quantized (warn; the probe compares)   |
| launch.sglang.overlap_schedule      | launch | EAGLE-3 under SGLang's overlap scheduler (warn: slower)    |
| draft.d2t                           | pair   | a reduced draft vocabulary has no d2t/t2d                  |
| contract.d2t_rows                   | pair   | lm_head rows started from the target's do not match d2t    |
| draft.chat_template                 | pair   | the target's template differs from the draft's recorded one|
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Optional

import torch

from ..draft import template
from ..engines import version_tuple
from .report import Check, failed, passed, warned

V1_ONLY = "0.10"          # vLLM's V0 engine (the one that read disable_by_batch_size) left in 0.10.0
OVERLAP_ENV = ("SGLANG_ENABLE_SPEC_V2", "SGLANG_ENABLE_EXPERIMENTAL_EAGLE_OVERLAP_SCHEDULE")


def field_check(name: str, status: str, field: str, found: Any, expected: Any, message: str,
                fix: str) -> Check:
    """A finding that carries the field and both values, with a message that says them."""
    return Check(name, status, f"{field}: found {found!r}, expected {expected!r}: {message}", fix,
                 field=field, found=found, expected=expected)


# ---------------------------------------------------------------------------- draft window
def draft_window(config: Optional[dict]) -> Optional[int]:
    """The draft's max_position_embeddings (speculators nest it in transformer_layer_config)."""
    if not config:
        return None
    value = config.get("max_position_embeddings",
                       (config.get("transformer_layer_config") or {}).get("max_position_embeddings"))
    return int(value) if isinstance(value, (int, float)) else None


def target_window(model: Optional[str]) -> Optional[int]:
    """A local target directory's max_position_embeddings (what an engine serves by default)."""
    path = Path(model).expanduser() / "config.json" if model else None
    try:
        return draft_window(json.loads(path.read_text())) if path else None
    except (OSError, ValueError):
        return None


def check_context(engine: str, flag: str, served: Optional[str], model: Optional[str],
                  config: Optional[dict]) -> list[Check]:
    name = f"launch.{engine}.context_length"
    window = draft_window(config)
    try:
        context = int(served) if served else target_window(model)
    except ValueError:
        return [failed(name, f"{flag} {served!r} is not an integer", "give an integer")]
    if window is None or context is None:
        return []
    how = f"{flag} {context}" if served else f"the target's max_position_embeddings {context} ({flag} unset)"
    if context > window:
        return [field_check(name, "fail", "max_position_embeddings (draft)", window, f">= {context}",
                            f"the engine serves {how}; past {window} tokens the draft drafts from "
                            "positions it never saw and speculation costs more than no speculation, "
                            "with no error",
                            f"cap the served context: {flag} {window}, or serve a draft trained for "
                            f"{context} tokens (max_position_embeddings >= {context})")]
    return [passed(name, f"the draft's window {window} covers {how}")]


# ---------------------------------------------------------------------------- vLLM settings
def check_disable_by_batch_size(spec: dict[str, Any], version: Optional[str]) -> list[Check]:
    name = "launch.vllm.disable_by_batch_size"
    if "disable_by_batch_size" not in spec:
        return []
    value = spec["disable_by_batch_size"]
    fix = ("remove disable_by_batch_size; to draft less at large batches use "
           "num_speculative_tokens_per_batch_size (a token count per batch-size range) on a vLLM that "
           "has it")
    if version is not None and version_tuple(version) < version_tuple(V1_ONLY):
        return [passed(name, f"disable_by_batch_size {value}: vLLM {version} (V0) reads it")]
    where = f"vLLM {version}" if version else "vLLM (release not given: every release since 0.10.0)"
    return [field_check(name, "fail", "speculative_config.disable_by_batch_size", value,
                        f"unset on vLLM >= {V1_ONLY}", f"{where} ignores it (unused since 0.10.0, then "
                        "removed): speculation is never switched off at large batches", fix)]


def check_draft_max_model_len(spec: dict[str, Any], version: Optional[str]) -> list[Check]:
    name = "launch.vllm.draft_max_model_len"
    if "max_model_len" not in spec:
        return []
    if version is not None and version_tuple(version) < version_tuple(V1_ONLY):
        return [passed(name, f"speculative_config.max_model_len {spec['max_model_len']}: vLLM "
                             f"{version} (V0) skips speculation past it")]
    return [field_check(name, "fail", "speculative_config.max_model_len", spec["max_model_len"],
                        "unset on the V1 engine", "accepted but never read by the V1 engine "
                        "(observed on 0.26.0): long sequences keep speculating",
                        "remove it; send long-context traffic to a server without speculation, or "
                        "cap the context with --max-model-len")]


# ---------------------------------------------------------------------------- SGLang settings
def check_token_map(token_map: Optional[str], algorithm: Optional[str]) -> list[Check]:
    name = "launch.sglang.token_map"
    if token_map is None:
        return []
    if (algorithm or "").upper() != "EAGLE3":
        return [passed(name, f"--speculative-token-map {token_map} (read by EAGLE-2 drafts)")]
    return [field_check(name, "fail", "--speculative-token-map", token_map,
                        "unset with --speculative-algorithm EAGLE3", "SGLang ignores it for EAGLE3 "
                        "(one log line at start-up; it reduces an EAGLE-2 draft's vocabulary): the "
                        "setting does nothing",
                        "drop the flag; an EAGLE-3 draft's vocabulary is its draft_vocab_size with "
                        "d2t in the checkpoint (reduce it at training time)")]


def line_env(line: str) -> dict[str, str]:
    """NAME=VALUE assignments on a launch line (before a command or after `env`)."""
    return dict(re.findall(r"(?:^|\s)([A-Z_][A-Z0-9_]*)=(\S*)", line))


def check_overlap(env: dict[str, str], algorithm: Optional[str], version: Optional[str]) -> list[Check]:
    name = "launch.sglang.overlap_schedule"
    on = [k for k in OVERLAP_ENV if env.get(k, "").lower() in ("1", "true", "yes", "on")]
    if not on or (algorithm or "").upper() != "EAGLE3":
        return []
    release = f"SGLang {version}" if version else "SGLang (release not given)"
    return [field_check(name, "warn", on[0], env[on[0]], "unset (or measured faster)",
                        f"{release} with EAGLE-3 under the overlap scheduler ran slower than "
                        "without it (reported on 0.5.4): slower, not broken",
                        f"measure with and without {on[0]}=1 on this release and keep the faster")]


# ---------------------------------------------------------------------------- both engines
def check_quantization(engine: str, flag: str, value: Optional[str]) -> list[Check]:
    name = f"launch.{engine}.draft_quantization"
    if not value:
        return []
    return [field_check(name, "warn", flag, value, "the precision the draft was trained in",
                        f"the draft is served quantized ({value}): a quantized draft has accepted "
                        "nothing with no error", "run eagle3 doctor with --draft and --model on this "
                        "line: its probe runs the draft rounded to FP8 against the unquantized one; "
                        f"drop {flag} if it collapses")]


def check_launch_template(engine: str, value: Optional[str], config: Optional[dict]) -> list[Check]:
    """--chat-template FILE against the fingerprint the draft records (without the flag the engine
    applies the target's own template: the pair check compares that)."""
    name = f"launch.{engine}.chat_template"
    trained = template.recorded(config)
    if not value or trained is None:
        return []
    path = Path(value).expanduser()
    if not path.is_file():
        return [warned(name, f"--chat-template {value} is not a local file: not compared with the "
                             f"template the draft was trained with (sha256 {trained})",
                       "run the doctor where the template file is")]
    served = template.fingerprint(path.read_text())
    if served != trained:
        return [field_check(name, "fail", "chat template sha256", served, trained,
                            f"the line serves {value}, the draft was trained with another template: "
                            "acceptance drops with no error",
                            "serve the template the draft was trained with (drop --chat-template to "
                            "use the target's), or retrain the draft on this template")]
    return [passed(name, f"--chat-template {value} is the draft's training template ({trained})")]


# ---------------------------------------------------------------------------- pair checks
def check_missing_d2t(config: Optional[dict]) -> Optional[Check]:
    """A reduced draft vocabulary whose checkpoint has no d2t/t2d (formats refuses to guess)."""
    cfg = config or {}
    vocab, draft_vocab = cfg.get("vocab_size"), cfg.get("draft_vocab_size")
    if not isinstance(vocab, int) or not isinstance(draft_vocab, int) or draft_vocab >= vocab:
        return None
    return field_check("draft.d2t", "fail", "d2t", "absent", f"{draft_vocab} offsets (draft_vocab_size "
                       f"{draft_vocab} < vocab_size {vocab})", "an engine reading this checkpoint maps "
                       f"draft ids to the first {draft_vocab} target ids and acceptance collapses, "
                       "with no error", "copy d2t (and t2d) from the training run's vocabulary into "
                       "the checkpoint (eagle3 export writes both), or retrain with the full vocabulary")


ROWS_SAMPLE = 256          # draft rows compared
FROM_TARGET_COS = 0.5      # median best cosine above this: lm_head started as the target's rows
FROM_TARGET_MARGIN = 0.3   # ... and that best row stands out from the others by this much
MATCH_SHARE = 0.9          # rows whose best target row is their own mapped token, at least


@torch.no_grad()
def check_d2t_rows(draft: Any, target: Any) -> list[Check]:
    """Each draft lm_head row against the target's lm_head rows of the mapped tokens: a draft whose
    lm_head started from those rows keeps its nearest row at its own token; a d2t rebuilt or
    reordered since (SpecForge#534) does not."""
    name = "contract.d2t_rows"
    head = getattr(target, "lm_head", None)
    if getattr(draft.config, "algorithm", "") != "eagle3" or head is None or \
            draft.lm_head.weight.shape[1] != head.weight.shape[1]:
        return []                      # another width: the contract reports it
    ids = (torch.arange(draft.d2t.numel()) + draft.d2t.cpu().long()).clamp(0, head.weight.shape[0] - 1)
    mine = torch.nn.functional.normalize(draft.lm_head.weight.detach().float().cpu(), dim=-1)
    theirs = torch.nn.functional.normalize(head.weight.detach().float().cpu()[ids], dim=-1)
    g = torch.Generator().manual_seed(0)
    rows = torch.randperm(ids.numel(), generator=g)[:ROWS_SAMPLE]
    sim = mine[rows] @ theirs.T                                   # [rows, draft_vocab]
    best, where = sim.max(dim=-1)
    margin = best - sim.median(dim=-1).values                     # a row that stands out
    if float(best.median()) < FROM_TARGET_COS or float(margin.median()) < FROM_TARGET_MARGIN:
        return [passed(name, f"lm_head did not start from the target's rows (median best cosine "
                             f"{float(best.median()):.2f}, {float(margin.median()):.2f} above the "
                             "row's median): d2t is judged by the probe")]
    share = float((where == rows).float().mean())
    if share < MATCH_SHARE:
        return [field_check(name, "fail", "d2t (lm_head rows vs mapped target rows)",
                            f"{share:.0%} of {rows.numel()} rows at their own token",
                            f">= {MATCH_SHARE:.0%}", "the draft's lm_head started from the target's "
                            "rows but d2t now maps them to other tokens: d2t was rebuilt or reordered "
                            "after training, and every draft token is read as another",
                            "restore the d2t (and t2d) saved with the checkpoint the draft was trained "
                            "from; do not rebuild the vocabulary when fine-tuning from a checkpoint")]
    return [passed(name, f"{share:.0%} of {rows.numel()} lm_head rows are nearest the target row of "
                         "their own mapped token")]


def check_pair_template(config: Optional[dict], tokenizer: Any) -> list[Check]:
    name = "draft.chat_template"
    trained = template.recorded(config)
    served = template.fingerprint(getattr(tokenizer, "chat_template", None)) if tokenizer else None
    if trained is None:
        return [passed(name, "the draft records no training chat template (eagle3 export records it)")]
    if served is None:
        return []
    if served != trained:
        return [field_check(name, "fail", "chat template sha256", served, trained,
                            "the target's chat template (what an engine applies by default) is not "
                            "the one the draft was trained with: acceptance drops with no error",
                            "serve with the training template (--chat-template FILE) or retrain the "
                            "draft on the target's current template")]
    return [passed(name, f"the target's chat template is the draft's training template ({trained})")]
