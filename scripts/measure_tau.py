"""Mean acceptance length tau of a draft on MT-bench first turns (default tree), per temperature.

    python scripts/measure_tau.py --draft eagle3/drafts/smollm2-135m-eagle3 --n 80 --temperatures 0,1
tau = emitted tokens / target decode forwards (accepted draft tokens + 1), pooled over prompts.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from eagle3.api import load_engine
from eagle3.config import RunConfig
from eagle3.bench.tune import parse_shape
from eagle3.generate import SamplingParams
from eagle3.runtime.assets import mtbench_questions


def first_turns(n: int) -> list[str]:
    lines = [json.loads(l) for l in mtbench_questions().read_text().splitlines() if l.strip()]
    return [q["turns"][0] for q in lines][:n]


def measure(engine, prompts: list[str], temperature: float, max_new: int, depth: int) -> dict:
    tokens = steps = 0
    reached = [0] * depth
    t0 = time.time()
    for i, p in enumerate(prompts):
        res = engine.generate(p, SamplingParams(temperature=temperature, max_new_tokens=max_new, seed=i))
        for s in res.decode_steps:
            tokens, steps = tokens + len(s.tokens), steps + 1
            for k in range(min(s.accepted, depth)):
                reached[k] += 1
    return {"temperature": temperature, "prompts": len(prompts), "tau": round(tokens / max(steps, 1), 3),
            "accept_per_position": [round(r / max(steps, 1), 3) for r in reached],
            "decode_steps": steps, "tokens": tokens, "wall_s": round(time.time() - t0, 1)}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--draft", required=True, help="a draft directory, or a run's checkpoint.pt")
    ap.add_argument("--n", type=int, default=80)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tree", default=None, help="TOP_K,DEPTH,NUM_DRAFT_TOKENS[,MIN_PROB] "
                    "(default: the engine's default tree)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    spec = parse_shape(args.tree) if args.tree else None
    if args.draft.endswith(".pt"):        # a run's checkpoint (a study variant no export writes)
        from eagle3.api import load_target
        from eagle3.layouts import build_layouts
        from eagle3.generate import Engine
        from eagle3.runtime.loader import resolve_model
        from eagle3.train.pipeline import draft_from_checkpoint
        target, tokenizer = load_target(None, torch.device("cpu"), torch.float32)
        drafter = draft_from_checkpoint(Path(args.draft), target)
        target, drafter = build_layouts(target, drafter, "auto", "auto", resolve_model(None))
        engine = Engine(target, tokenizer, draft=drafter, spec=spec, max_model_len=2048)
    else:
        engine = load_engine(None, args.draft, spec, config=RunConfig(device="cpu"))
    depth = engine.spec.depth if getattr(engine, "spec", None) else 8
    res = [measure(engine, first_turns(args.n), float(t), args.max_new_tokens, depth)
           for t in args.temperatures.split(",")]
    text = json.dumps({"draft": args.draft, "spec": str(getattr(engine, "spec", None)),
                       "max_new_tokens": args.max_new_tokens, "command": " ".join(["scripts/measure_tau.py"] + argv),
                       "results": res}, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
