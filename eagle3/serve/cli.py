"""`eagle3 serve`: flags in the style of SGLang/vLLM; binds 127.0.0.1 unless told otherwise."""
from __future__ import annotations

import argparse
import importlib
import logging
from typing import Optional, Sequence

from .. import settings
from ..cli_args import add_run_args, add_spec_args, run_config_from_args, spec_from_args
from ..errors import Eagle3Error
from ..generate.batch import DEFAULT_MAX_BATCH, PREFIX_CACHE_TOKENS
from ..runtime.assets import DEFAULT_MODEL

log = logging.getLogger("eagle3.serve")

SERVE_MODULES = ("fastapi", "uvicorn", "prometheus_client")    # the 'serve' extra


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="eagle3 serve",
                                description="OpenAI-compatible server with EAGLE-3 speculation")
    p.add_argument("--model", default=None,
                   help="target: .gguf file or HF directory (default: the packaged SmolLM2-135M)")
    add_spec_args(p)        # --draft, --algorithm, --top-k, --depth, --num-draft-tokens, --policy
    add_run_args(p)         # --weights, --draft-weights, --device, --threads
    p.add_argument("--served-model-name", default=None,
                   help="model id in /v1/models and requests (default: the --model value)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=settings.env("EAGLE3_API_KEY") or None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (env EAGLE3_API_KEY)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests waiting for the engine before answering 503 (default 64)")
    p.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH,
                   help="plain requests decoded together, continuous batching (default "
                        f"{DEFAULT_MAX_BATCH}: an {DEFAULT_MAX_BATCH}-row forward costs ~1.35x a one-row "
                        "forward on the bf16 kernels; each slot holds a max-model-len KV cache). "
                        "With a draft, a greedy request that runs alone decodes speculatively and "
                        "joins the batch when another arrives. 1: one sequence at a time")
    p.add_argument("--prefix-cache-tokens", type=int, default=PREFIX_CACHE_TOKENS,
                   help="prompt tokens whose k/v are kept for later prompts that start the same way "
                        f"(default {PREFIX_CACHE_TOKENS}; with --max-batch > 1 on a row-stable "
                        "layout, as every default precision is; 0: off)")
    p.add_argument("--max-model-len", type=int, default=2048,
                   help="context length: prompt + max_tokens (default 2048)")
    p.add_argument("--learn", default=None, metavar="DIR",
                   help="learn from traffic: capture finished requests (prompt and reply token ids: "
                        "users' text) under DIR, fine-tune the draft on them in a low-priority "
                        "process, swap in versions that pass the gate (docs/learning.md). Off by default")
    p.add_argument("--learn-min-tokens", type=int, default=20000,
                   help="--learn: new captured tokens that start a learning round (default 20000)")
    p.add_argument("--learn-max-bytes", type=int, default=2 << 30,
                   help="--learn: the captured traffic's size bound, oldest shards dropped first "
                        "(default 2 GiB)")
    p.add_argument("--learn-replay", default=None, metavar="FILE",
                   help="--learn: general conversations (regenerated data JSONL) mixed into every "
                        "round so acceptance elsewhere does not fall")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    return p


def serve_main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse flags, load the engine, run uvicorn until interrupted. Returns the exit status."""
    from .. import tune_process
    tune_process()          # once a process: `eagle3 serve` has already, before torch loaded
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.max_queue < 1 or args.max_model_len < 2 or args.max_batch < 1 or args.prefix_cache_tokens < 0:
        parser.error("--max-queue and --max-batch must be >= 1, --max-model-len >= 2 and "
                     "--prefix-cache-tokens >= 0")
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    missing = missing_modules(SERVE_MODULES)
    if missing:             # checked before the model load, which can take minutes
        log.error("eagle3 serve needs the 'serve' extra, which is not installed (missing: %s): "
                  "pip install 'eagle3[serve]' (in a checkout: pip install -e '.[serve]')",
                  ", ".join(missing))
        return 2
    try:
        from ..api import load_engine
        engine = load_engine(model=args.model, draft=args.draft, spec=spec_from_args(args),
                             config=run_config_from_args(args), max_model_len=args.max_model_len,
                             algorithm=args.algorithm)
    except Eagle3Error as e:
        log.error("%s", e)
        return 2
    if engine.draft is not None:        # /health names the draft whose own acceptance it reports
        engine.draft_name = draft_label(args.draft, args.model)
    import uvicorn

    from .app import create_app
    name = args.served_model_name or args.model or DEFAULT_MODEL
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        log.warning("listening on %s without --api-key: anyone who can reach it may use it", args.host)
    learn = learn_controller(args, engine) if args.learn else None
    app = create_app(engine, model_name=name, api_key=args.api_key, max_queue=args.max_queue,
                     max_batch=args.max_batch, prefix_cache_tokens=args.prefix_cache_tokens,
                     learn=learn)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=5)
    return 0


def draft_label(draft: Optional[str], model: Optional[str]) -> str:
    """The draft's path as /health names it (`default`: the shipped draft's)."""
    from ..draft.names import DEFAULT_DRAFT_NAME, resolve_draft_name
    return str(resolve_draft_name(draft, model).path if draft == DEFAULT_DRAFT_NAME else draft)


def learn_controller(args: argparse.Namespace, engine):
    """The --learn controller, or None (logged) when DIR belongs to another target: the server
    then serves its draft without learning."""
    from pathlib import Path
    from ..api import load_draft_layout
    from ..draft.names import resolve_draft_name
    from ..learn import LearnController, LearnOptions, target_identity
    if args.learn_min_tokens < 1 or args.learn_max_bytes < 1:
        raise SystemExit("--learn-min-tokens and --learn-max-bytes must be >= 1")
    served = resolve_draft_name(args.draft, args.model).path
    extra = (["--model", args.model] if args.model else []) + (
        ["--replay", args.learn_replay] if args.learn_replay else [])
    opts = LearnOptions(Path(args.learn), args.learn_min_tokens, args.learn_max_bytes, tuple(extra))
    config = run_config_from_args(args)
    try:
        return LearnController(opts, target_identity(args.model, engine.target.config), served,
                               lambda path: load_draft_layout(path, engine.target, config, args.algorithm))
    except Eagle3Error as e:
        log.error("--learn %s: %s. Serving without learning", args.learn, e)
        return None


def missing_modules(names: Sequence[str]) -> list[str]:
    missing = []
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    return missing
