"""The pipeline on a real target: regenerate data if missing, train, export the draft (SpecForge layout)."""
from __future__ import annotations

import json
import time

import torch
from tqdm import tqdm

from ..runtime.assets import mtbench_questions, sharegpt_json
from ..runtime.loader import load_model, load_tokenizer, resolve_model
from ..draft.formats import save_draft
from .config import TrainConfig
from .data import PromptFilter, select_prompts
from .features import load_conversation_files
from .pipeline import train
from .regen import RegenConfig, RegenJob, run_regen
from .trainer import Dist, load_checkpoint


def ensure_data(cfg: TrainConfig, target, tokenizer, source_name: str) -> None:
    if cfg.data:                                  # given explicitly: use as is
        return
    path = cfg.data_paths[0]
    path.parent.mkdir(parents=True, exist_ok=True)
    prompts, stats = select_prompts(sharegpt_json(), mtbench_questions(), PromptFilter(), cfg.num_prompts)
    rcfg = RegenConfig(max_new_tokens=cfg.regen_max_new_tokens, batch_size=cfg.regen_batch_size,
                       temperatures=cfg.regen_temperatures, seed=cfg.seed)
    job = RegenJob(prompts, path, path.parent / "manifest.json",
                   {"prompts": "ShareGPT V3 first human turns", "target": source_name, "selection": dict(stats)})
    run_regen(target, tokenizer, job, rcfg, progress=lambda **kw: tqdm(desc="data", mininterval=10, **kw))


def load_samples(cfg: TrainConfig) -> list:
    samples = load_conversation_files(cfg.data_paths, cfg.max_len)
    ckpt = cfg.out_dir / "checkpoint.pt"
    if ckpt.is_file():                            # resume on the same data even if the file grew
        samples = samples[:load_checkpoint(ckpt)["num_samples"]]
    return samples


def run_pipeline(cfg: TrainConfig, d: Dist) -> int:
    src = resolve_model(cfg.target)
    target = load_model(src.hf_dir)
    tokenizer = load_tokenizer(src.hf_dir)
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    if d.main:
        (cfg.out_dir / "train_config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
        ensure_data(cfg, target, tokenizer, src.name)
    if d.world > 1:
        torch.distributed.barrier()
    t0 = time.time()
    draft = train(target, load_samples(cfg), cfg, d,
                  progress=lambda **kw: tqdm(desc="train", mininterval=5, **kw))
    if d.main:
        out = save_draft(draft, cfg.out_dir / "draft", "specforge", target.config)
        print(f"trained in {time.time() - t0:.0f} s; draft written to {out}")
    return 0
