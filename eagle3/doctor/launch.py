"""Launch-line linter: what would silently break an EAGLE-3 deployment on SGLang, vLLM or llama.cpp.

Where each engine reads the draft's layer ids, in which numbering, which layouts it loads and how its
command line names the algorithm: the table in eagle3/engines.py (every id here is "input to layer i",
= HF output_hidden_states[i]). The draft's own ids (what it was trained on) come from DraftFacts, or
when the doctor has none, from the draft's config.json read as this project reads it.

What it flags (each a Check with a fix): EAGLE-3 draft served as EAGLE (SGLang
`--speculative-algorithm EAGLE`, vLLM `method: eagle` or a path that auto-detects as EAGLE-1), a
missing draft, layer ids the engine will shift, read raw or drop (vLLM takes a lone eagle_config list
raw: a SpecForge draft runs one layer early), a draft for another vocabulary or target, tree settings
that force a chain or cannot be built (speculative/tree.py owns the tree shape rule), removed or
ambiguous options.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from ..engines import (EAGLE3_ARCHITECTURES, ENGINES, LLAMA_CPP, NESTED_KEY, SGLANG, SPECULATORS_KEY,
                       TRAINED_READS, VLLM, Reading, describe, eagle31_flags, engine_reading,
                       is_speculators, read_ids, speculators_spec, version_tuple, vllm_method)
from ..errors import LoadError
from ..models.config import default_capture_ids
from ..models.target import TargetFacts
from ..speculative.tree import max_candidates, tree_shape_problem
from . import silent
from .cmdline import Command, parse_line
from .report import Check, failed, passed, warned

EAGLE1_FIX = "this draft is EAGLE-1/2 (fc over cat(embedding, last hidden)); serve it as EAGLE"


@dataclass(frozen=True)
class DraftFacts:
    """What the draft is, as our loader read it (the truth the engines are compared with)."""
    algorithm: str                        # "eagle3" | "eagle"
    aux_layer_ids: tuple[int, ...]        # trained on these, "input to layer i"; () for EAGLE-1/2
    vocab_size: int                       # target vocabulary the draft maps into
    draft_vocab_size: int
    config: dict[str, Any] = field(default_factory=dict)   # raw config.json, as engines read it
    path: Optional[str] = None
    norm_before_fc: bool = False          # Eagle 3.1 switches the draft was trained with
    norm_output: bool = False


# ---------------------------------------------------------------------------- reading local files
def read_json(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_target_facts(spec: Optional[str]) -> Optional[TargetFacts]:
    """Target facts from a local HF directory or GGUF named on a launch line; None if not local."""
    if not spec:
        return None
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _gguf_target(path)
    cfg = read_json(path / "config.json") if path.is_dir() else None
    if cfg is None:
        return None
    try:
        return TargetFacts.from_hf(cfg, str(path))
    except (LoadError, TypeError, ValueError):
        return None   # the checks that need it say "unknown"


def _gguf_fields(path: Path) -> Optional[dict]:
    try:
        from gguf import GGUFReader
        return GGUFReader(str(path)).fields
    except Exception:  # noqa: BLE001  gguf raises many types on a bad file; caller says "unknown"
        return None


def _gguf_target(path: Path) -> Optional[TargetFacts]:
    fields = _gguf_fields(path)
    if fields is None or "general.architecture" not in fields:
        return None
    arch = fields["general.architecture"].contents()
    try:
        return TargetFacts(int(fields[f"{arch}.block_count"].contents()),
                           len(fields["tokenizer.ggml.tokens"].data),
                           int(fields[f"{arch}.embedding_length"].contents()), arch, str(path))
    except KeyError:
        return None


def read_draft_config(spec: Optional[str]) -> Optional[dict]:
    if not spec:
        return None
    path = Path(spec).expanduser()
    return read_json(path / "config.json") if path.is_dir() else None


# ---------------------------------------------------------------------------- engine views of ids
@dataclass(frozen=True)
class EngineIds:
    ids: tuple[int, ...]      # what the engine captures, "input to layer i"
    source: str               # how it got them
    alternative: Optional[tuple[int, ...]] = None   # what older releases of the engine capture


def engine_ids(engine: str, config: dict, num_layers: int) -> EngineIds:
    """What `engine` captures from a draft with this config.json, on a target of `num_layers`."""
    spec, defaults = ENGINES[engine], default_capture_ids(num_layers)
    now = engine_reading(spec, config, defaults)
    older = read_ids(spec.older_reads, config, defaults) if spec.older_reads else now
    return EngineIds(now.ids, describe(now), older.ids if older.ids != now.ids else None)


def trained_ids(draft: Optional[DraftFacts], config: dict, num_layers: int) -> Reading:
    """The ids the draft was trained on: the loader's reading, else the config read as we read it."""
    if draft is not None:
        return Reading(draft.aux_layer_ids, None, None)
    return read_ids(TRAINED_READS, config, default_capture_ids(num_layers))


def ids_fix(engine: str, ids: tuple[int, ...], draft_path: Optional[str] = None,
            target_path: Optional[str] = None) -> str:
    """Re-export for the engine, or write the ids where (and as) it reads them first."""
    spec = ENGINES[engine]
    slot = spec.reads[0]
    export = (f"eagle3 export --draft {draft_path or 'DRAFT'} --model {target_path or 'TARGET'} "
              f"--out OUT --format {spec.export_format}")
    fix = (f"export the {spec.export_format} layout with `{export}`, or set {slot.label} = "
           f"{slot.as_stored(ids)} ({slot.meaning}, {spec.label}'s reading) in the "
           "draft's config.json")
    return "; ".join((fix, *spec.notes))


def check_ids(engine: str, draft: Optional[DraftFacts], config: Optional[dict],
              target: Optional[TargetFacts], draft_path: Optional[str] = None) -> list[Check]:
    name = f"launch.{engine}.layer_ids"
    if draft is not None and draft.algorithm != "eagle3":
        return []
    if config is None or target is None:
        return [warned(name, "cannot tell which layers the engine captures (draft config or "
                             "target layer count unknown)",
                       "pass --draft and --model (local paths) to eagle3 doctor")]
    view = engine_ids(engine, config, target.num_layers)
    trained = trained_ids(draft, config, target.num_layers)
    label = ENGINES[engine].label
    fix = ids_fix(engine, trained.ids, draft_path or (draft.path if draft else None), target.path)
    if any(not 0 <= i < target.num_layers for i in view.ids):
        return [failed(name, f"{label} would capture layers {list(view.ids)} ({view.source}); the "
                             f"target has {target.num_layers} layers", fix)]
    told = "" if draft is not None else f" (its config.json: {describe(trained)})"
    if view.ids != trained.ids:
        return [failed(name, f"{label} captures inputs of layers {list(view.ids)} ({view.source}) "
                             f"but the draft was trained on {list(trained.ids)}{told}: it runs and "
                             "acceptance silently drops", fix)]
    if view.alternative is not None and view.alternative != trained.ids:
        return [warned(name, f"{label} captures {list(view.ids)} ({view.source}); an older {label} "
                             f"would capture {list(view.alternative)}", fix)]
    return [passed(name, f"{label} captures inputs of layers {list(view.ids)} = the draft's "
                         f"{list(trained.ids)}{told} ({view.source})")]


# ---------------------------------------------------------------------------- Eagle 3.1 norms
def trained_norms(draft: Optional[DraftFacts], config: Optional[dict]) -> dict[str, bool]:
    """The Eagle 3.1 switches the draft was trained with: the loader's reading, else its config.json
    where a layout carries them (speculators, vLLM; SpecForge's norm_output means the final norm)."""
    if draft is not None:
        return {"norm_before_fc": draft.norm_before_fc, "norm_output": draft.norm_output}
    if config is None:
        return {}
    arch = (config.get("architectures") or [""])[0]
    if is_speculators(config) or EAGLE3_ARCHITECTURES.get(arch) == "vllm":
        return eagle31_flags(config)
    return {}


def check_norms(engine: str, draft: Optional[DraftFacts], config: Optional[dict],
                version: Optional[str]) -> list[Check]:
    """A draft trained with the Eagle 3.1 norms must be served by an engine (and release) that runs
    them: one that ignores them serves it without error and accepts little."""
    on = [flag for flag, value in trained_norms(draft, config).items() if value]
    if not on:
        return []
    name, spec = f"launch.{engine}.eagle31_norms", ENGINES[engine]
    what = " and ".join(f"{flag}=true" for flag in on)
    fix = (f"serve it with vLLM >= {VLLM.eagle31_since} from the speculators layout (eagle3 export "
           f"--format speculators), or retrain without {' / '.join(on)}")
    if spec.eagle31_since is None:
        return [failed(name, f"the draft was trained with {what} (Eagle 3.1); {spec.label} does not "
                             "run these norms: it serves the draft without them and acceptance drops, "
                             "with no error", fix)]
    since = spec.eagle31_since
    if version is None:
        return [warned(name, f"the draft was trained with {what}; {spec.label} runs them from {since}, "
                             "older releases ignore them with no error (release not known here)",
                       f"check the release: eagle3 doctor --engine-version {engine}=X; {fix}")]
    if version_tuple(version) < version_tuple(since):
        return [failed(name, f"{spec.label} {version} ignores {what} (runs them from {since}): the "
                             "draft is served without its norms and accepts little", fix)]
    stored = eagle31_flags(config) if config is not None else {}
    missing = [flag for flag in on if not stored.get(flag)]
    if missing:
        return [failed(name, f"the draft was trained with {what} but its config.json does not set "
                             f"{', '.join(missing)}: {spec.label} will not run them", fix)]
    return [passed(name, f"{spec.label} {version} runs {what} as trained")]


# ---------------------------------------------------------------------------- shared checks
def check_draft_path(engine: str, path: Optional[str], draft: Optional[DraftFacts],
                     flag: str) -> list[Check]:
    name = f"launch.{engine}.draft_path"
    if not path:
        return [Check(name, "fail", f"no draft model on the line ({flag} missing): nothing is "
                      "speculated or the engine refuses to start", f"add {flag} DRAFT", field=flag,
                      found="absent", expected="the draft's path")]
    local = Path(path).expanduser()
    if draft is not None and draft.path and local.exists() and \
            local.resolve() != Path(draft.path).expanduser().resolve():
        return [warned(name, f"the line serves {path}, the doctor checked {draft.path}",
                       "point the line at the draft that was checked, or check this one")]
    where = "local" if local.exists() else "not a local path (hub id or remote: not inspected)"
    return [passed(name, f"draft {path} ({where})")]


def check_vocab(engine: str, draft: Optional[DraftFacts],
                target: Optional[TargetFacts]) -> list[Check]:
    name = f"launch.{engine}.vocab"
    if draft is None or target is None:
        return []
    if draft.vocab_size != target.vocab_size:
        return [failed(name, f"the draft maps into a {draft.vocab_size}-token vocabulary, the "
                             f"target on the line has {target.vocab_size}",
                       "serve the draft with the target it was trained for (same tokenizer)")]
    if draft.draft_vocab_size > target.vocab_size:
        return [failed(name, f"draft_vocab_size {draft.draft_vocab_size} > target vocabulary "
                             f"{target.vocab_size}", "the draft belongs to another target")]
    return [passed(name, f"draft vocab {draft.draft_vocab_size} -> target vocab {target.vocab_size}")]


def check_same_target(engine: str, line_target: Optional[TargetFacts],
                      target: Optional[TargetFacts]) -> list[Check]:
    if line_target is None or target is None:
        return []
    a = (line_target.num_layers, line_target.hidden_size, line_target.vocab_size)
    b = (target.num_layers, target.hidden_size, target.vocab_size)
    if a != b:
        return [failed(f"launch.{engine}.target", f"the line's target {line_target.path} has "
                       f"(layers, hidden, vocab) = {a}; the checked target has {b}",
                       "serve the draft on the target it was trained for")]
    return []


# ---------------------------------------------------------------------------- SGLang
def lint_sglang(cmd: Command, draft: Optional[DraftFacts], target: Optional[TargetFacts],
                version: Optional[str] = None) -> list[Check]:
    o = cmd.options
    line_target = read_target_facts(o.get("model"))
    target = target or line_target
    out = [*_notes("sglang", cmd), *check_same_target("sglang", line_target, target)]
    out += sglang_algorithm(o.get("algorithm"), draft)
    out += check_draft_path("sglang", o.get("draft"), draft, "--speculative-draft-model-path")
    config = (draft.config if draft and draft.config else None) or read_draft_config(o.get("draft"))
    out += check_ids("sglang", draft, config, target, o.get("draft"))
    out += check_norms("sglang", draft, config, version)
    out += check_vocab("sglang", draft, target)
    out += sglang_tree(o)
    out += silent.check_token_map(o.get("token_map"), o.get("algorithm"))
    out += silent.check_context("sglang", "--context-length", o.get("context_length"), o.get("model"),
                                config)
    out += silent.check_launch_template("sglang", o.get("chat_template"), config)
    out += silent.check_quantization("sglang", "--speculative-draft-model-quantization",
                                     o.get("draft_quantization"))
    return out


def sglang_algorithm(algo: Optional[str], draft: Optional[DraftFacts]) -> list[Check]:
    name = "launch.sglang.algorithm"
    if not algo:
        return [failed(name, f"{SGLANG.method_option} is not set: the server runs without "
                             "speculation", f"add {SGLANG.method_option} {SGLANG.methods['eagle3']}")]
    algo_u, flag = algo.upper(), SGLANG.method_option
    if algo_u not in SGLANG.methods.values():
        return [failed(name, f"{flag} {algo} is not an EAGLE algorithm",
                       f"use {flag} {SGLANG.methods['eagle3']} for an EAGLE-3 draft")]
    if draft is None:
        if algo_u == SGLANG.methods["eagle"]:
            return [warned(name, f"{flag} {algo_u}: if the draft is EAGLE-3 it gets one "
                                 "hidden state instead of the fused layers and accepts nothing, "
                                 "with no error (the documented incident)",
                           f"use {flag} {SGLANG.methods['eagle3']} for EAGLE-3 drafts; pass --draft "
                           "to check")]
        return [passed(name, f"{flag} {algo_u}")]
    want = SGLANG.methods[draft.algorithm]
    if algo_u != want:
        return [failed(name, _algo_message(algo, draft),
                       f"use {flag} {want}" + ("" if draft.algorithm == "eagle3" else f" ({EAGLE1_FIX})"))]
    return [passed(name, f"{flag} {algo} matches the {want} draft")]


def _algo_message(flag: str, draft: DraftFacts) -> str:
    if draft.algorithm == "eagle3":
        k = len(draft.aux_layer_ids)
        return (f"{flag} on an EAGLE3 draft: the engine hands it one target hidden state, not the "
                f"{k} fused layers {list(draft.aux_layer_ids)} its fc expects; it still runs and "
                "acceptance falls to zero with no error (the documented incident)")
    return (f"{flag} on an EAGLE-1/2 draft: the engine would feed fused aux states to an fc over "
            "cat(embedding, hidden)")


def sglang_tree(o: dict[str, str]) -> list[Check]:
    name = "launch.sglang.tree"
    raw = {k: o.get(k) for k in ("steps", "topk", "num_draft_tokens")}
    if not any(raw.values()):
        return [warned(name, "no --speculative-num-steps/--speculative-eagle-topk/"
                             "--speculative-num-draft-tokens: SGLang picks per-architecture "
                             "defaults (Llama 5/4/8; DeepseekV3 3/1/4, a chain)",
                       "set all three explicitly, e.g. --speculative-num-steps 5 "
                       "--speculative-eagle-topk 4 --speculative-num-draft-tokens 8")]
    try:
        vals = {k: int(v) for k, v in raw.items() if v}
    except ValueError:
        return [failed(name, f"non-integer tree setting in {raw}", "give integers")]
    if len(vals) < 3:
        missing = [k for k in raw if k not in vals]
        return [warned(name, f"tree settings {vals}; {missing} left to SGLang's defaults",
                       "set --speculative-num-steps, --speculative-eagle-topk and "
                       "--speculative-num-draft-tokens together")]
    return tree_consistency(name, vals["steps"], vals["topk"], vals["num_draft_tokens"])


def tree_consistency(name: str, steps: int, topk: int, num_draft_tokens: int) -> list[Check]:
    """EAGLE-2 tree: step 1 proposes topk nodes, each later step topk*topk candidates."""
    if min(steps, topk, num_draft_tokens) < 1:
        return [failed(name, f"steps={steps}, topk={topk}, num_draft_tokens={num_draft_tokens}: "
                             "all must be >= 1", "use positive tree settings")]
    shape = f"steps={steps}, topk={topk}, num_draft_tokens={num_draft_tokens}"
    if topk == 1:
        chain = [warned(name, f"{shape}: topk 1 forces a chain of {steps} tokens (no tree)",
                        "use --speculative-eagle-topk >= 2 with num_draft_tokens > steps+1 for a tree, "
                        "unless a chain was measured to be faster here")]
        if num_draft_tokens != steps + 1:
            chain.append(warned(name, f"{shape}: with topk 1 SGLang resets num_draft_tokens to "
                                      f"steps+1 = {steps + 1}",
                                f"set --speculative-num-draft-tokens {steps + 1}"))
        return chain
    problem = tree_shape_problem(topk, steps, num_draft_tokens, max_draft_tokens=None)
    if problem:
        most = max_candidates(topk, steps)
        return [failed(name, f"{shape}: {problem}",
                       f"lower --speculative-num-draft-tokens to <= {most + 1} or raise steps/topk")]
    out = []
    if num_draft_tokens - 1 < steps:
        out.append(warned(name, f"{shape}: fewer nodes ({num_draft_tokens - 1}) than draft steps; the "
                                "last steps can never be verified (wasted draft forwards)",
                          f"lower --speculative-num-steps to {num_draft_tokens - 1}"))
    if num_draft_tokens > steps * topk + 1:
        out.append(warned(name, f"{shape}: more than steps*topk+1 = {steps * topk + 1} verified "
                                "tokens; the extra nodes are low-score siblings that cost verify time",
                          "measure; the usual range is num_draft_tokens <= steps*topk+1"))
    return out or [passed(name, f"{shape}: a tree of {num_draft_tokens} nodes")]


def _notes(engine: str, cmd: Command) -> list[Check]:
    return [failed(f"launch.{engine}.option", note, "spell the option out in full")
            for note in cmd.notes]


# ---------------------------------------------------------------------------- vLLM
def vllm_spec(cmd: Command) -> tuple[dict[str, Any], list[Check]]:
    """The speculative config as vLLM would see it, from JSON, dotted keys or the old flags."""
    o, checks = cmd.options, []
    spec: dict[str, Any] = {}
    if o.get("speculative_config"):
        try:
            spec = json.loads(o["speculative_config"])
        except ValueError as e:
            return {}, [failed("launch.vllm.speculative_config",
                               f"--speculative-config is not valid JSON ({e})",
                               "quote the JSON in single quotes: '{\"method\": \"eagle3\", ...}'")]
    spec.update(cmd.dotted)
    if o.get("old_draft"):
        spec.setdefault("model", o["old_draft"])
        checks.append(warned("launch.vllm.speculative_config",
                             "--speculative-model is the old spelling (removed in recent vLLM)",
                             "use --speculative-config '{\"method\": \"eagle3\", \"model\": ..., "
                             "\"num_speculative_tokens\": N}'"))
    if o.get("old_num_tokens"):
        spec.setdefault("num_speculative_tokens", o["old_num_tokens"])
    if o.get("old_disable_by_batch_size"):
        spec.setdefault("disable_by_batch_size", o["old_disable_by_batch_size"])
    return spec, checks


def speculators_served(model: Optional[str]) -> tuple[dict[str, Any], Optional[str], list[Check]]:
    """`vllm serve SPECULATORS_DIR`: vLLM builds the speculative config from the checkpoint and
    serves its verifier as the target. ({}, model, []) when `model` is not such a local directory."""
    config = read_draft_config(model)
    if config is None or not is_speculators(config):
        return {}, model, []
    spec, verifier = speculators_spec(config, str(model))
    return spec, verifier, [passed("launch.vllm.speculative_config", f"{model} is a speculators "
                                   f"checkpoint: vLLM serves its verifier {verifier} with "
                                   f"{spec['method']} and this draft")]


def lint_vllm(cmd: Command, draft: Optional[DraftFacts], target: Optional[TargetFacts],
              version: Optional[str] = None) -> list[Check]:
    model = cmd.options.get("model") or (cmd.positionals[0] if cmd.positionals else None)
    spec, out = vllm_spec(cmd)
    if not spec:
        spec, model, out = speculators_served(model)
    line_target = read_target_facts(model)
    target = target or line_target
    out += check_same_target("vllm", line_target, target)
    if any(c.status == "fail" for c in out):
        return out
    if not spec:
        return out + [failed("launch.vllm.speculative_config", "no --speculative-config: the "
                             "server runs without speculation",
                             "add --speculative-config '{\"method\": \"eagle3\", \"model\": DRAFT, "
                             "\"num_speculative_tokens\": 3}'")]
    out += vllm_method_check(spec, draft)
    out += check_draft_path("vllm", spec.get("model"), draft, "\"model\" in --speculative-config")
    out += vllm_num_tokens(spec)
    config = (draft.config if draft and draft.config else None) or read_draft_config(spec.get("model"))
    out += check_ids("vllm", draft, config, target, spec.get("model"))
    out += check_norms("vllm", draft, config, version)
    out += check_vocab("vllm", draft, target)
    out += silent.check_disable_by_batch_size(spec, version)
    out += silent.check_draft_max_model_len(spec, version)
    out += silent.check_context("vllm", "--max-model-len", cmd.options.get("max_model_len"), model,
                                config)
    out += silent.check_launch_template("vllm", cmd.options.get("chat_template"), config)
    out += silent.check_quantization("vllm", "\"quantization\" in --speculative-config",
                                     spec.get("quantization"))
    return out


def vllm_method_check(spec: dict[str, Any], draft: Optional[DraftFacts]) -> list[Check]:
    name = "launch.vllm.method"
    method, how = vllm_method(spec)
    want = None if draft is None else VLLM.methods[draft.algorithm]
    if method not in VLLM.methods.values():
        return [failed(name, f"method {method} ({how}): the draft is not run as an EAGLE head",
                       f"set \"method\": \"{want or 'eagle3'}\" in --speculative-config")]
    if want is None:
        if method == "eagle":
            return [warned(name, f"method eagle ({how}): an EAGLE-3 draft run this way accepts "
                                 "nothing", "use \"method\": \"eagle3\" for EAGLE-3 drafts")]
        return [passed(name, f"method eagle3 ({how})")]
    if method != want:
        return [failed(name, _algo_message(f"method {method} ({how})", draft),
                       f"set \"method\": \"{want}\" in --speculative-config")]
    return [passed(name, f"method {method} ({how}) matches the draft")]


def vllm_num_tokens(spec: dict[str, Any]) -> list[Check]:
    name = "launch.vllm.num_speculative_tokens"
    value = spec.get("num_speculative_tokens")
    if value in (None, ""):
        return [failed(name, "num_speculative_tokens missing: vLLM refuses an EAGLE draft without it",
                       "add \"num_speculative_tokens\": 3 (vLLM drafts a chain of that length)")]
    return chain_length(name, "num_speculative_tokens=", value, "use >= 1",
                        "chain of {n} draft tokens per step")


def chain_length(name: str, label: str, value: Any, fix: str, ok: str) -> list[Check]:
    """A chain-length option: an integer >= 1 (`ok` is formatted with n)."""
    try:
        n = int(value)
    except (TypeError, ValueError):
        return [failed(name, f"{label}{value!r} is not an integer", "give an integer")]
    if n < 1:
        return [failed(name, f"{label}{n}: nothing is drafted", fix)]
    return [passed(name, ok.format(n=n))]


# ---------------------------------------------------------------------------- llama.cpp
def lint_llama_server(cmd: Command, draft: Optional[DraftFacts], target: Optional[TargetFacts],
                      converted: frozenset[str] = frozenset()) -> list[Check]:
    o = cmd.options
    line_target = read_target_facts(o.get("model"))
    target = target or line_target
    out = check_same_target("llama.cpp", line_target, target)
    if "removed_draft_n" in o:
        out.append(failed("launch.llama.cpp.option", "--draft/--draft-max/--draft-min were removed "
                          "from llama.cpp: the binary refuses them", "use --spec-draft-n-max N"))
    out += llama_spec_type(o.get("spec_type"), draft)
    path = o.get("draft") or o.get("draft_hf")
    out += check_draft_path("llama.cpp", path, draft, "-md DRAFT.gguf")
    if o.get("draft") in converted and not Path(o["draft"]).expanduser().exists():
        out.append(passed("launch.llama.cpp.layer_ids", f"{o['draft']} is written by the "
                          "convert_hf_to_gguf.py step on this line (its layer ids are checked there)"))
    elif o.get("draft"):
        out += llama_draft_gguf(Path(o["draft"]).expanduser(), draft, target)
    out += llama_n_max(o.get("n_max"))
    out += check_norms("llama.cpp", draft, draft.config if draft else None, None)
    out += check_vocab("llama.cpp", draft, target)
    return out


def llama_spec_type(value: Optional[str], draft: Optional[DraftFacts]) -> list[Check]:
    name = "launch.llama.cpp.spec_type"
    if not value:
        return [warned(name, "no --spec-type: llama.cpp infers it from the draft GGUF metadata "
                             "(only the first split is read)", "add --spec-type draft-eagle3")]
    types = [t.strip() for t in value.split(",")]
    eagle3 = draft is None or draft.algorithm == "eagle3"
    flag, want = LLAMA_CPP.method_option, LLAMA_CPP.methods["eagle3"]
    if eagle3 and want not in types:
        return [failed(name, f"{flag} {value}: an EAGLE-3 draft is not run as {want} "
                             "(draft-simple treats it as a standalone LM)", f"use {flag} {want}")]
    if draft is not None and draft.algorithm not in LLAMA_CPP.methods:
        return [failed(name, "llama.cpp runs EAGLE-3 drafts only (draft-eagle3); this draft is "
                             "EAGLE-1/2", "serve EAGLE-1/2 drafts with SGLang (EAGLE) or vLLM (eagle)")]
    return [passed(name, f"--spec-type {value}")]


def llama_draft_gguf(path: Path, draft: Optional[DraftFacts],
                     target: Optional[TargetFacts]) -> list[Check]:
    name = "launch.llama.cpp.layer_ids"
    if path.is_dir() or (path.exists() and path.suffix != ".gguf"):
        return [failed("launch.llama.cpp.draft_format", f"{path} is not a GGUF file",
                       "convert it: python convert_hf_to_gguf.py DRAFT_DIR --target-model-dir "
                       "TARGET_DIR --outfile draft.gguf")]
    fields = _gguf_fields(path) if path.is_file() else None
    if fields is None:
        return [warned(name, f"{path} not readable here: the layer ids baked in at conversion are "
                             "not checked", "run the doctor where the GGUF is, or lint the "
                                            "convert_hf_to_gguf.py step")]
    arch = fields["general.architecture"].contents() if "general.architecture" in fields else None
    if arch != "eagle3":
        return [failed("launch.llama.cpp.draft_format", f"{path} has architecture {arch!r}, not "
                       "eagle3: the converter did not detect an EAGLE-3 draft",
                       "the draft config needs top-level draft_vocab_size and num_hidden_layers 1; "
                       "re-run convert_hf_to_gguf.py with --target-model-dir")]
    ids = tuple(int(i) for i in fields["eagle3.target_layers"].contents()) \
        if "eagle3.target_layers" in fields else ()
    if draft is None:
        return [passed(name, f"GGUF captures inputs of layers {list(ids)}; pass --draft to compare")]
    if ids != draft.aux_layer_ids:
        return [failed(name, f"the GGUF captures inputs of layers {list(ids)}, the draft was trained "
                             f"on {list(draft.aux_layer_ids)}", ids_fix("llama.cpp", draft.aux_layer_ids))]
    return [passed(name, f"the GGUF captures inputs of layers {list(ids)} = the draft's")]


def llama_n_max(value: Optional[str]) -> list[Check]:
    name = "launch.llama.cpp.tree"
    if value is None:
        return [passed(name, "llama.cpp drafts a chain (no tree); --spec-draft-n-max defaults to 3")]
    return chain_length(name, "--spec-draft-n-max ", value, "use >= 1 (e.g. 3-5)",
                        "a chain of up to {n} draft tokens (llama.cpp does not draft trees)")


def lint_llama_convert(cmd: Command, draft: Optional[DraftFacts], target: Optional[TargetFacts],
                       draft_ggufs: frozenset[str] = frozenset()) -> list[Check]:
    name = "launch.llama.cpp-convert"
    model_dir = cmd.positionals[0] if cmd.positionals else None
    target_dir = cmd.options.get("target_dir")
    kind = "draft" if cmd.options.get("outfile") in draft_ggufs else \
        convert_kind(model_dir, target_dir, draft)
    if kind == "target":
        return [passed(f"{name}.target", f"converts the target {model_dir} to GGUF")]
    if kind == "unknown":
        return [warned(f"{name}.kind", f"cannot tell whether {model_dir} is the draft or the target "
                                       "(not a local directory)",
                       "if it is the EAGLE-3 draft, add --target-model-dir TARGET_DIR")]
    out = []
    if not target_dir:
        out.append(failed(f"{name}.target_dir", "--target-model-dir missing: the converter refuses "
                          "an EAGLE-3 draft without its target", "add --target-model-dir TARGET_DIR"))
    line_target = read_target_facts(target_dir)
    out += check_same_target("llama.cpp-convert", line_target, target)
    target = target or line_target
    out += check_draft_path("llama.cpp-convert", model_dir, draft, "the DRAFT_DIR argument")
    config = (draft.config if draft and draft.config else None) or read_draft_config(model_dir)
    if config is not None:
        out += convert_detection(config)
    out += check_ids("llama.cpp", draft, config, target, model_dir)
    return out


def is_draft_config(cfg: dict) -> bool:
    arch = (cfg.get("architectures") or [""])[0]
    return any(k in cfg for k in ("draft_vocab_size", NESTED_KEY, SPECULATORS_KEY)) \
        or arch in EAGLE3_ARCHITECTURES or cfg.get("num_hidden_layers") == 1


def convert_kind(model_dir: Optional[str], target_dir: Optional[str],
                 draft: Optional[DraftFacts]) -> str:
    """"draft" | "target" | "unknown": which model this convert_hf_to_gguf.py step converts."""
    if not model_dir:
        return "draft"
    path = Path(model_dir).expanduser()
    if draft is not None and draft.path and path.exists() and \
            path.resolve() == Path(draft.path).expanduser().resolve():
        return "draft"
    cfg = read_draft_config(model_dir)
    if cfg is not None:
        return "draft" if is_draft_config(cfg) else "target"
    return "draft" if target_dir or "eagle" in model_dir.lower() else "unknown"


def convert_detection(config: dict) -> list[Check]:
    name = "launch.llama.cpp-convert.detect"
    layers = (config.get("transformer_layer_config") or {}).get("num_hidden_layers",
                                                                 config.get("num_hidden_layers"))
    if "draft_vocab_size" not in config or config.get("num_hidden_layers", layers) != 1:
        return [failed(name, "the converter detects EAGLE-3 by a top-level draft_vocab_size and "
                             f"num_hidden_layers 1 (found draft_vocab_size="
                             f"{config.get('draft_vocab_size')}, num_hidden_layers="
                             f"{config.get('num_hidden_layers')}): it would convert a plain Llama",
                       "add top-level draft_vocab_size and num_hidden_layers 1 to config.json")]
    return [passed(name, "converter will detect an EAGLE-3 draft")]


# ---------------------------------------------------------------------------- entry point
LINTERS = {"sglang": lint_sglang, "vllm": lint_vllm, "llama.cpp": lint_llama_server,
           "llama.cpp-convert": lint_llama_convert}


def lint_launch(line: str, draft: Optional[DraftFacts] = None, target: Optional[TargetFacts] = None,
                versions: Optional[dict[str, str]] = None) -> list[Check]:
    """Checks for every SGLang / vLLM / llama.cpp command found in `line`. `versions`: engine name
    -> its release, where known (what it runs can depend on it)."""
    commands = parse_line(line)
    if not commands:
        return [failed("launch.engine", "no SGLang, vLLM or llama.cpp command found in the line",
                       "pass the whole command: python -m sglang.launch_server ..., vllm serve ..., "
                       "llama-server ... or python convert_hf_to_gguf.py ...")]
    # a convert step whose --outfile a llama-server line loads with -md converts the draft
    draft_ggufs = frozenset(c.options["draft"] for c in commands
                            if c.engine == "llama.cpp" and c.options.get("draft"))
    converted = frozenset(c.options["outfile"] for c in commands
                          if c.engine == "llama.cpp-convert" and c.options.get("outfile"))
    out: list[Check] = []
    for cmd in commands:
        if cmd.engine == "llama.cpp-convert":
            out += lint_llama_convert(cmd, draft, target, draft_ggufs)
        elif cmd.engine == "llama.cpp":
            out += lint_llama_server(cmd, draft, target, converted)
        else:
            version = (versions or {}).get(cmd.engine)
            out += LINTERS[cmd.engine](cmd, draft, target, version)
            if cmd.engine == "sglang":
                out += silent.check_overlap(silent.line_env(line), cmd.options.get("algorithm"),
                                            version)
    return out
