"""Build (or extend) the offline feature store for conversation files, e.g. beside a running regen.

    nohup python scripts/cache_features.py --data runs/data/conversations.jsonl --root runs/features &
One store part per file (<root>/<stem>-<path hash>, as `eagle3 train --set features_dir=<root>`
reads them). With --follow, only complete shards are written while the file grows; rerun without
--follow for the tail. Prints the part's size per million tokens and the build rate.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from eagle3.runtime.loader import load_model, resolve_model
from eagle3.train.features import load_conversations
from eagle3.train.pipeline import STORE_DTYPE
from eagle3.train.store import PartKey, build_part, part_name, target_fingerprint


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", type=Path, nargs="+", required=True)
    ap.add_argument("--root", type=Path, required=True, help="the store root (features_dir)")
    ap.add_argument("--target", default=None)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--shard-size", type=int, default=64)
    ap.add_argument("--follow", type=float, default=0.0, help="re-scan every N seconds (complete shards only)")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_model(resolve_model(args.target).hf_dir)
    key = PartKey(target_fingerprint(target), tuple(target.config.default_aux_layer_ids), STORE_DTYPE)
    while True:
        for path in args.data:
            samples = load_conversations(path, args.max_len)
            if args.follow:
                samples = samples[:len(samples) // args.shard_size * args.shard_size]
            if not samples:
                continue
            t0 = time.time()
            part = build_part(target, samples, key, args.root / part_name(path), args.shard_size,
                              progress=lambda **kw: tqdm(desc=path.stem, mininterval=10, **kw))
            m, dt = part.manifest, time.time() - t0
            print(json.dumps({"part": str(part.root), "samples": m["num_samples"], "tokens": m["tokens"],
                              "GB_per_M_tokens": round(m["bytes_per_token"] / 1000, 3), "seconds": round(dt, 1),
                              "tokens_per_s": round(m["tokens"] / max(dt, 1e-9), 1)}), flush=True)
        if not args.follow:
            return 0
        time.sleep(args.follow)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
