"""Plain decoding tok/s on a quiet machine and with one busy process, in the same run.

    python tools/bench_contention.py [--model M] [--weights auto|gguf|gguf-exact|bf16|fp32] [--tokens 128]
                                       [--threads 2] [--reps 3]

The busy process is a pure-Python spin loop in a subprocess (one core's worth of load). With N
threads on N cores, losing one core should cost about that core's share, not collapse: the bar
is busy >= 0.5x quiet (exit status 1 below it). OMP_WAIT_POLICY as eagle3 sets it (PASSIVE unless
you set it); run in a quiet window, nothing else on the cores.
"""
from __future__ import annotations

import eagle3

eagle3.tune_process()   # first: sets the OpenMP wait policy before torch loads

import argparse
import statistics
import subprocess
import sys
import time
from typing import Optional

import torch

from eagle3.api import load_engine
from eagle3.config import WEIGHT_CHOICES, RunConfig
from eagle3.generate import SamplingParams
from eagle3.threads import describe

PROMPT = "Explain how a refrigerator works, step by step, for a curious ten-year-old."
BAR = 0.5


def tokens_per_s(engine, tokens: int, reps: int) -> float:
    params = SamplingParams(temperature=0.0, max_new_tokens=tokens, ignore_eos=True)
    engine.generate(PROMPT, params)                                     # warm-up
    return statistics.median(engine.generate(PROMPT, params).tokens_per_s for _ in range(reps))


def busy_process() -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    time.sleep(0.5)                                                     # let it take its core
    return proc


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="target (default: the packaged SmolLM2)")
    ap.add_argument("--weights", choices=WEIGHT_CHOICES, default="auto")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = load_engine(args.model, draft="none", config=RunConfig(device="cpu", weights=args.weights))
    print(f"threads: {describe()}")
    quiet = tokens_per_s(engine, args.tokens, args.reps)
    proc = busy_process()
    try:
        busy = tokens_per_s(engine, args.tokens, args.reps)
    finally:
        proc.kill()
        proc.wait()
    ratio = busy / quiet
    print(f"plain decoding, {args.weights} weights, {args.tokens} tokens, median of {args.reps}")
    print(f"quiet          {quiet:8.1f} tok/s")
    print(f"one busy core  {busy:8.1f} tok/s")
    print(f"ratio          {ratio:8.2f}x  (bar >= {BAR}x: {'pass' if ratio >= BAR else 'FAIL'})")
    return 0 if ratio >= BAR else 1


if __name__ == "__main__":
    sys.exit(main())
