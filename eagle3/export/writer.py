"""Export a draft for the serving engines and print the commands that launch it.

Which layout each engine loads, and where and in which numbering it reads the layer ids, is the table
in eagle3/engines.py: the specforge export (SGLang, llama.cpp) stores the ids in every place those
engines and vLLM read them, the speculators export (vLLM) at the top level. Every export is read back
through formats.load_draft and compared tensor for tensor before it is reported as written, and the
launch notes say what each engine will capture from the directory it is given.
"""
from __future__ import annotations

import json
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Optional

import torch

from ..engines import LLAMA_CPP, SGLANG, VLLM, EngineFacts, describe, engine_reading
from ..errors import InputError, LoadError
from ..models.config import ModelConfig
from ..models.target import TargetFacts
from ..draft import template
from ..draft.contract import check_pair
from ..draft.model import DraftBase
from ..draft.formats import DraftInfo, inspect_draft, load_draft, read_hf_config, save_draft

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


def export_draft(draft: DraftBase, out_dir: str | Path, fmt: str, target: ModelConfig, *,
                 target_path: Optional[str] = None, speculative_tokens: int = 3,
                 dtype: Optional[torch.dtype] = None) -> ExportResult:
    """Check the pair, write `fmt`, read it back and compare; return what was read back.

    `target_path` names the target in the speculators layout (verifier.name_or_path)."""
    check_pair(target, draft)
    path = save_draft(draft, out_dir, fmt, TargetFacts.of(target, target_path),
                      speculative_tokens=speculative_tokens, dtype=dtype)
    keep = dtype or draft.fc.weight.dtype
    loaded, info = load_draft(path, target, algorithm=draft.config.algorithm, dtype=keep)
    same_weights(draft, info, loaded)
    if info.aux_layer_ids != draft.config.aux_layer_ids:
        raise LoadError(f"export check failed: layer ids read back as {list(info.aux_layer_ids)}, "
                        f"written {list(draft.config.aux_layer_ids)}")
    return ExportResult(path, fmt, info)


SERVING = (SGLANG, VLLM, LLAMA_CPP)


def engine_layer_ids(ids: tuple[int, ...]) -> dict[str, str]:
    """The same captured layers, written where (and as) each engine reads them first."""
    out: dict[str, str] = {}
    for slot in dict.fromkeys(e.reads[0] for e in SERVING):
        who = "/".join(e.label for e in SERVING if e.reads[0] == slot)
        out[f"{who} {slot.label} ({slot.meaning})"] = str(slot.as_stored(ids))
    return out


# ---------------------------------------------------------------------------- launch lines
def target_facts(target_path: str) -> Optional[TargetFacts]:
    """Layer count, width and vocabulary of a local target dir (any architecture); None if not local."""
    path = Path(target_path)
    if not (path / "config.json").is_file():
        return None
    return TargetFacts.from_hf(read_hf_config(path), str(path))


def wrong_layers(engine: EngineFacts, info: DraftInfo, draft_dir: Path, target: TargetFacts) -> list[str]:
    """A note when `engine`, given `draft_dir`, captures other layers than the draft was trained on."""
    reading = engine_reading(engine, read_hf_config(draft_dir), target.default_aux_layer_ids)
    if reading.ids == info.aux_layer_ids:
        return []
    return [f"WRONG LAYERS in {engine.label}: it reads {describe(reading)} from {draft_dir} and "
            f"captures {list(reading.ids)} instead of {list(info.aux_layer_ids)}. Re-export it with "
            f"`eagle3 export --format {engine.export_format}`"]


def layer_id_notes(info: DraftInfo, dirs: dict[str, Path], target: Optional[TargetFacts]) -> list[str]:
    """`dirs`: engine name -> the draft directory its launch line is given."""
    if info.algorithm != "eagle3":
        return []
    notes = [f"captured layers {list(info.aux_layer_ids)} (input to layer i; {info.layer_id_source})"]
    if target is not None:
        for engine in SERVING:
            notes += wrong_layers(engine, info, dirs[engine.name], target)
    fixed = [e.label for e in SERVING if e.num_aux_layers not in (None, len(info.aux_layer_ids))]
    if fixed:
        anyc = [e.label for e in SERVING if e.num_aux_layers is None]
        notes.append(f"{len(info.aux_layer_ids)} captured layers: {' and '.join(fixed)} serve only "
                     f"3-layer drafts (fc = 3 x hidden; exactly 3 extract layers) and cannot serve it; "
                     f"{' and '.join(anyc)} can")
    return notes


def format_notes(info: DraftInfo) -> list[str]:
    notes = []
    if info.format not in SGLANG.layouts:
        notes.append(f"SGLang reads {', '.join(SGLANG.layouts)} drafts, not {info.format}: give it the "
                     f"{SGLANG.export_format} export")
    if info.algorithm not in LLAMA_CPP.methods:
        notes.append(f"llama.cpp has no EAGLE-1/2 drafts (only {LLAMA_CPP.method_option} "
                     f"{LLAMA_CPP.methods['eagle3']})")
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
    lines.append(f"llama-server -m {q(target_gguf)} -md {q(draft_gguf)} {LLAMA_CPP.method_option} "
                 f"{LLAMA_CPP.methods['eagle3']} "
                 f"--spec-draft-n-max {num_steps}")
    return tuple(lines)


def launch_lines(draft_dir: str | Path, target_path: str | Path, *, num_steps: int = 5,
                 topk: int = 4, num_draft_tokens: Optional[int] = 8,
                 target_gguf: Optional[str | Path] = None, llama_cpp: str = "llama.cpp",
                 vllm_draft_dir: Optional[str | Path] = None) -> LaunchLines:
    """Ready commands for SGLang, vLLM and llama.cpp, with every caveat this draft has as a note."""
    if num_steps < 1 or topk < 1:
        raise InputError(f"num_steps {num_steps} and topk {topk} must be >= 1")
    target = target_facts(str(target_path))
    info = inspect_draft(draft_dir, target).info
    tokens, notes = chain_tokens(num_steps, topk, num_draft_tokens)
    d, t, q = str(draft_dir), str(target_path), shlex.quote
    vllm_dir = str(vllm_draft_dir or d)
    sglang = (f"python -m sglang.launch_server --model-path {q(t)} {SGLANG.method_option} "
              f"{SGLANG.methods[info.algorithm]} --speculative-draft-model-path {q(d)} "
              f"--speculative-num-steps {num_steps} --speculative-eagle-topk {topk} "
              f"--speculative-num-draft-tokens {tokens}")
    spec = {"method": VLLM.methods[info.algorithm], "model": vllm_dir, "num_speculative_tokens": num_steps}
    vllm = f"vllm serve {q(t)} --speculative-config {q(json.dumps(spec))}"
    lcpp = () if info.algorithm not in LLAMA_CPP.methods else llama_cpp_lines(
        d, t, None if target_gguf is None else str(target_gguf), num_steps, llama_cpp)
    dirs = {"sglang": Path(d), "vllm": Path(vllm_dir), "llama.cpp": Path(d)}
    notes += layer_id_notes(info, dirs, target) + format_notes(info)
    if target is None:
        notes.append(f"{t} is not a local directory: layer ids were not checked against the target")
    return LaunchLines(sglang, vllm, lcpp, tuple(notes))


class ExportTarget(NamedTuple):
    config: ModelConfig
    path: str                   # the HF directory (named in the speculators layout and launch lines)
    gguf: Optional[Path]        # the GGUF it came from, if any (llama-server serves it)


def resolve_target(spec: Optional[str]) -> ExportTarget:
    from ..runtime.loader import resolve_model
    src = resolve_model(spec)
    return ExportTarget(ModelConfig.from_hf(read_hf_config(src.hf_dir)), str(src.hf_dir), src.gguf)


def record_template(source: Path, out: Path, target_path: str) -> None:
    """The chat template the draft was trained with, as a fingerprint in config.json and CARD.md:
    the source draft's record, else its target's template (the one training applied)."""
    if (source / "CARD.md").is_file() and not (out / "CARD.md").exists():
        shutil.copyfile(source / "CARD.md", out / "CARD.md")
    sha = template.recorded(read_json_dir(source))
    where = f"recorded in {source}"
    if sha is None:
        sha, where = template.fingerprint(template.read_template(target_path)), f"target {target_path}"
    if sha is not None:
        template.record(out, sha, where)


def read_json_dir(path: Path) -> Optional[dict]:
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
