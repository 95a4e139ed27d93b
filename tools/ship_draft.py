"""Export a training checkpoint (runs/<run>/checkpoint.pt) as a draft directory (SpecForge layout).

    python tools/ship_draft.py --run runs/smollm2 --out eagle3/drafts/smollm2-135m-eagle3 --dtype bfloat16
Works on any checkpoint, also while training continues (checkpoints are replaced atomically).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from eagle3.runtime.loader import load_model, resolve_model
from eagle3.draft.model import DraftConfig, Eagle3Draft
from eagle3.draft.formats import load_draft, save_draft
from eagle3.train.config import TrainConfig
from eagle3.train.trainer import load_checkpoint


def draft_from_checkpoint(ckpt: dict, target) -> Eagle3Draft:
    cfg = TrainConfig.from_dict(json.loads(ckpt["config"]))
    vd = ckpt["draft"]["lm_head.weight"].shape[0]
    draft = Eagle3Draft(DraftConfig.for_target(target.config, vd, cfg.aux_layer_ids))
    draft.set_embedding(target.embed_tokens.weight.detach())
    draft.load_state_dict({**ckpt["draft"], "embed_tokens.weight": target.embed_tokens.weight})
    return draft


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--run", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--format", default="specforge")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args(argv)
    ckpt = load_checkpoint(args.run / "checkpoint.pt")
    target = load_model(resolve_model(TrainConfig.from_dict(json.loads(ckpt["config"])).target).hf_dir)
    draft = draft_from_checkpoint(ckpt, target)
    path = save_draft(draft, args.out, args.format, target.config, dtype=getattr(torch, args.dtype))
    loaded = load_draft(path, target.config)                      # must read back through the reader
    print(json.dumps({"out": str(path), "step": ckpt["step"], "cursor": ckpt["cursor"],
                      "num_samples": ckpt["num_samples"],
                      "draft_vocab_size": loaded.draft.config.draft_vocab_size}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
