"""The default step against plain decoding on chat prompts with little to copy, runs alternated.

    python tools/bench_chat_alternated.py [--model M] [--draft default|none|DIR] [--tokens 160]
                                          [--reps 3] [--temperature 0]

Each prompt runs `--reps` times on each system, the order alternating from run to run, greedy by
default with `ignore_eos` (every run the same length). Prints each run's tokens/s ratio (default /
plain), their median, and the adaptive step's time by kind (policy.summary()["spent_ms"]). The
prompts ask for arguments, stories and explanations: text the answer does not quote, so a target
without a draft finds few suffix matches and the default step must not cost speed there. Run it
on a quiet machine.
"""
from __future__ import annotations

import eagle3

eagle3.tune_process()   # first: sets the OpenMP wait policy before torch loads

import argparse
import statistics
import time

from eagle3.api import load_engine
from eagle3.generate import Engine, SamplingParams

PROMPTS = ("Give three arguments for and three against working from home.",
           "Write a short story about a lighthouse keeper who finds a message in a bottle.",
           "Explain why the sky is blue to a ten-year-old.",
           "What are the pros and cons of electric cars?")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft", default="default")
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.0)
    args = ap.parse_args()
    engine = load_engine(args.model, args.draft)
    plain = Engine(engine.target, engine.tokenizer, max_model_len=engine.max_model_len)
    ids = [engine.encode(p) for p in PROMPTS]
    rates: dict[str, list[float]] = {"plain": [], "default": []}
    for rep in range(args.reps):
        for i, prompt_ids in enumerate(ids):
            params = SamplingParams(temperature=args.temperature, seed=i, max_new_tokens=args.tokens,
                                    ignore_eos=True)
            order = [("plain", plain, False), ("default", engine, True)]
            for name, e, speculative in order[::1 if (i + rep) % 2 else -1]:
                t0 = time.perf_counter()
                res = e.generate(prompt_ids=prompt_ids, params=params, speculative=speculative)
                rates[name].append(len(res.token_ids) / (time.perf_counter() - t0))
    ratios = [d / p for d, p in zip(rates["default"], rates["plain"])]
    print(f"model {args.model or 'default'}, draft {args.draft}, {len(PROMPTS)} prompts x {args.reps} "
          f"runs, {args.tokens} tokens, T={args.temperature:g}")
    print(f"plain tok/s median {statistics.median(rates['plain']):.1f}, default "
          f"{statistics.median(rates['default']):.1f}")
    print("default / plain per run: " + " ".join(f"{r:.3f}" for r in ratios))
    print(f"median {statistics.median(ratios):.3f}, min {min(ratios):.3f}")
    policy = engine.policy_for(SamplingParams(temperature=args.temperature))
    if policy is not None:
        summary = policy.summary()
        print("policy steps", summary["chosen"], "time ms", summary["spent_ms"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
