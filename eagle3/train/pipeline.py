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

from ..errors import ContractError, InputError, UnsupportedError
from ..models.config import ModelConfig
from ..models.llama import LlamaModel
from ..draft.model import DraftConfig, Eagle3Draft
from .config import TrainConfig
from .features import Batch, FeatureSource, Sample
from .store import FeatureStore, PartKey, StorePart, build_part, part_complete, target_fingerprint
from .trainer import Cursor, Dist, Run, TrainState, load_checkpoint, make_optimizer, restore, train_loop
from .ttt import TTTConfig, TTTModel
from .vocab import DraftVocab, build_vocab, count_tokens, coverage

COVERAGE_SIZES = (1024, 2048, 4096, 8192, 16384, 32768)
STORE_DTYPE = "bfloat16"


class Prepared(NamedTuple):
    samples: list[Sample]
    train_idx: list[int]
    eval_idx: list[int]
    vocab: DraftVocab


class External(NamedTuple):
    """Data made elsewhere (speculators): its draft vocabulary, and where each store part's rows
    come from instead of the target run here: part name -> (store.FeatureFn, source label)."""
    vocab: Optional[DraftVocab] = None
    features: dict[str, tuple] = {}   # never mutated


class DataPart(NamedTuple):
    """A run's samples come from parts (data files) in order; each is one part of the feature store."""
    name: str               # store part directory (store.part_name of the file)
    count: int              # samples
    held_out: bool = False  # the eval_data file: evaluated on, never trained on


# ---------------------------------------------------------------------------- stages
def split(num: int, eval_fraction: float) -> tuple[list[int], list[int]]:
    """Every k-th conversation is held out (k = 1 / eval_fraction); deterministic."""
    if eval_fraction <= 0 or num < 4:
        return list(range(num)), []
    every = max(2, round(1 / eval_fraction))
    return [i for i in range(num) if i % every != every - 1], [i for i in range(num) if i % every == every - 1]


def split_parts(parts: Sequence[DataPart], eval_fraction: float) -> tuple[list[int], list[int]]:
    """Held-out parts are the eval set when there is one (a study's fixed conversations), else
    every k-th conversation of the training parts."""
    starts = [sum(p.count for p in parts[:k]) for k in range(len(parts))]
    train_idx = [s + i for p, s in zip(parts, starts) if not p.held_out for i in range(p.count)]
    held = [s + i for p, s in zip(parts, starts) if p.held_out for i in range(p.count)]
    if held:
        return train_idx, held
    keep, out = split(len(train_idx), eval_fraction)
    return [train_idx[i] for i in keep], [train_idx[i] for i in out]


def prepare(samples: list[Sample], cfg: TrainConfig, vocab_size: int, out: Optional[Path],
            warm: Optional["WarmSource"] = None, parts: Optional[Sequence[DataPart]] = None,
            given: Optional[DraftVocab] = None) -> Prepared:
    train_idx, eval_idx = split_parts(parts or [DataPart("samples", len(samples))], cfg.eval_fraction)
    counts = count_tokens((samples[i].ids[samples[i].loss_mask] for i in train_idx), vocab_size)
    if warm is not None:
        # a warm start keeps the source's draft vocabulary, so more data can be added to a run
        vocab = warm.vocab(vocab_size)
    elif given is not None:                       # the data's own map (speculators d2t/t2d)
        vocab = given
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
    """Draft shaped like the target; embedding shared and frozen; lm_head starts as the target's rows
    (frozen there with freeze_lm_head); the midlayer from a target layer with init_layer_from."""
    dcfg = replace(DraftConfig.for_target(target.config, len(vocab.used), cfg.aux_layer_ids),
                   norm_before_fc=cfg.norm_before_fc, norm_output=cfg.norm_output,
                   num_layers=cfg.draft_layers)
    torch.manual_seed(cfg.seed)
    draft = Eagle3Draft(dcfg)
    draft.set_embedding(target.embed_tokens.weight.detach())
    with torch.no_grad():
        draft.d2t.copy_(vocab.d2t)
        draft.t2d.copy_(vocab.t2d)
        draft.lm_head.weight.copy_(target.lm_head.weight[vocab.used])
        draft.norm.weight.copy_(target.norm.weight)
    draft.lm_head.weight.requires_grad_(not cfg.freeze_lm_head)
    if cfg.init_layer_from is not None:
        init_layer_from(draft, target, cfg.init_layer_from)
    return draft


@torch.no_grad()
def init_layer_from(draft: Eagle3Draft, target: LlamaModel, layer: int) -> None:
    """The midlayer from target layer `layer`: attention's hidden half (the input columns reading
    hidden_norm(h)) takes the layer's q/k/v, hidden_norm its input norm; o_proj, the MLP and the
    post-attention norm are copied; the embedding half keeps its random start. Biases and q/k
    norms of the target layer (Qwen2, Qwen3) have no place in the draft: refused, not dropped."""
    if not 0 <= layer < len(target.layers):
        raise InputError(f"init_layer_from={layer}: the target has layers 0..{len(target.layers) - 1}")
    src, mid, h = target.layers[layer], draft.midlayer, draft.config.hidden_size
    if src.self_attn.q_proj.bias is not None or src.self_attn.q_norm is not None:
        raise UnsupportedError(f"init_layer_from: target layer {layer} has attention biases or q/k "
                               "norms, which the draft's midlayer does not carry; start without it")
    for name in ("q_proj", "k_proj", "v_proj"):
        getattr(mid.self_attn, name).weight[:, h:] = getattr(src.self_attn, name).weight
    mid.hidden_norm.weight.copy_(src.input_layernorm.weight)
    mid.self_attn.o_proj.weight.copy_(src.self_attn.o_proj.weight)
    mid.mlp.load_state_dict(src.mlp.state_dict())
    mid.post_attention_layernorm.weight.copy_(src.post_attention_layernorm.weight)


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
                   d: Dist, out: Path, parts: Optional[Sequence[DataPart]] = None,
                   external: External = External()) -> FeatureSource:
    if cfg.features == "online":
        if external.features:
            raise InputError("features=online runs the target here; data with its own hidden states "
                             "(speculators_data) trains from the store: set features=store")
        return FeatureSource(prep.samples, aux_ids, target=target)
    root = Path(cfg.features_dir) if cfg.features_dir else out / "features"
    key = PartKey(target_fingerprint(target), tuple(aux_ids), STORE_DTYPE)
    opened, start = [], 0
    for part in parts or [DataPart("samples", len(prep.samples))]:
        samples = prep.samples[start:start + part.count]
        if d.main and not part_complete(root / part.name, key, samples):
            features, source = external.features.get(part.name, (None, "this process"))
            build_part(target, samples, key, root / part.name, features=features, source=source,
                       progress=lambda **kw: tqdm(desc=f"features {part.name}", mininterval=10, **kw))
        if d.world > 1:
            dist.barrier()
        opened.append((StorePart(root / part.name, key, samples), part.count))
        start += part.count
    return FeatureSource(prep.samples, aux_ids, store=FeatureStore(opened))


def build_run(target: LlamaModel, samples: list[Sample], cfg: TrainConfig, d: Dist,
              out: Optional[Path], warm: Optional[WarmSource] = None,
              parts: Optional[Sequence[DataPart]] = None,
              external: External = External()) -> tuple[Run, TTTModel]:
    prep = prepare(samples, cfg, target.config.vocab_size, out if d.main else None, warm, parts, external.vocab)
    draft = make_draft(target, cfg, prep.vocab)
    model = TTTModel(draft, target.lm_head.weight, TTTConfig(cfg.ttt_steps, cfg.step_decay, cfg.feature_noise,
                                                               cfg.objective_config))
    source = feature_source(target, prep, draft.config.aux_layer_ids, cfg, d, out or cfg.out_dir, parts,
                            external)
    # fc statistics on the first training batch (deterministic, so a resumed run gets the same)
    first = source.batch(prep.train_idx[:cfg.batch_size]) if cfg.fc_init_rms or cfg.fc_precondition else None
    if cfg.fc_init_rms:
        rescale_fc(draft, first, cfg.fc_init_rms)
    if cfg.fc_precondition:
        model.fc_update_scale = fc_column_scale(first)
    wrapped = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=False) if d.world > 1 else model
    if cfg.compile:                               # the training steps only; evaluation stays eager
        wrapped = torch.compile(wrapped, dynamic=True)
    ckpt_dir = out or cfg.out_dir
    run = Run(wrapped, make_optimizer(model, cfg), source, [len(s.ids) for s in samples],
              prep.train_idx, prep.eval_idx, ckpt_dir / "checkpoint.pt", ckpt_dir / "train_log.jsonl",
              [list(p) for p in parts or []])
    return run, model


def train(target: LlamaModel, samples: list[Sample], cfg: TrainConfig, d: Dist = Dist(),
          out: Optional[Path] = None, progress=None, parts: Optional[Sequence[DataPart]] = None,
          external: External = External(), between_steps=None) -> Eagle3Draft:
    """Train (resuming from out/checkpoint.pt when present) and return the draft. `parts`: where
    the samples come from (data files in order, the held-out file last); None = one part.
    `external`: a vocabulary and feature rows made elsewhere (speculators data). `between_steps`:
    called before every training step (trainer.train_loop)."""
    out = out or cfg.out_dir
    out.mkdir(parents=True, exist_ok=True)
    warm = WarmSource.load(Path(cfg.init_from), target.config) if cfg.init_from else None
    run, model = build_run(target, samples, cfg, d, out, warm, parts, external)
    state = TrainState(0, Cursor(0, 0))
    if run.ckpt.is_file():
        state = restore(run.ckpt, model, run.opt)
    elif warm is not None:
        warm_start(model, warm)
    train_loop(run, cfg, state, d, progress, between_steps)
    return model.draft


def draft_from_checkpoint(path: Path, target: LlamaModel) -> Eagle3Draft:
    """The draft of a run's checkpoint.pt as a module (a study variant that no export layout
    writes is measured this way): its config's switches, vocabulary and weights."""
    ck = load_checkpoint(path)
    cfg = TrainConfig.from_dict(json.loads(ck["config"]))
    vocab = WarmSource(path, ck["draft"], ()).vocab(target.config.vocab_size)   # its d2t/t2d, checked
    draft = make_draft(target, replace(cfg, init_layer_from=None), vocab)
    draft.load_state_dict({**ck["draft"], "embed_tokens.weight": draft.embed_tokens.weight})
    return draft.eval().requires_grad_(False)


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
