"""Build/extend the feature cache for the conversations generated so far (run beside regen).

    nohup python scripts/cache_features.py --data runs/data/conversations.jsonl --out runs/smollm2/features &
Only complete shards are written while --follow is on; rerun without --follow for the tail.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from eagle3.runtime.loader import load_model, resolve_model
from eagle3.train.features import build_cache, load_conversations


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--shard-size", type=int, default=64)
    ap.add_argument("--follow", type=float, default=0.0, help="re-scan every N seconds (complete shards only)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    target = load_model(resolve_model(None).hf_dir)
    aux_ids = target.config.default_aux_layer_ids
    while True:
        samples = load_conversations(args.data, args.max_len)
        if args.follow:
            samples = samples[:len(samples) // args.shard_size * args.shard_size]
        t0 = time.time()
        if samples:
            build_cache(target, samples, aux_ids, args.out, shard_size=args.shard_size)
        print(f"{time.strftime('%H:%M:%S')} cached {len(samples)} samples "
              f"({sum(len(s.ids) for s in samples)} tokens) in {time.time() - t0:.0f} s", flush=True)
        if not args.follow:
            return 0
        time.sleep(args.follow)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
