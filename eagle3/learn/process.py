"""Command lines of the learner: `python -m eagle3.learn --dir DIR` (one round, as the server starts
it: nice 19, one thread) and `eagle3 train --from-traffic DIR|FILE.jsonl` (the same round offline:
our captures, or an OpenAI-style log of another engine whose replies are tokenized here and whose
features the target computes here), which also exports the new version for vLLM."""
from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path
from typing import Optional, Sequence

from ..errors import Eagle3Error, InputError
from .learner import LearnConfig, learn_round

log = logging.getLogger("eagle3.learn")


def add_learn_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=None, help="the target (default: the packaged SmolLM2)")
    ap.add_argument("--replay", default=None, help="general conversations (regenerated data JSONL) "
                    "mixed into every round")
    ap.add_argument("--replay-share", type=float, default=LearnConfig.replay_share)
    ap.add_argument("--epochs", type=int, default=None,
                    help="passes over a round's data (default: 3 fine-tuning a served draft, 12 for a first draft)")
    ap.add_argument("--lr", type=float, default=None,
                    help="peak lr (default: 5e-5 fine-tuning a served draft, 3e-4 for a first draft)")
    ap.add_argument("--margin", type=float, default=LearnConfig.margin)
    ap.add_argument("--heldout-fraction", type=float, default=LearnConfig.heldout_fraction)
    ap.add_argument("--autocast", default=LearnConfig.autocast, choices=["bf16", "none"])
    ap.add_argument("--eval-every", type=int, default=LearnConfig.eval_every,
                    help="log the held-out est. tau every N training steps (0: the gate's alone)")


def config_from(args: argparse.Namespace, root: Path) -> LearnConfig:
    return LearnConfig(str(root), args.model, args.heldout_fraction, args.replay, args.replay_share,
                       args.epochs, args.lr, margin=args.margin, autocast=args.autocast,
                       eval_every=args.eval_every)


def load_reference(model: Optional[str]):
    """The target's reference model (fp32; features as `eagle3 train` computes them) and tokenizer."""
    from ..runtime.loader import load_model, load_tokenizer, resolve_model
    src = resolve_model(model)
    return load_model(src.hf_dir), load_tokenizer(src.hf_dir)


def learner_main(argv: Optional[Sequence[str]] = None) -> int:
    """One round for the server (`python -m eagle3.learn --dir DIR`); 0 when it finished."""
    import torch
    from .learner import wait_while_paused
    ap = argparse.ArgumentParser(prog="python -m eagle3.learn")
    ap.add_argument("--dir", required=True, type=Path)
    add_learn_args(ap)
    args = ap.parse_args(argv)
    logging.basicConfig(level="INFO", format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    cfg = config_from(args, args.dir)
    try:
        target, _ = load_reference(cfg.model)
        card = learn_round(cfg, target, wait_while_paused(args.dir))
    except Eagle3Error as e:
        log.error("learn: the round stopped: %s", e)
        return 2
    print(json.dumps({"version": card["version"], "status": card["status"], "gate": card["gate"]["reason"]}))
    return 0


def from_traffic_main(argv: Sequence[str]) -> int:
    """`eagle3 train --from-traffic DIR|FILE.jsonl [--out DIR] [--draft D]`."""
    ap = argparse.ArgumentParser(prog="eagle3 train --from-traffic")
    ap.add_argument("--from-traffic", required=True, type=Path,
                    help="a --learn directory, or an OpenAI-style JSONL log (messages + reply)")
    ap.add_argument("--out", type=Path, default=None,
                    help="for a JSONL log: the learn directory to make (default runs/from-traffic)")
    ap.add_argument("--draft", default="default", help="the draft to start from ('default': the "
                    "shipped one for the default target; 'none': initialise a first draft)")
    ap.add_argument("--threads", type=int, default=None)
    add_learn_args(ap)
    args = ap.parse_args(argv)
    logging.basicConfig(level="INFO", format="%(levelname)s %(name)s: %(message)s")
    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
    target, tokenizer = load_reference(args.model)
    root = prepare_dir(args, target, tokenizer)
    card = learn_round(config_from(args, root), target)
    print(f"v{card['version']} {card['status']}: {card['gate']['reason']}")
    if card["status"] == "served":
        export_for_engines(root, card["version"], target)
    return 0


def prepare_dir(args: argparse.Namespace, target, tokenizer) -> Path:
    """The learn directory: as given, or one made from a JSONL log (its records as one shard)."""
    from . import versions
    from .capture import check_identity, write_atomic
    from .identity import target_identity
    src = args.from_traffic
    root = src if src.is_dir() else (args.out or Path("runs/from-traffic"))
    if not src.is_dir():
        if not src.is_file():
            raise InputError(f"--from-traffic {src}: neither a learn directory nor a JSONL file")
        from .traffic import openai_records
        recs = openai_records(src, tokenizer)
        (root / "traffic").mkdir(parents=True, exist_ok=True)
        per = max(1, min(16, len(recs) // 8))       # shards as the capture writes them (a tail to hold out)
        for k in range(0, len(recs), per):
            part = recs[k:k + per]
            tokens = sum(len(r["prompt_ids"]) + len(r["response_ids"]) for r in part)
            write_atomic(root / "traffic" / f"t-{k // per + 1:06d}-n{tokens}.jsonl",
                         "".join(json.dumps(r) + "\n" for r in part))
    check_identity(root, target_identity(args.model, target.config))
    versions.ensure_v0(root, starting_draft(args.draft, args.model))
    return root


def starting_draft(draft: str, model: Optional[str]) -> Optional[Path]:
    """The draft a learning directory starts from (draft.names: the one reading of draft names)."""
    from ..draft.names import resolve_draft_name
    return resolve_draft_name(draft, model).path


def export_for_engines(root: Path, version: int, target) -> None:
    """vN is in the SpecForge layout (SGLang, llama.cpp); vN-speculators for vLLM."""
    from ..draft.formats import load_draft
    from ..export.writer import export_draft
    vdir = root / "drafts" / f"v{version}"
    draft = load_draft(vdir, target.config, target=target).draft
    out = export_draft(draft, root / "drafts" / f"v{version}-speculators", "speculators", target.config)
    print(f"exported: {vdir} (SGLang, llama.cpp: specforge layout), {out.path} (vLLM: speculators)")
