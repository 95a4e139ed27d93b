"""The pipeline on a real target: regenerate data if missing, train, export the draft (SpecForge
layout; speculators for a draft with the Eagle 3.1 norms)."""
from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from ..runtime.assets import mtbench_questions, sharegpt_json
from ..runtime.loader import load_model, load_tokenizer, resolve_model
from ..draft.formats import export_format, save_draft
from ..errors import ContractError, UnsupportedError
from .config import TrainConfig
from .data import PromptFilter, select_prompts
from .features import load_conversations
from .pipeline import DataPart, External, train
from .speculators_data import aux_ids_for, check_not_empty, read_speculators_data, speculators_features
from .store import part_name
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


def load_data(cfg: TrainConfig) -> tuple[list, list[DataPart]]:
    """The run's samples (data files in order, then eval_data) and where each part comes from. A
    resumed run keeps the counts its checkpoint started with, even if a file has grown since."""
    files = [(p, False) for p in cfg.data_paths] + ([(Path(cfg.eval_data), True)] if cfg.eval_data else [])
    ckpt = cfg.out_dir / "checkpoint.pt"
    counts = None
    if ckpt.is_file():
        ck = load_checkpoint(ckpt)
        total = ck["num_samples"]
        if ck.get("parts"):
            started = [[name, held_out] for name, _, held_out in ck["parts"]]
            now = [[part_name(path), held_out] for path, held_out in files]
            if started != now:
                raise ContractError("data / eval_data", f"{started} in {ckpt}", now,
                                    "resume with the data files the run started with, in that order, "
                                    "or start the run in a new out directory")
            counts = [n for _, n, _ in ck["parts"]]
    samples, parts = [], []
    for k, (path, held_out) in enumerate(files):
        part = load_conversations(path, cfg.max_len)
        if counts is not None:
            part = part[:counts[k]]
        samples += part
        parts.append(DataPart(part_name(path), len(part), held_out))
    if ckpt.is_file() and counts is None:         # a checkpoint from before parts were recorded
        samples = samples[:total]
        parts = [DataPart("samples", total)]
    return samples, parts


def speculators_run(cfg: TrainConfig, target) -> tuple[TrainConfig, list, list[DataPart], External]:
    """A run on a speculators data directory: its conversations (one part), vocabulary, layers and
    hidden states (the feature store is filled from them, the teacher made here)."""
    data = read_speculators_data(cfg.speculators_data, target.config.num_layers, target.config.vocab_size,
                                 cfg.draft_vocab_size, cfg.max_len, cfg.speculators_layer_ids)
    check_not_empty(data)
    cfg = replace(cfg, aux_layer_ids=aux_ids_for(cfg.aux_layer_ids, data))
    name = part_name(data.root)
    source = f"speculators {data.layout} data {data.root}"
    return cfg, data.samples, [DataPart(name, len(data.samples))], External(
        data.vocab, {name: (speculators_features(target, data), source)})


def run_pipeline(cfg: TrainConfig, d: Dist) -> int:
    src = resolve_model(cfg.target)
    target = load_model(src.hf_dir)
    tokenizer = load_tokenizer(src.hf_dir)
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    if d.main:
        (cfg.out_dir / "train_config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
        if not cfg.speculators_data:
            ensure_data(cfg, target, tokenizer, src.name)
    if d.world > 1:
        torch.distributed.barrier()
    t0 = time.time()
    external = External()
    if cfg.speculators_data:
        cfg, samples, parts, external = speculators_run(cfg, target)
    else:
        samples, parts = load_data(cfg)
    draft = train(target, samples, cfg, d, progress=lambda **kw: tqdm(desc="train", mininterval=5, **kw),
                  parts=parts, external=external)
    if d.main:
        try:
            out = save_draft(draft, cfg.out_dir / "draft", export_format(draft.config), target.config)
        except UnsupportedError as e:              # a study variant no export layout writes
            print(f"trained in {time.time() - t0:.0f} s; checkpoint {cfg.out_dir / 'checkpoint.pt'} "
                  f"kept, no export: {e}")
            return 0
        print(f"trained in {time.time() - t0:.0f} s; draft written to {out}")
    return 0
