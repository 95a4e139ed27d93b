"""`eagle3 doctor`: catch the zero-acceptance misconfigurations before they cost days.

    eagle3 doctor [--model T] [--draft D] [--launch "LINE"]... [--engine-version vllm=X] [--json] [--no-probe]
    eagle3 doctor --server URL [--api-key K] [--served-model-name NAME] [--model T --draft D] [--json]
    eagle3 doctor --list-checks

Prints a table of checks (pass / warn / fail, each failure with its fix) and exits 1 on a failure
(with --strict also on a warning). The silent failures it knows: doctor/catalog.py.
With --server it checks a running SGLang, vLLM or eagle3 server's acceptance (doctor/server.py).
"""
from __future__ import annotations

import argparse
from typing import Optional

from .. import settings
from ..cli_args import MODEL_HELP
from ..draft.names import resolve_draft_name
from ..engines import ENGINES, version_tuple
from ..errors import InputError, LoadError
from .catalog import listing
from .launch import lint_launch
from .offline import ProbeSettings, run_doctor
from .report import DoctorReport
from .server import ServerSettings, run_server_doctor


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="eagle3 doctor", description=__doc__.splitlines()[0])
    p.add_argument("--model", "--target", dest="model", default=None,
                   help=MODEL_HELP)
    p.add_argument("--draft", default="default",
                   help="draft directory ('default' = the shipped draft for the default target; "
                        "'none' = lint launch lines only)")
    p.add_argument("--launch", action="append", default=[], metavar="LINE",
                   help="an SGLang / vLLM / llama.cpp command line to lint (repeatable)")
    p.add_argument("--engine-version", action="append", default=[], metavar="ENGINE=VERSION",
                   help="the release an engine on a --launch line runs, e.g. vllm=0.32.0 (the Eagle "
                        "3.1 norms run from vLLM 0.22)")
    p.add_argument("--algorithm", type=str.lower, choices=["eagle3", "eagle"],
                   help="the algorithm you intend to run the draft with (checked against the draft)")
    p.add_argument("--json", action="store_true", help="print the report as JSON (for CI); each "
                   "finding carries its silent-failure catalog id")
    p.add_argument("--strict", action="store_true", help="exit 1 on warnings too (slower, not broken)")
    p.add_argument("--list-checks", action="store_true", help="print the catalog of silent failures "
                   "the doctor knows (docs/silent-failures.md) and exit")
    p.add_argument("--no-probe", action="store_true", help="skip the live speculative probe")
    p.add_argument("--max-new-tokens", type=int, default=ProbeSettings.max_new_tokens)
    p.add_argument("--top-k", type=int, default=ProbeSettings.top_k)
    p.add_argument("--depth", type=int, default=ProbeSettings.depth)
    p.add_argument("--num-draft-tokens", type=int, default=ProbeSettings.num_draft_tokens)
    s = p.add_argument_group("a running server (--server)")
    s.add_argument("--server", metavar="URL", help="check a running SGLang / vLLM / eagle3 server at "
                   "this base URL (http://HOST:PORT): its speculation counters over a fixed set of "
                   "prompts; with --draft or --model also our own probe on the same pair")
    s.add_argument("--api-key", default=settings.env("EAGLE3_API_KEY") or None,
                   help="the server's API key, sent as 'Authorization: Bearer KEY' (env EAGLE3_API_KEY)")
    s.add_argument("--served-model-name", default=None, help="the model name to send (default: the "
                   "first that /v1/models lists)")
    s.add_argument("--timeout", type=float, default=ServerSettings.timeout_s,
                   help="seconds to wait for each HTTP answer")
    s.add_argument("--max-tokens", type=int, default=ServerSettings.max_tokens,
                   help="tokens per request sent to the server")
    return p


def resolve_draft(draft: str, target: Optional[str]) -> Optional[str]:
    """The draft directory --draft names for `target` (None: no draft model to inspect)."""
    path = resolve_draft_name(draft, target).path
    return str(path) if path is not None else None


def engine_versions(items: list[str]) -> dict[str, str]:
    """--engine-version vllm=0.32.0 ... -> {"vllm": "0.32.0"}; a bad item raises naming it."""
    out = {}
    for item in items:
        engine, sep, version = item.partition("=")
        if not sep or engine not in ENGINES:
            raise InputError(f"--engine-version {item!r}: expected ENGINE=VERSION with ENGINE one of "
                             f"{', '.join(ENGINES)}, e.g. vllm=0.32.0")
        try:
            version_tuple(version)
        except LoadError as e:
            raise InputError(f"--engine-version {item!r}: {e}") from None
        out[engine] = version
    return out


def doctor_main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.list_checks:
        print(listing(), end="")
        return 0
    settings = ProbeSettings(max_new_tokens=args.max_new_tokens, top_k=args.top_k,
                             depth=args.depth, num_draft_tokens=args.num_draft_tokens)
    if args.server:
        return server_main(args)
    versions = engine_versions(args.engine_version)
    draft = resolve_draft(args.draft, args.model)
    lint_only = draft is None and args.launch and args.draft == "none"
    if lint_only:
        report = DoctorReport()
        for line in args.launch:
            report.extend(lint_launch(line, versions=versions))
    else:
        report = run_doctor(args.model, draft, args.launch, probe=not args.no_probe,
                            algorithm=args.algorithm, settings=settings, versions=versions)
    return finish(report, args)


def finish(report: DoctorReport, args: argparse.Namespace) -> int:
    print(report.to_json() if args.json else report.table())
    return report.strict_exit_code() if args.strict else report.exit_code


def server_main(args: argparse.Namespace) -> int:
    """--server: the offline probe runs only when the pair was named (--draft or --model)."""
    offline = args.draft not in ("default", "none") or args.model is not None
    settings = ServerSettings(max_tokens=args.max_tokens, timeout_s=args.timeout)
    report = run_server_doctor(args.server, args.api_key, args.served_model_name, args.model,
                               resolve_draft(args.draft, args.model) if offline else None,
                               offline=offline, settings=settings)
    return finish(report, args)
