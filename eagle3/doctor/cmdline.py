"""Parse serving command lines (SGLang, vLLM, llama.cpp) into canonical options, without running them.

Option names are the engines' own, read from their sources (the option that names the algorithm is
engines.py's `method_option`, with the algorithm names):
- SGLang `python -m sglang.launch_server` (sglang/srt/arg_groups spec namespace): --model-path
  (alias --model), --speculative-algorithm, --speculative-draft-model-path (alias
  --speculative-draft-model), --speculative-num-steps, --speculative-eagle-topk,
  --speculative-num-draft-tokens, --speculative-token-map, --speculative-draft-model-quantization,
  --context-length, --chat-template. argparse accepts unambiguous prefixes
  (`--speculative-algo`), so we do too.
- vLLM `vllm serve MODEL` / `python -m vllm.entrypoints.openai.api_server --model MODEL`:
  --speculative-config JSON (also `--speculative-config.KEY VALUE`), the older
  --speculative-model / --num-speculative-tokens / --speculative-disable-by-batch-size,
  --max-model-len, --chat-template; `_` and `-` are interchangeable.
- llama.cpp `llama-server` (common/arg.cpp in the llama-cpp-python 0.3.36 sdist): -m/--model,
  -md/--model-draft/--spec-draft-model, --spec-type, --spec-draft-n-max, --spec-draft-n-min;
  --draft/--draft-n/--draft-max/--draft-min were removed (the binary refuses them).
- llama.cpp `convert_hf_to_gguf.py DRAFT_DIR --target-model-dir T --outfile D.gguf`.
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from typing import Optional

from .. import engines
from ..errors import InputError

NUMBER = re.compile(r"^-?\d+(\.\d+)?$")


@dataclass(frozen=True)
class EngineSpec:
    name: str
    options: dict[str, str]                 # every spelling -> canonical key
    flags: frozenset[str] = frozenset()     # spellings that take no value
    prefixes: tuple[str, ...] = ()          # full names that may be abbreviated (argparse)
    underscores: bool = False               # `_` == `-` in option names (vLLM)


def _table(groups: dict[str, tuple[str, ...]]) -> dict[str, str]:
    return {spelling: key for key, spellings in groups.items() for spelling in spellings}


# SGLang's speculative option names (all of them, so that prefix ambiguity is judged like argparse).
SGLANG_SPEC_NAMES = (
    engines.SGLANG.method_option, "--speculative-draft-model-path", "--speculative-draft-model-revision",
    "--speculative-draft-load-format", "--speculative-num-steps", "--speculative-eagle-topk",
    "--speculative-num-draft-tokens", "--speculative-dflash-block-size",
    "--speculative-dspark-block-size", "--speculative-accept-threshold-single",
    "--speculative-accept-threshold-acc", "--speculative-use-rejection-sampling",
    "--speculative-token-map", "--speculative-attention-mode",
    "--speculative-draft-attention-backend", "--speculative-dsa-topk-backend",
    "--speculative-draft-kv-cache-dtype", "--speculative-draft-window-size",
    "--speculative-moe-runner-backend", "--speculative-moe-a2a-backend",
    "--speculative-draft-model-quantization", "--speculative-skip-dp-mlp-sync",
    "--speculative-adaptive", "--speculative-adaptive-config")

SGLANG = EngineSpec(
    name="sglang",
    options=_table({
        "model": ("--model-path", "--model"),
        "algorithm": (engines.SGLANG.method_option,),
        "draft": ("--speculative-draft-model-path", "--speculative-draft-model"),
        "steps": ("--speculative-num-steps",),
        "topk": ("--speculative-eagle-topk",),
        "num_draft_tokens": ("--speculative-num-draft-tokens",),
        "token_map": ("--speculative-token-map",),
        "draft_quantization": ("--speculative-draft-model-quantization",),
        "context_length": ("--context-length",),
        "chat_template": ("--chat-template",),
    }),
    flags=frozenset({"--trust-remote-code", "--speculative-use-rejection-sampling",
                     "--enable-multi-layer-eagle", "--speculative-adaptive",
                     "--enable-torch-compile", "--enable-dp-attention", "--disable-radix-cache",
                     "--disable-cuda-graph", "--enable-metrics", "--skip-server-warmup"}),
    prefixes=SGLANG_SPEC_NAMES + ("--model-path",),
)

VLLM = EngineSpec(
    name="vllm",
    options=_table({
        "model": ("--model",),
        "speculative_config": ("--speculative-config",),
        "old_draft": ("--speculative-model",),
        "old_num_tokens": ("--num-speculative-tokens",),
        "old_disable_by_batch_size": ("--speculative-disable-by-batch-size",),
        "max_model_len": ("--max-model-len",),
        "chat_template": ("--chat-template",),
    }),
    flags=frozenset({"--trust-remote-code", "--enforce-eager", "--enable-prefix-caching",
                     "--no-enable-prefix-caching", "--enable-chunked-prefill",
                     "--disable-log-requests", "--disable-log-stats", "--enable-auto-tool-choice"}),
    underscores=True,
)

LLAMA_SERVER = EngineSpec(
    name="llama.cpp",
    options=_table({
        "model": ("-m", "--model"),
        "draft": ("-md", "--model-draft", "--spec-draft-model"),
        "draft_hf": ("--spec-draft-hf", "-hfd", "-hfrd", "--hf-repo-draft"),
        "spec_type": (engines.LLAMA_CPP.method_option,),
        "n_max": ("--spec-draft-n-max",),
        "n_min": ("--spec-draft-n-min",),
        "removed_draft_n": ("--draft", "--draft-n", "--draft-max", "--draft-min", "--draft-n-min"),
    }),
    flags=frozenset({"--eagle3", "--no-mmap", "--mlock", "--jinja", "--verbose", "-v",
                     "--cont-batching", "--no-webui", "--metrics", "--embedding"}),
)

LLAMA_CONVERT = EngineSpec(
    name="llama.cpp-convert",
    options=_table({
        "target_dir": ("--target-model-dir",),
        "outfile": ("--outfile",),
        "outtype": ("--outtype",),
    }),
    flags=frozenset({"--vocab-only", "--bigendian", "--use-temp-file", "--no-lazy", "--verbose",
                     "--dry-run", "--no-tensor-first-split", "--fuse-qkv", "--fp8-as-q8",
                     "--remote", "--mmproj", "--mistral-format", "--print-supported-models",
                     "--disable-mistral-community-chat-template"}),
)


@dataclass(frozen=True)
class Command:
    engine: str                              # sglang | vllm | llama.cpp | llama.cpp-convert
    argv: tuple[str, ...]
    options: dict[str, str] = field(default_factory=dict)   # canonical key -> value ("" = flag)
    positionals: tuple[str, ...] = ()
    dotted: dict[str, str] = field(default_factory=dict)    # vLLM --speculative-config.KEY VALUE
    notes: tuple[str, ...] = ()              # ambiguous prefixes and such


# ---------------------------------------------------------------------------- splitting
def split_commands(line: str) -> list[list[str]]:
    """One argv per command: line continuations joined, split on newlines, `&&`, `;`."""
    text = re.sub(r"\\\r?\n", " ", line)
    commands: list[list[str]] = []
    for physical in text.splitlines():
        try:
            tokens = shlex.split(physical, comments=True)
        except ValueError as e:
            raise InputError(f"cannot parse the launch line ({e}); check the quoting") from None
        current: list[str] = []
        for tok in tokens:
            if tok in ("&&", ";", "||", "|"):
                commands.append(current)
                current = []
            else:
                current.append(tok)
        commands.append(current)
    return [c for c in (_strip_env(c) for c in commands) if c]


def _strip_env(argv: list[str]) -> list[str]:
    i = 0
    while i < len(argv) and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", argv[i]):
        i += 1
    if i < len(argv) and argv[i] in ("env", "nohup", "exec", "time"):
        return _strip_env(argv[i + 1:])
    return argv[i:]


def detect(argv: list[str]) -> Optional[tuple[EngineSpec, list[str]]]:
    """(engine, the arguments after the program) or None if the command is not a known engine."""
    for i, tok in enumerate(argv):
        base = tok.rsplit("/", 1)[-1]
        if tok == "sglang.launch_server" or base == "launch_server.py":
            return SGLANG, argv[i + 1:]
        if base == "vllm" and i + 1 < len(argv) and argv[i + 1] == "serve":
            return VLLM, argv[i + 2:]
        if tok == "vllm.entrypoints.openai.api_server":
            return VLLM, argv[i + 1:]
        if base in ("llama-server", "llama-cli", "llama-speculative"):
            return LLAMA_SERVER, argv[i + 1:]
        if base == "convert_hf_to_gguf.py":
            return LLAMA_CONVERT, argv[i + 1:]
    return None


# ---------------------------------------------------------------------------- options
def canonical(spec: EngineSpec, spelling: str) -> tuple[Optional[str], Optional[str]]:
    """(canonical key or None, note) for one option spelling, resolving argparse prefixes."""
    if spec.underscores:
        spelling = "--" + spelling[2:].replace("_", "-") if spelling.startswith("--") else spelling
    if spelling in spec.options:
        return spec.options[spelling], None
    matches = [n for n in spec.prefixes if n.startswith(spelling)] if spelling.startswith("--") \
        else []
    if len(matches) == 1 and matches[0] in spec.options:
        return spec.options[matches[0]], None
    if len(matches) > 1:
        return None, f"{spelling} is an ambiguous prefix of {', '.join(matches)} (argparse refuses it)"
    return None, None


def parse(argv: list[str]) -> Optional[Command]:
    found = detect(argv)
    if found is None:
        return None
    spec, rest = found
    options: dict[str, str] = {}
    dotted: dict[str, str] = {}
    positionals: list[str] = []
    notes: list[str] = []
    i = 0
    while i < len(rest):
        tok = rest[i]
        if not tok.startswith("-") or NUMBER.match(tok):
            positionals.append(tok)
            i += 1
            continue
        name, value = (tok.split("=", 1) + [None])[:2] if "=" in tok else (tok, None)
        takes_value = name not in spec.flags
        if value is None and takes_value and i + 1 < len(rest) and \
                (not rest[i + 1].startswith("-") or NUMBER.match(rest[i + 1])):
            value = rest[i + 1]
            i += 1
        i += 1
        if spec.underscores and name.startswith("--speculative") and "." in name:
            dotted[name.split(".", 1)[1].replace("-", "_")] = value or ""
            continue
        key, note = canonical(spec, name)
        if note:
            notes.append(note)
        if key:
            options[key] = value if value is not None else ""
    return Command(spec.name, tuple(argv), options, tuple(positionals), dotted, tuple(notes))


def parse_line(line: str) -> list[Command]:
    """Every recognised engine command in `line` (unknown commands are skipped)."""
    return [c for c in (parse(argv) for argv in split_commands(line)) if c is not None]
