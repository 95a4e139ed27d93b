"""The training loop: deterministic data order, AdamW + warmup/cosine, clip, DDP, atomic checkpoints.

Data order is a pure function of (seed, epoch): a seeded permutation, sorted by length inside
chunks of 32 batches (less padding), cut into global batches, batch order shuffled. A checkpoint
stores the weights, optimizer and schedule state, RNG state and the cursor (epoch, batch), so a run
resumed from any checkpoint ends bit-identical to an uninterrupted one.

DDP: every rank sees the same global batch list; rank r trains on members r::world, padded to the
global batch's widest sample, and the loss is divided by the global B*T (times world, because DDP
averages gradients), so N ranks compute the same update as one process with the same global batch.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

from .config import TrainConfig
from .features import FeatureSource, collate
from .ttt import StepStats, TTTModel

CHUNK_BATCHES = 32


class Cursor(NamedTuple):
    epoch: int
    batch: int          # next batch index inside the epoch


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0


# ---------------------------------------------------------------------------- data order
def epoch_batches(lengths: Sequence[int], indices: Sequence[int], batch_size: int, seed: int,
                  epoch: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed * 100_003 + epoch)
    perm = [indices[i] for i in torch.randperm(len(indices), generator=gen).tolist()]
    batches = []
    step = batch_size * CHUNK_BATCHES
    for c in range(0, len(perm), step):
        chunk = sorted(perm[c:c + step], key=lambda i: lengths[i])
        batches += [chunk[b:b + batch_size] for b in range(0, len(chunk), batch_size)]
    order = torch.randperm(len(batches), generator=gen).tolist()
    return [batches[i] for i in order]


SCHEDULES = {"cosine": lambda t: 0.5 * (1 + math.cos(math.pi * t)), "linear": lambda t: 1 - t,
             "constant": lambda t: 1.0}


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    """Linear warmup to cfg.lr, then the schedule (cosine, linear or constant) down to
    cfg.lr * min_lr_ratio at `total`."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    t = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * SCHEDULES[cfg.schedule](t))


# ---------------------------------------------------------------------------- checkpoints
def trainable_state(model: TTTModel) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.draft.state_dict().items() if k != "embed_tokens.weight"}


def save_checkpoint(path: Path, state: dict) -> None:
    """torch.save to a temporary file, then os.replace: a reader never sees a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


class TrainState(NamedTuple):
    step: int
    cursor: Cursor


def restore(path: Path, model: TTTModel, opt: torch.optim.Optimizer) -> TrainState:
    ck = load_checkpoint(path)
    model.draft.load_state_dict({**ck["draft"], "embed_tokens.weight": model.draft.embed_tokens.weight})
    opt.load_state_dict(ck["optimizer"])
    torch.set_rng_state(ck["rng"])
    return TrainState(ck["step"], Cursor(*ck["cursor"]))


# ---------------------------------------------------------------------------- one step
class Optimizers:
    """Muon on some parameters and AdamW on the rest, stepped and checkpointed as one optimizer
    (param_groups concatenated, so the schedule sets every group's lr)."""

    def __init__(self, parts: Sequence[torch.optim.Optimizer]):
        self.parts = list(parts)

    @property
    def param_groups(self) -> list[dict]:
        # read through every time: load_state_dict replaces a part's group dicts
        return [g for o in self.parts for g in o.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.parts:
            o.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        for o in self.parts:
            o.step()

    def state_dict(self) -> dict:
        return {"parts": [o.state_dict() for o in self.parts]}

    def load_state_dict(self, state: dict) -> None:
        for o, st in zip(self.parts, state["parts"]):
            o.load_state_dict(st)


def make_optimizer(model: TTTModel, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW on every trainable weight, or (optimizer = "muon") Muon on fc's and the midlayer's 2-D
    weights with AdamW on the rest (norms, lm_head): Muon's update is scaled to AdamW's RMS
    (adjust_lr_fn "match_rms_adamw"), so one lr and schedule serve both."""
    params = [(n, p) for n, p in model.draft.named_parameters() if p.requires_grad]
    adamw = dict(lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW([p for _, p in params], **adamw)
    muon = [p for n, p in params if p.ndim == 2 and (n.startswith("midlayer.") or n == "fc.weight")]
    rest = [p for n, p in params if not any(p is m for m in muon)]
    return Optimizers([torch.optim.Muon(muon, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                        adjust_lr_fn="match_rms_adamw"),
                       torch.optim.AdamW(rest, **adamw)])


def unwrap(model: torch.nn.Module) -> TTTModel:
    """The TTTModel inside torch.compile and/or DDP wrappers."""
    model = getattr(model, "_orig_mod", model)
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def rank_part(global_batch: list[int], d: Dist) -> list[int]:
    return global_batch[d.rank::d.world]


def train_step(model, opt, source: FeatureSource, global_batch: list[int], width: int, lr: float,
               cfg: TrainConfig, d: Dist) -> StepStats:
    """Forward + backward + clip + AdamW on this rank's share of one global batch."""
    part = rank_part(global_batch, d)
    denom = float(len(global_batch) * width)
    with autocast(cfg):
        stats = model(source.batch(part, width), denom)
    opt.zero_grad(set_to_none=True)
    (stats.loss * d.world).backward()            # DDP averages gradients over ranks
    inner = unwrap(model)
    torch.nn.utils.clip_grad_norm_([p for p in inner.draft.parameters() if p.requires_grad], cfg.grad_clip)
    for g in opt.param_groups:
        g["lr"] = lr
    scale = inner.fc_update_scale
    before = inner.draft.fc.weight.detach().clone() if scale is not None else None
    opt.step()
    if scale is not None:                        # fc_precondition: see pipeline.fc_column_scale
        with torch.no_grad():
            w = inner.draft.fc.weight
            w.copy_(before + (w - before) * scale.to(w.dtype))
    return reduce_stats(stats, d)


def autocast(cfg: TrainConfig):
    if cfg.autocast not in ("none", "bf16"):
        raise ValueError(f"autocast={cfg.autocast!r}: choose 'none' or 'bf16'")
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.autocast == "bf16")


def reduce_stats(stats: StepStats, d: Dist) -> StepStats:
    if d.world == 1:
        return StepStats(stats.loss.detach(), stats.step_loss, stats.correct, stats.counted)
    packed = torch.cat([stats.loss.detach()[None], stats.step_loss, stats.correct.float(),
                        stats.counted.float()])
    dist.all_reduce(packed)
    n = stats.step_loss.numel()
    return StepStats(packed[0], packed[1:1 + n], packed[1 + n:1 + 2 * n], packed[1 + 2 * n:])


# ---------------------------------------------------------------------------- evaluation
@torch.no_grad()
def evaluate(model: TTTModel, source: FeatureSource, indices: Sequence[int], batch_size: int,
             cfg: Optional[TrainConfig] = None) -> dict:
    """Per-step accuracy on held-out conversations and the chain acceptance estimate."""
    correct = counted = 0
    was_training = model.training
    model.eval()                                      # no feature noise
    for b in range(0, len(indices), batch_size):
        part = list(indices[b:b + batch_size])
        with autocast(cfg or TrainConfig()):
            stats = model(source.batch(part))
        correct, counted = correct + stats.correct.double(), counted + stats.counted.double()
    model.train(was_training)
    acc = (correct / counted.clamp_min(1)).tolist() if len(indices) else []
    chain = [math.prod(acc[:k + 1]) for k in range(len(acc))]
    return {"acc": [round(a, 4) for a in acc], "chain_accept": [round(c, 4) for c in chain],
            "est_tau": round(1 + sum(chain), 3)}


# ---------------------------------------------------------------------------- loop
class Run(NamedTuple):
    model: torch.nn.Module          # TTTModel or DDP(TTTModel)
    opt: torch.optim.Optimizer
    source: FeatureSource
    lengths: list[int]
    train_idx: list[int]
    eval_idx: list[int]
    ckpt: Path
    log: Path
    parts: list = []                # [name, count, held_out] per data file (checkpointed)


def total_steps(run: Run, cfg: TrainConfig) -> int:
    """Steps of the whole schedule: all epochs, or (max_tokens) the steps whose batches reach the
    token budget, over as many epochs as that takes."""
    if cfg.max_tokens is None:
        per_epoch = len(epoch_batches(run.lengths, run.train_idx, cfg.batch_size, cfg.seed, 0))
        return per_epoch * cfg.epochs
    seen, steps, epoch = 0, 0, 0
    while seen < cfg.max_tokens:
        for gb in epoch_batches(run.lengths, run.train_idx, cfg.batch_size, cfg.seed, epoch):
            seen, steps = seen + sum(run.lengths[i] for i in gb), steps + 1
            if seen >= cfg.max_tokens:
                break
        epoch += 1
    return steps


def train_loop(run: Run, cfg: TrainConfig, state: TrainState, d: Dist,
               progress: Optional[Callable] = None,
               between_steps: Optional[Callable[[], None]] = None) -> TrainState:
    """Train from `state` to the end (or cfg.max_steps); checkpoints and logs on rank 0.
    between_steps: called before every step (a learner waits there while the server is busy)."""
    inner = unwrap(run.model)
    total = total_steps(run, cfg)
    stop = min(total, cfg.max_steps or total)
    bar = progress(total=stop, initial=state.step) if progress and d.main else None
    last_save, step, cursor = time.time(), state.step, state.cursor
    while step < stop:
        if between_steps is not None:
            between_steps()
        batches = epoch_batches(run.lengths, run.train_idx, cfg.batch_size, cfg.seed, cursor.epoch)
        if cursor.batch >= len(batches):
            cursor = Cursor(cursor.epoch + 1, 0)
            continue
        gb = batches[cursor.batch]
        t0 = time.time()
        stats = train_step(run.model, run.opt, run.source, gb, max(run.lengths[i] for i in gb),
                           lr_at(step, total, cfg), cfg, d)
        step, cursor = step + 1, Cursor(cursor.epoch, cursor.batch + 1)
        if d.main:
            rec = step_record(step, cursor, stats, lr_at(step - 1, total, cfg), time.time() - t0, gb, run)
            append_jsonl(run.log, rec)
            if bar:
                bar.update(1)
                bar.set_postfix(loss=f"{rec['loss']:.3f}", acc=",".join(f"{a:.2f}" for a in rec["acc"][:3]))
        if d.main and cfg.eval_every and (step % cfg.eval_every == 0 or step == stop) and run.eval_idx:
            append_jsonl(run.log, {"step": step, "eval": evaluate(inner, run.source, run.eval_idx, cfg.batch_size, cfg)})
        if d.main and (time.time() - last_save >= cfg.checkpoint_every_s or step == stop):
            save_checkpoint(run.ckpt, checkpoint_dict(inner, run.opt, step, cursor, cfg, run))
            last_save = time.time()
    if bar:
        bar.close()
    return TrainState(step, cursor)


def checkpoint_dict(model: TTTModel, opt, step: int, cursor: Cursor, cfg: TrainConfig, run: Run) -> dict:
    return {"draft": trainable_state(model), "optimizer": opt.state_dict(), "step": step,
            "cursor": list(cursor), "rng": torch.get_rng_state(), "config": json.dumps(cfg.to_dict()),
            "num_samples": len(run.lengths), "parts": run.parts}


def step_record(step, cursor, stats: StepStats, lr, dt, gb, run: Run) -> dict:
    acc = (stats.correct.double() / stats.counted.double().clamp_min(1)).tolist()
    return {"step": step, "epoch": cursor.epoch, "loss": round(float(stats.loss), 5),
            "step_loss": [round(float(x), 5) for x in stats.step_loss], "acc": [round(a, 4) for a in acc],
            "lr": lr, "seqs": len(gb), "tokens": int(sum(run.lengths[i] for i in gb)), "step_s": round(dt, 3),
            "time": round(time.time(), 1)}


def append_jsonl(path: Path, rec: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(rec) + "\n")
