"""`eagle3 train`: data -> draft vocabulary -> features -> training-time test -> exported draft.

    eagle3 train --target smollm2 --out runs/smollm2 [--config train.toml] [--dry-run]
    torchrun --nproc-per-node 2 -m eagle3.train --out runs/x     (DDP: gloo on CPU, NCCL on GPU)

Every stage is resumable: regenerated data is appended and skips done ids, feature shards are kept,
and training resumes from <out>/checkpoint.pt (same seed, same data order, same result).
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist
from tqdm import tqdm

from ..errors import ContractError, InputError
from ..models.config import ModelConfig
from ..models.llama import LlamaModel
from ..draft.model import DraftConfig, Eagle3Draft
from .config import TrainConfig
from .features import Batch, FeatureCache, FeatureSource, Sample, build_cache, load_conversations
from .trainer import Cursor, Dist, Run, TrainState, load_checkpoint, make_optimizer, restore, train_loop
from .ttt import TTTConfig, TTTModel
from .vocab import DraftVocab, build_vocab, count_tokens, coverage

COVERAGE_SIZES = (1024, 2048, 4096, 8192, 16384, 32768)


class Prepared(NamedTuple):
    samples: list[Sample]
    train_idx: list[int]
    eval_idx: list[int]
    vocab: DraftVocab


# ---------------------------------------------------------------------------- stages
def split(num: int, eval_fraction: float) -> tuple[list[int], list[int]]:
    """Every k-th conversation is held out (k = 1 / eval_fraction); deterministic."""
    if eval_fraction <= 0 or num < 4:
        return list(range(num)), []
    every = max(2, round(1 / eval_fraction))
    return [i for i in range(num) if i % every != every - 1], [i for i in range(num) if i % every == every - 1]


def prepare(samples: list[Sample], cfg: TrainConfig, vocab_size: int, out: Optional[Path],
            warm: Optional["WarmSource"] = None) -> Prepared:
    train_idx, eval_idx = split(len(samples), cfg.eval_fraction)
    counts = count_tokens((samples[i].ids[samples[i].loss_mask] for i in train_idx), vocab_size)
    if warm is not None:
        # a warm start keeps the source's draft vocabulary, so more data can be added to a run
        vocab = warm.vocab(vocab_size)
    else:
        vocab = build_vocab(counts, min(cfg.draft_vocab_size, vocab_size))
    if out is not None:
        sizes = [v for v in COVERAGE_SIZES if v < vocab_size] + [vocab_size]
        (out / "vocab.json").write_text(json.dumps({
            "draft_vocab_size": len(vocab.used), "assistant_tokens": int(counts.sum()),
            "distinct_tokens": int((counts > 0).sum()), "coverage": coverage(counts, sizes)}, indent=2))
    return Prepared(samples, train_idx, eval_idx, vocab)


class WarmSource(NamedTuple):
    """A warm-start source (`init_from`), read once: its draft tensors and the capture ids its fc
    was trained on."""
    path: Path
    state: dict[str, torch.Tensor]
    aux_layer_ids: tuple[int, ...]

    @classmethod
    def load(cls, path: Path, target: ModelConfig) -> "WarmSource":
        """A run's checkpoint.pt or an exported draft directory (e.g. the shipped one)."""
        if path.is_dir():
            from ..draft.formats import load_draft
            draft = load_draft(path, dtype=torch.float32).draft
            state = {k: v for k, v in draft.state_dict().items() if k != "embed_tokens.weight"}
            return cls(path, state, tuple(draft.config.aux_layer_ids))
        ckpt = load_checkpoint(path)
        ids = json.loads(ckpt["config"]).get("aux_layer_ids") or target.default_aux_layer_ids
        return cls(path, ckpt["draft"], tuple(ids))

    def vocab(self, vocab_size: int) -> DraftVocab:
        d2t, t2d = self.state["d2t"].long(), self.state["t2d"].bool()
        if t2d.numel() != vocab_size:
            raise ContractError("t2d", f"{t2d.numel()} entries in {self.path}", f"the target vocab {vocab_size}",
                                "warm-start only from a draft trained for this target")
        return DraftVocab(d2t + torch.arange(d2t.numel()), d2t, t2d)


def make_draft(target: LlamaModel, cfg: TrainConfig, vocab: DraftVocab) -> Eagle3Draft:
    """Draft shaped like the target; embedding shared and frozen; lm_head starts as the target's rows."""
    dcfg = DraftConfig.for_target(target.config, len(vocab.used), cfg.aux_layer_ids)
    torch.manual_seed(cfg.seed)
    draft = Eagle3Draft(dcfg)
    draft.set_embedding(target.embed_tokens.weight.detach())
    with torch.no_grad():
        draft.d2t.copy_(vocab.d2t)
        draft.t2d.copy_(vocab.t2d)
        draft.lm_head.weight.copy_(target.lm_head.weight[vocab.used])
        draft.norm.weight.copy_(target.norm.weight)
    return draft


@torch.no_grad()
def rescale_fc(draft: Eagle3Draft, batch: Batch, rms: float) -> float:
    """Scale the initial fc so fc(aux) has median per-token RMS `rms` on this batch; returns the factor.

    Targets carry massive activations (SmolLM2: aux norms ~100-600, 25k on the first token), so a
    default-initialised fc makes fc(aux) dwarf the attention and MLP outputs that carry the token
    embedding, and the draft learns slowly. The factor is computed on the first samples (deterministic).
    """
    aux = batch.aux
    valid = aux.abs().sum(-1) > 0
    out = draft.fc(aux[valid])
    factor = rms / float(out.pow(2).mean(-1).sqrt().median())
    draft.fc.weight.mul_(factor)
    return factor


@torch.no_grad()
def fc_column_scale(batch: Batch) -> torch.Tensor:
    """Per-input-column factors for fc's AdamW updates: median(r) / r, r = RMS of each aux dim.

    The target's residual streams carry a few massive, nearly constant dims (SmolLM2: RMS ~390 in
    one dim of the layer-27 input vs a median of 12). AdamW moves every weight by about lr whatever
    its input scale, so fc's columns on those dims swing fc(aux) hardest while the informative
    dims learn slowly. Multiplying each column's update by median(r) / r is AdamW on fc in
    coordinates where every input dim has the same RMS (exactly, as AdamW ignores gradient scale
    per element up to eps); fc and the exported checkpoint keep their usual meaning. Each sample's
    first token (its attention sink, RMS ~1000) is left out of r. Deterministic in the batch.
    """
    rows = batch.valid.clone()
    rows[:, 0] = False
    aux = batch.aux[rows]
    r = aux.pow(2).mean(0).sqrt().clamp_min(1e-6)
    return (r.median() / r).float()


def feature_source(target: LlamaModel, prep: Prepared, aux_ids: Sequence[int], cfg: TrainConfig,
                   d: Dist) -> FeatureSource:
    if cfg.features == "online":
        return FeatureSource(prep.samples, aux_ids, target=target)
    if cfg.features != "cache":
        raise InputError(f"features={cfg.features!r}: choose 'cache' or 'online'")
    root = cfg.out_dir / "features"
    if d.main and not FeatureCache.complete(root, aux_ids, len(prep.samples)):
        build_cache(target, prep.samples, aux_ids, root,
                    progress=lambda **kw: tqdm(desc="features", mininterval=10, **kw))
    if d.world > 1:
        dist.barrier()
    return FeatureSource(prep.samples, aux_ids, cache=FeatureCache(root))


def build_run(target: LlamaModel, samples: list[Sample], cfg: TrainConfig, d: Dist,
              out: Optional[Path], warm: Optional[WarmSource] = None) -> tuple[Run, TTTModel]:
    prep = prepare(samples, cfg, target.config.vocab_size, out if d.main else None, warm)
    draft = make_draft(target, cfg, prep.vocab)
    model = TTTModel(draft, target.lm_head.weight, TTTConfig(cfg.ttt_steps, cfg.step_decay))
    source = feature_source(target, prep, draft.config.aux_layer_ids, cfg, d)
    # fc statistics on the first training batch (deterministic, so a resumed run gets the same)
    first = source.batch(prep.train_idx[:cfg.batch_size]) if cfg.fc_init_rms or cfg.fc_precondition else None
    if cfg.fc_init_rms:
        rescale_fc(draft, first, cfg.fc_init_rms)
    if cfg.fc_precondition:
        model.fc_update_scale = fc_column_scale(first)
    wrapped = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=False) if d.world > 1 else model
    ckpt_dir = out or cfg.out_dir
    run = Run(wrapped, make_optimizer(model, cfg), source, [len(s.ids) for s in samples],
              prep.train_idx, prep.eval_idx, ckpt_dir / "checkpoint.pt", ckpt_dir / "train_log.jsonl")
    return run, model


def train(target: LlamaModel, samples: list[Sample], cfg: TrainConfig, d: Dist = Dist(),
          out: Optional[Path] = None, progress=None) -> Eagle3Draft:
    """Train (resuming from out/checkpoint.pt when present) and return the draft."""
    out = out or cfg.out_dir
    out.mkdir(parents=True, exist_ok=True)
    warm = WarmSource.load(Path(cfg.init_from), target.config) if cfg.init_from else None
    run, model = build_run(target, samples, cfg, d, out, warm)
    state = TrainState(0, Cursor(0, 0))
    if run.ckpt.is_file():
        state = restore(run.ckpt, model, run.opt)
    elif warm is not None:
        warm_start(model, warm)
    train_loop(run, cfg, state, d, progress)
    return model.draft


def warm_start(model: TTTModel, warm: WarmSource) -> None:
    """Draft weights (not optimizer, not schedule) from a warm-start source; its vocabulary and the
    layers its fc reads must be this run's (shapes are checked by load_state_dict)."""
    ids = tuple(model.draft.config.aux_layer_ids)
    if warm.aux_layer_ids != ids:
        raise ContractError("aux_layer_ids", f"{list(warm.aux_layer_ids)} in {warm.path}", list(ids),
                            f"set aux_layer_ids = {list(warm.aux_layer_ids)} in the training config "
                            "(its fc was trained on those layers), or start without init_from")
    for key in ("d2t", "t2d"):
        if not torch.equal(warm.state[key], getattr(model.draft, key)):
            raise ContractError(key, f"{key} of {warm.path}", f"{key} of this run",
                                "warm-start only from a run with the same draft vocabulary")
    model.draft.load_state_dict({**warm.state, "embed_tokens.weight": model.draft.embed_tokens.weight})
