"""`eagle3 export`: the flags, the export run and its report (the layouts themselves: writer.py)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from ..cli_args import MODEL_HELP
from ..errors import Eagle3Error
from ..draft.formats import load_draft
from .writer import DTYPES, ExportResult, ExportTarget, engine_layer_ids, export_draft, launch_lines, \
    record_template, resolve_target


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="eagle3 export", description=(
        "Export a draft to SpecForge/SGLang and vLLM speculators layouts (each read back and checked), "
        "then print launch commands for SGLang, vLLM and llama.cpp."))
    p.add_argument("--draft", required=True, help="draft directory (any readable layout)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--model", "--target", dest="model", default=None,
                   help=MODEL_HELP)
    p.add_argument("--format", default="all", choices=["all", "specforge", "speculators", "eagle"],
                   help="all = specforge (SGLang, llama.cpp) + speculators (vLLM) in subdirectories")
    p.add_argument("--algorithm", default=None, help="EAGLE3 or EAGLE; must match the checkpoint")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: keep the draft's")
    p.add_argument("--top-k", "--topk", dest="top_k", type=int, default=4,
                   help="tree in the launch lines: children per node (as generate's --top-k)")
    p.add_argument("--depth", "--num-steps", dest="depth", type=int, default=5,
                   help="tree in the launch lines: draft forwards per step (as generate's --depth)")
    p.add_argument("--num-draft-tokens", type=int, default=8,
                   help="tree in the launch lines: nodes verified per step, root included")
    p.add_argument("--llama-cpp", default="llama.cpp", help="llama.cpp checkout (for convert_hf_to_gguf.py)")
    return p.parse_args(argv)


def run_export(args: argparse.Namespace, target: ExportTarget) -> list[ExportResult]:
    dtype = DTYPES.get(args.dtype) if args.dtype else None
    draft, info = load_draft(args.draft, target.config, algorithm=args.algorithm,
                             dtype=dtype or torch.float32)
    fmts = ["specforge", "speculators"] if args.format == "all" else [args.format]
    if info.algorithm == "eagle" and args.format == "all":
        fmts = ["eagle"]
    out = Path(args.out)
    results = [export_draft(draft, out / f if len(fmts) > 1 else out, f, target.config,
                            target_path=target.path, speculative_tokens=args.depth, dtype=dtype)
               for f in fmts]
    for r in results:
        record_template(Path(args.draft), r.path, target.path)
    return results


def report(results: list[ExportResult], args: argparse.Namespace, target: ExportTarget) -> str:
    info = results[0].info
    lines = [f"draft: {args.draft} ({info.algorithm.upper()}) -> {args.out}"]
    lines += [f"  wrote {r.format:<11} {r.path} (read back and compared)" for r in results]
    if info.algorithm == "eagle3":
        lines += [f"  layer ids, {k}: {v}" for k, v in engine_layer_ids(info.aux_layer_ids).items()]
    by_fmt = {r.format: r.path for r in results}
    main_dir = by_fmt.get("specforge", results[0].path)
    launch = launch_lines(main_dir, target.path, num_steps=args.depth, topk=args.top_k,
                          num_draft_tokens=args.num_draft_tokens, target_gguf=target.gguf,
                          llama_cpp=args.llama_cpp, vllm_draft_dir=by_fmt.get("speculators"))
    return "\n".join(lines) + "\n\n" + launch.text()


def export_main(argv: list[str]) -> int:
    """`eagle3 export`: returns 0 on success, 2 with a one-paragraph error otherwise."""
    args = parse_args(argv)
    try:
        target = resolve_target(args.model)
        results = run_export(args, target)
        print(report(results, args, target))
    except Eagle3Error as e:
        print(f"eagle3 export: error: {e}", file=sys.stderr)
        return 2
    return 0
