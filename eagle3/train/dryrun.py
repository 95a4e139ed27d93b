"""`eagle3 train --dry-run`: the whole pipeline on a tiny random target with synthetic conversations."""
from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from ..draft.formats import load_draft, save_draft
from .config import TrainConfig
from .features import Sample
from .pipeline import train
from .regen import generate_batch
from .tiny import tiny_target
from .trainer import Dist


def synthetic_samples(target, num: int, seed: int = 0) -> list[Sample]:
    """Random prompts answered greedily by the tiny target (its own distribution, like regen)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, target.config.vocab_size, (int(n),), generator=gen).tolist()
               for n in torch.randint(4, 12, (num,), generator=gen)]
    out = generate_batch(target, prompts, [0.0] * num, 24, [3], 0, gen)
    samples = []
    for p, r in zip(prompts, out.tokens):
        mask = torch.tensor([False] * len(p) + [True] * len(r))
        samples.append(Sample(torch.tensor(p + r), mask))
    return samples


def dry_run(cfg: TrainConfig, d: Dist) -> int:
    target = tiny_target()
    samples = synthetic_samples(target, 48)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) if cfg.out == TrainConfig.out else Path(cfg.out)
        # ranks have their own temporary dirs: under DDP the features are computed online
        features = "online" if d.world > 1 else cfg.features
        cfg = replace(cfg, out=str(out), features=features, draft_vocab_size=64, warmup_steps=2, epochs=1,
                      eval_every=4, checkpoint_every_s=0.0, batch_size=8, eval_fraction=0.1)
        draft = train(target, samples, cfg, d, out)
        if d.main:
            path = save_draft(draft, out / "draft", "specforge", target.config)
            loaded = load_draft(path, target.config)
            print(f"dry run ok: {len(samples)} conversations, draft saved and reloaded "
                  f"({type(loaded.draft).__name__}, Vd={loaded.draft.config.draft_vocab_size})")
            print((out / "train_log.jsonl").read_text().splitlines()[-1])
    return 0
