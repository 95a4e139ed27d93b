"""`eagle3 train` / `python -m eagle3.train` / torchrun: arguments, distributed init, and the choice
between the real pipeline (train.real) and the dry run (train.dryrun); both call pipeline.train."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import RunConfig, use
from .config import TrainConfig, parse_override
from .trainer import Dist
from . import pipeline


def parse_args(argv: list[str]) -> tuple[TrainConfig, argparse.Namespace]:
    ap = argparse.ArgumentParser(prog="eagle3 train", description=pipeline.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, help="TOML or JSON file with TrainConfig fields")
    ap.add_argument("--model", "--target", dest="target", help="target model (.gguf, HF dir, or 'smollm2')")
    ap.add_argument("--out", help="run directory (data, features, checkpoint, log, exported draft)")
    ap.add_argument("--data", help="conversations.jsonl from the data step (default <out>/data/...)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override one config field, e.g. --set lr=1e-4 --set epochs=3 --set "
                         "autocast=bf16 (JSON for numbers, booleans, lists and null)")
    ap.add_argument("--dry-run", action="store_true", help="tiny random model, synthetic data, a few steps")
    args = ap.parse_args(argv)
    d = TrainConfig.from_file(args.config).to_dict() if args.config else {}
    for key in ("target", "out", "data"):
        if getattr(args, key):
            d[key] = getattr(args, key)
    for item in args.set:
        key, value = parse_override(item)
        d[key] = value
    return TrainConfig.from_dict(d), args


def init_dist() -> Dist:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Dist()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    return Dist(dist.get_rank(), world)


def train_main(argv: list[str]) -> int:
    """CLI entry: `eagle3 train ...` (also `python -m eagle3.train` / torchrun)."""
    cfg, args = parse_args(argv)
    use(RunConfig(threads=cfg.threads))     # torch's threads (None: its default), the backend switches
    d = init_dist()
    if args.dry_run:
        from .dryrun import dry_run
        return dry_run(cfg, d)
    from .real import run_pipeline
    return run_pipeline(cfg, d)
