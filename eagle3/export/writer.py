"""Export a draft for the serving engines and print the commands that launch it.

| engine    | layout it reads                          | layer ids it reads      | numbering       |
|-----------|------------------------------------------|-------------------------|-----------------|
| SGLang    | specforge (LlamaForCausalLMEagle3)       | eagle_config ids only   | output (+1)     |
| vLLM      | speculators, or specforge/eagle          | top-level ids only      | input           |
| llama.cpp | any, via convert_hf_to_gguf.py           | top-level ids only, or  | input           |
|           | --target-model-dir (exactly 3 layers)    | 2, L//2, L-3            |                 |

Our specforge export writes the eagle_config ids always and the top-level ids whenever they are not the
defaults, so every engine captures the layers the draft was trained on. Every export is read back through
formats.load_draft and compared tensor for tensor before it is reported as written.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from ..errors import Eagle3Error, InputError, LoadError
from ..models.config import ModelConfig, RopeConfig
from ..draft.contract import check_pair
from ..draft.model import DraftBase
from ..draft.formats import (IDS_KEY, DraftInfo, TargetInfo, inspect_draft, load_draft, read_hf_config,
                      save_draft)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ExportResult:
    path: Path
    format: str
    info: DraftInfo            # the export as read back


@dataclass(frozen=True)
class LaunchLines:
    sglang: str
    vllm: str
    llama_cpp: tuple[str, ...]
    notes: tuple[str, ...]

    def text(self) -> str:
        parts = ["# SGLang", self.sglang, "", "# vLLM", self.vllm, "", "# llama.cpp",
                 *(self.llama_cpp or ("(not available for this draft)",))]
        if self.notes:
            parts += ["", "# notes", *(f"- {n}" for n in self.notes)]
        return "\n".join(parts)


# ---------------------------------------------------------------------------- export
def same_weights(draft: DraftBase, info: DraftInfo, loaded: DraftBase) -> None:
    """The written checkpoint must read back tensor for tensor (shared target weights excepted)."""
    mine, theirs = draft.state_dict(), loaded.state_dict()
    for key, value in mine.items():
        if key == "embed_tokens.weight" and info.embedding_source == "target":
            continue
        if key == "lm_head.weight" and info.lm_head_source == "target":
            continue
        if not torch.equal(value.detach().cpu().to(theirs[key].dtype), theirs[key].cpu()):
            raise LoadError(f"export check failed: {key!r} differs after reading {info.path} back")


def export_draft(draft: DraftBase, out_dir: str | Path, fmt: str, target: TargetInfo, *,
                 speculative_tokens: int = 3, dtype: Optional[torch.dtype] = None) -> ExportResult:
    """Check the pair, write `fmt`, read it back and compare; return what was read back."""
    check_pair(target.config, draft)
    path = save_draft(draft, out_dir, fmt, target, speculative_tokens=speculative_tokens, dtype=dtype)
    keep = dtype or draft.fc.weight.dtype
    loaded, info = load_draft(path, target.config, algorithm=draft.config.algorithm, dtype=keep)
    same_weights(draft, info, loaded)
    if info.aux_layer_ids != draft.config.aux_layer_ids:
        raise LoadError(f"export check failed: layer ids read back as {list(info.aux_layer_ids)}, "
                        f"written {list(draft.config.aux_layer_ids)}")
    return ExportResult(path, fmt, info)


def engine_layer_ids(ids: tuple[int, ...]) -> dict[str, str]:
    """The same captured layers, written in each engine's own numbering."""
    return {
        "SGLang/SpecForge eagle_config (output of layer i)": str([i - 1 for i in ids]),
        "vLLM/speculators/llama.cpp top-level (input to layer i)": str(list(ids)),
    }


# ---------------------------------------------------------------------------- launch lines
def target_shape(target_path: str) -> Optional[ModelConfig]:
    """Layer count, width and vocabulary of a local target dir (any architecture); None if not local."""
    path = Path(target_path)
    if not (path / "config.json").is_file():
        return None
    hf = read_hf_config(path)
    hf = {**hf, **hf.get("text_config", {})}
    return ModelConfig(architecture=(hf.get("architectures") or ["?"])[0],
                       vocab_size=int(hf["vocab_size"]), hidden_size=int(hf["hidden_size"]),
                       intermediate_size=int(hf.get("intermediate_size", 0)),
                       num_layers=int(hf["num_hidden_layers"]),
                       num_heads=int(hf.get("num_attention_heads", 1)),
                       num_kv_heads=int(hf.get("num_key_value_heads", 1)),
                       head_dim=int(hf.get("head_dim") or 0), rms_norm_eps=1e-6, rope=RopeConfig(),
                       max_position=int(hf.get("max_position_embeddings", 0)),
                       tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)))


def layer_id_notes(info: DraftInfo, draft_dir: Path, target: Optional[ModelConfig]) -> list[str]:
    if info.algorithm != "eagle3":
        return []
    top = read_hf_config(draft_dir).get(IDS_KEY)
    defaults = tuple(target.default_aux_layer_ids) if target else None
    notes = [f"captured layers {list(info.aux_layer_ids)} (input to layer i; {info.layer_id_source})"]
    if not top and defaults is not None and info.aux_layer_ids != defaults:
        notes.append(f"WRONG LAYERS in vLLM and llama.cpp: they read only a top-level {IDS_KEY}, "
                     f"which this draft lacks, and capture {list(defaults)} instead of "
                     f"{list(info.aux_layer_ids)}. Re-export it with `eagle3 export`")
    if len(info.aux_layer_ids) != 3:
        notes.append(f"{len(info.aux_layer_ids)} captured layers: SGLang (fc = 3 x hidden) and "
                     "llama.cpp (exactly 3 extract layers) cannot serve it; vLLM can")
    return notes


def format_notes(info: DraftInfo) -> list[str]:
    notes = []
    if info.format == "speculators":
        notes.append("SGLang reads LlamaForCausalLMEagle3 drafts: give it the specforge export")
    if info.algorithm == "eagle":
        notes.append("llama.cpp has no EAGLE-1/2 drafts (only --spec-type draft-eagle3)")
    if info.embedding_source == "checkpoint":
        notes.append("the draft ships its own embedding; every engine uses it instead of the target's")
    return notes


def chain_tokens(num_steps: int, topk: int, num_draft_tokens: Optional[int]) -> tuple[int, list[str]]:
    if topk == 1:
        if num_draft_tokens not in (None, num_steps + 1):
            return num_steps + 1, [f"topk 1 is a chain: num_draft_tokens set to num_steps + 1 = "
                                   f"{num_steps + 1} (was {num_draft_tokens})"]
        return num_steps + 1, []
    return num_draft_tokens or min(topk * num_steps + 1, 64), []


def llama_cpp_lines(draft_dir: str, target_path: str, target_gguf: Optional[str],
                    num_steps: int, llama_cpp: str) -> tuple[str, ...]:
    q = shlex.quote
    convert = f"python {q(llama_cpp + '/convert_hf_to_gguf.py')}"
    draft_gguf = draft_dir.rstrip("/") + ".gguf"
    lines = [f"{convert} {q(draft_dir)} --target-model-dir {q(target_path)} --outfile {q(draft_gguf)}"]
    if target_gguf is None:
        target_gguf = target_path.rstrip("/") + ".gguf"
        lines.append(f"{convert} {q(target_path)} --outfile {q(target_gguf)}")
    lines.append(f"llama-server -m {q(target_gguf)} -md {q(draft_gguf)} --spec-type draft-eagle3 "
                 f"--spec-draft-n-max {num_steps}")
    return tuple(lines)


def launch_lines(draft_dir: str | Path, target_path: str | Path, *, num_steps: int = 5,
                 topk: int = 4, num_draft_tokens: Optional[int] = 8,
                 target_gguf: Optional[str | Path] = None, llama_cpp: str = "llama.cpp",
                 vllm_draft_dir: Optional[str | Path] = None) -> LaunchLines:
    """Ready commands for SGLang, vLLM and llama.cpp, with every caveat this draft has as a note."""
    if num_steps < 1 or topk < 1:
        raise InputError(f"num_steps {num_steps} and topk {topk} must be >= 1")
    target = target_shape(str(target_path))
    info = inspect_draft(draft_dir, target).info
    tokens, notes = chain_tokens(num_steps, topk, num_draft_tokens)
    d, t, q = str(draft_dir), str(target_path), shlex.quote
    algo = "EAGLE3" if info.algorithm == "eagle3" else "EAGLE"
    sglang = (f"python -m sglang.launch_server --model-path {q(t)} --speculative-algorithm {algo} "
              f"--speculative-draft-model-path {q(d)} --speculative-num-steps {num_steps} "
              f"--speculative-eagle-topk {topk} --speculative-num-draft-tokens {tokens}")
    spec = {"method": algo.lower(), "model": str(vllm_draft_dir or d), "num_speculative_tokens": num_steps}
    vllm = f"vllm serve {q(t)} --speculative-config {q(json.dumps(spec))}"
    lcpp = () if info.algorithm != "eagle3" else llama_cpp_lines(
        d, t, None if target_gguf is None else str(target_gguf), num_steps, llama_cpp)
    notes += layer_id_notes(info, Path(draft_dir), target) + format_notes(info)
    if target is None:
        notes.append(f"{t} is not a local directory: layer ids were not checked against the target")
    return LaunchLines(sglang, vllm, lcpp, tuple(notes))


# ---------------------------------------------------------------------------- CLI
def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="eagle3 export", description=(
        "Export a draft to SpecForge/SGLang and vLLM speculators layouts (each read back and checked), "
        "then print launch commands for SGLang, vLLM and llama.cpp."))
    p.add_argument("--draft", required=True, help="draft directory (any readable layout)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--target", default=None, help="target: HF dir or .gguf (default: packaged SmolLM2)")
    p.add_argument("--format", default="all", choices=["all", "specforge", "speculators", "eagle"],
                   help="all = specforge (SGLang, llama.cpp) + speculators (vLLM) in subdirectories")
    p.add_argument("--algorithm", default=None, help="EAGLE3 or EAGLE; must match the checkpoint")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: keep the draft's")
    p.add_argument("--num-steps", type=int, default=5)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--num-draft-tokens", type=int, default=8)
    p.add_argument("--llama-cpp", default="llama.cpp", help="llama.cpp checkout (for convert_hf_to_gguf.py)")
    return p.parse_args(argv)


def resolve_target(spec: Optional[str]) -> tuple[TargetInfo, Optional[Path]]:
    from ..runtime.loader import resolve_model
    src = resolve_model(spec)
    hf = read_hf_config(src.hf_dir)
    config = ModelConfig.from_hf(hf)
    return TargetInfo(config, str(src.hf_dir), tuple(hf.get("architectures") or ())), src.gguf


def run_export(args: argparse.Namespace, target: TargetInfo) -> list[ExportResult]:
    dtype = DTYPES.get(args.dtype) if args.dtype else None
    draft, info = load_draft(args.draft, target.config, algorithm=args.algorithm,
                             dtype=dtype or torch.float32)
    fmts = ["specforge", "speculators"] if args.format == "all" else [args.format]
    if info.algorithm == "eagle" and args.format == "all":
        fmts = ["eagle"]
    out = Path(args.out)
    return [export_draft(draft, out / f if len(fmts) > 1 else out, f, target,
                         speculative_tokens=args.num_steps, dtype=dtype) for f in fmts]


def report(results: list[ExportResult], args: argparse.Namespace, target: TargetInfo,
           target_gguf: Optional[Path]) -> str:
    info = results[0].info
    lines = [f"draft: {args.draft} ({info.algorithm.upper()}) -> {args.out}"]
    lines += [f"  wrote {r.format:<11} {r.path} (read back and compared)" for r in results]
    if info.algorithm == "eagle3":
        lines += [f"  layer ids, {k}: {v}" for k, v in engine_layer_ids(info.aux_layer_ids).items()]
    by_fmt = {r.format: r.path for r in results}
    main_dir = by_fmt.get("specforge", results[0].path)
    launch = launch_lines(main_dir, target.name_or_path, num_steps=args.num_steps, topk=args.topk,
                          num_draft_tokens=args.num_draft_tokens, target_gguf=target_gguf,
                          llama_cpp=args.llama_cpp, vllm_draft_dir=by_fmt.get("speculators"))
    return "\n".join(lines) + "\n\n" + launch.text()


def export_main(argv: list[str]) -> int:
    """`eagle3 export`: returns 0 on success, 2 with a one-paragraph error otherwise."""
    args = parse_args(argv)
    try:
        target, target_gguf = resolve_target(args.target)
        results = run_export(args, target)
        print(report(results, args, target, target_gguf))
    except Eagle3Error as e:
        print(f"eagle3 export: error: {e}", file=sys.stderr)
        return 2
    return 0
