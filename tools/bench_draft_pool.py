"""The batch's draft (generate/chains.py DraftPool): B requests' draft chains drafted together
(one forward over every chain's catch-up rows, then one per token over the chains still going)
against the same chains drafted one request at a time, on the shipped draft.

    python tools/bench_draft_pool.py [--chains 1,2,4,8,16] [--tokens 3] [--catch-up 2] [--reps 20]

Each chain waits on `--catch-up` rows of features (what a request fed since its last chain) over
200 drafted tokens of context, then drafts `--tokens` tokens. Reported: ms a step of all B chains,
batched and one by one (median of --reps).
"""
from __future__ import annotations

import eagle3

eagle3.tune_process()   # first: the OpenMP wait policy before torch loads, the allocator

import argparse
import statistics
import time

import torch

from eagle3.api import load_engine
from eagle3.generate.chains import DraftPool

CONTEXT = 200


def step_ms(pool: DraftPool, chains, feats, seqs, tokens: int, batched: bool, reps: int) -> float:
    """Median ms of one step drafting every chain (each slot back at CONTEXT after)."""
    times = []
    for _ in range(reps + 2):
        for c, f in zip(chains, feats):
            pool.cache.truncate(c.slot, CONTEXT)
            c.waiting, c.head = [f], None
        asks = [(c, tokens, s) for c, s in zip(chains, seqs)]
        t0 = time.perf_counter()
        if batched:
            pool.guess(asks)
        else:
            for ask in asks:
                pool.guess([ask])
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times[2:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chains", default="1,2,4,8,16")
    ap.add_argument("--tokens", type=int, default=3, help="draft tokens a chain")
    ap.add_argument("--catch-up", type=int, default=2, help="waiting feature rows a chain")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    engine = load_engine(None, "default")
    draft = engine.draft
    counts = [int(c) for c in args.chains.split(",")]
    gen = torch.Generator().manual_seed(0)
    width = draft.reference.expected_feature_width
    pool = DraftPool(draft, CONTEXT + args.catch_up + args.tokens + 8, max(counts))
    chains, feats, seqs = [], [], []
    for _ in range(max(counts)):
        c = pool.open(0)
        ids = torch.randint(0, draft.config.vocab_size, (CONTEXT + args.catch_up + 1,), generator=gen)
        c.wait(torch.randn(CONTEXT, width, generator=gen))
        pool.guess([(c, 1, ids.tolist())])                    # the context, drafted once
        chains.append(c)
        feats.append(torch.randn(args.catch_up, width, generator=gen))
        seqs.append(ids.tolist())
    print(f"draft {draft.weights_name}, {args.tokens} tokens a chain, {args.catch_up} catch-up rows, "
          f"{torch.get_num_threads()} threads")
    print("chains | batched ms | one by one ms | ratio")
    for n in counts:
        b = step_ms(pool, chains[:n], feats[:n], seqs[:n], args.tokens, True, args.reps)
        o = step_ms(pool, chains[:n], feats[:n], seqs[:n], args.tokens, False, args.reps)
        print(f"{n:6d} | {b:10.2f} | {o:13.2f} | {o / b:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
