"""`eagle3 doctor`: catch the zero-acceptance misconfigurations before they cost days.

    eagle3 doctor [--target T] [--draft D] [--launch "LINE"]... [--json] [--no-probe]

Prints a table of checks (pass / warn / fail, each failure with its fix) and exits 1 on a failure.
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional

from .checks import ProbeSettings, run_doctor
from .launch import DraftFacts, TargetFacts, lint_launch
from .report import Check, DoctorReport


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="eagle3 doctor", description=__doc__.splitlines()[0])
    p.add_argument("--target", default=None,
                   help="target: HF directory or .gguf (default: the packaged SmolLM2)")
    p.add_argument("--draft", default="default",
                   help="draft directory ('default' = the shipped draft for the default target; "
                        "'none' = lint launch lines only)")
    p.add_argument("--launch", action="append", default=[], metavar="LINE",
                   help="an SGLang / vLLM / llama.cpp command line to lint (repeatable)")
    p.add_argument("--algorithm", type=str.lower, choices=["eagle3", "eagle"],
                   help="the algorithm you intend to run the draft with (checked against the draft)")
    p.add_argument("--json", action="store_true", help="print the report as JSON (for CI)")
    p.add_argument("--no-probe", action="store_true", help="skip the live speculative probe")
    p.add_argument("--max-new-tokens", type=int, default=ProbeSettings.max_new_tokens)
    p.add_argument("--top-k", type=int, default=ProbeSettings.top_k)
    p.add_argument("--depth", type=int, default=ProbeSettings.depth)
    p.add_argument("--num-draft-tokens", type=int, default=ProbeSettings.num_draft_tokens)
    return p


def resolve_draft(draft: str, target: Optional[str]) -> Optional[str]:
    if draft in ("none", ""):
        return None
    if draft == "default":
        from ..api import default_draft_path
        path = default_draft_path(target)
        return str(path) if path is not None else None
    return draft


def doctor_main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    settings = ProbeSettings(max_new_tokens=args.max_new_tokens, top_k=args.top_k,
                             depth=args.depth, num_draft_tokens=args.num_draft_tokens)
    draft = resolve_draft(args.draft, args.target)
    lint_only = draft is None and args.launch and args.draft == "none"
    if lint_only:
        report = DoctorReport()
        for line in args.launch:
            report.extend(lint_launch(line))
    else:
        report = run_doctor(args.target, draft, args.launch, probe=not args.no_probe,
                            algorithm=args.algorithm, settings=settings)
    print(report.to_json() if args.json else report.table())
    return report.exit_code


__all__ = ["Check", "DoctorReport", "DraftFacts", "ProbeSettings", "TargetFacts", "doctor_main",
           "lint_launch", "run_doctor"]


if __name__ == "__main__":
    sys.exit(doctor_main(sys.argv[1:]))
