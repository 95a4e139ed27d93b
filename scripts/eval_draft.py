"""Held-out teacher-forced accuracy of drafts on one data split (the training eval, for comparing runs).

    python scripts/eval_draft.py --data runs/data/conversations.jsonl --limit 1760 \
        runs/smollm2/checkpoint.pt runs/smollm2_phase4/checkpoint.pt eagle3/drafts/smollm2-135m-eagle3
Every k-th conversation of the first --limit ones (k = 1 / eval_fraction, as in training) is scored
with the training-time-test forward: per-step accuracy and the chain estimate of tau.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from eagle3.runtime.loader import load_model, resolve_model
from eagle3.train.config import TrainConfig
from eagle3.train.features import FeatureSource, load_conversations
from eagle3.train.pipeline import WarmSource, make_draft, split, warm_start
from eagle3.train.trainer import evaluate
from eagle3.train.ttt import TTTConfig, TTTModel


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("drafts", nargs="+", help="checkpoint.pt files or exported draft directories")
    ap.add_argument("--data", type=Path, default=Path("runs/data/conversations.jsonl"))
    ap.add_argument("--limit", type=int, default=None, help="use the first N conversations (the run's data)")
    ap.add_argument("--eval-fraction", type=float, default=0.03)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    target = load_model(resolve_model(None).hf_dir)
    samples = load_conversations(args.data, args.max_len)[:args.limit]
    _, eval_idx = split(len(samples), args.eval_fraction)
    results = []
    for path in map(Path, args.drafts):
        warm = WarmSource.load(path, target.config)
        cfg = TrainConfig(init_from=str(path), aux_layer_ids=warm.aux_layer_ids, autocast="bf16")
        model = TTTModel(make_draft(target, cfg, warm.vocab(target.config.vocab_size)),
                         target.lm_head.weight, TTTConfig())
        warm_start(model, warm)
        source = FeatureSource(samples, model.draft.config.aux_layer_ids, target=target)
        res = {"draft": str(path), "conversations": len(eval_idx), **evaluate(model, source, eval_idx, 4, cfg)}
        print(json.dumps(res), flush=True)
        results.append(res)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
