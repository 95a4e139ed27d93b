"""The learner: one round fine-tunes a copy of the served draft on captured traffic and a replay
share of general data, judges it on held-out traffic (gate.py) and publishes it as a new version.

A round, in order (each step resumes after a kill):
1. plan: the traffic shards to train on and the held-out ones (traffic.heldout_split), written to
   DIR/learner/state.json before anything runs, so a restarted learner finishes the same round;
2. features: the target run over every captured conversation into the feature store under
   DIR/features (train/store.py: one part per shard, kept across rounds), pausing between parts;
3. train: train.pipeline.train from the served draft (`init_from`: its d2t/t2d are kept, never
   rebuilt), checkpointing every `checkpoint_s` to DIR/learner/round-N/checkpoint.pt and pausing
   between steps while DIR/learner/pause exists (the server writes it while requests are queued);
   a target without a draft gets its first one initialised as `eagle3 train` does;
4. gate: expected tau of candidate and served draft on the held-out traffic; the candidate is saved
   as DIR/drafts/vN with its card either way, and DIR/drafts/current names it only if it passed.

Run by the server as `python -m eagle3.learn --dir DIR ...` (nice 19, one thread), or offline by
`eagle3 train --from-traffic`.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from ..errors import LoadError
from ..train.config import TrainConfig
from ..train.features import FeatureSource, load_conversations
from ..train.pipeline import STORE_DTYPE, DataPart, train
from ..train.store import PartKey, StorePart, build_part, part_complete, part_name, target_fingerprint
from ..train.trainer import Dist
from . import versions
from .capture import shard_tokens, traffic_shards, write_atomic
from .gate import expected_tau, judge, non_finite
from .traffic import heldout_split, read_shard

log = logging.getLogger("eagle3.learn")


# A served draft is fine-tuned gently: at 3e-4 (6x the shipped draft's last lr) its held-out
# acceptance on the code stream fell first (est. tau 1.569 -> 1.49 over 16-64 steps) and came back
# to 1.59 only as the schedule decayed; at 5e-5 it rose from the first eval (1.566, 1.579, ...
# 1.595), at 1e-4 less (1.584). A first draft starts from nothing and takes the larger one.
FINE_TUNE_LR = 5e-5
FIRST_DRAFT_LR = 3e-4
# ... and a first draft takes more passes over the round's features (built once; a step is ~3 s
# of one thread for Qwen2.5-Coder-0.5B). Its code stream, 240 requests, the same round: 3 epochs
# (177 steps) gave held-out est. tau 1.403, EAGLE-only tau 1.466 and the default step 1.20x plain
# decoding; 12 epochs (708 steps; the training batches' step-0 accuracy 0.92) 1.619, 1.651 and
# 1.27x, MT-bench tau 1.298 -> 1.419: the held-out traffic gains although the batches are learned.
FINE_TUNE_EPOCHS = 3
FIRST_DRAFT_EPOCHS = 12


@dataclass(frozen=True)
class LearnConfig:
    root: str
    model: Optional[str] = None          # the target (resolve_model names; None: packaged SmolLM2)
    heldout_fraction: float = 0.15       # of the traffic's tokens, newest first, never trained on
    replay: Optional[str] = None         # general conversations (regenerated data's JSONL)
    replay_share: float = 0.25           # replay tokens per traffic token in a round
    epochs: Optional[int] = None         # None: FINE_TUNE_EPOCHS with a served draft, else FIRST_DRAFT_EPOCHS
    lr: Optional[float] = None           # peak lr; None: FINE_TUNE_LR with a served draft, else FIRST_DRAFT_LR
    batch_size: int = 4
    max_len: int = 1024
    margin: float = 0.02                 # the candidate must beat served est. tau by this fraction
    checkpoint_s: float = 30.0
    autocast: str = "bf16"
    draft_vocab_size: int = 8192         # a first draft only (a served draft keeps its own)
    eval_every: int = 0                  # held-out est. tau in the round's train_log every N steps

    @property
    def dir(self) -> Path:
        return Path(self.root)


# ---------------------------------------------------------------------------- state
def state_path(root: Path) -> Path:
    return root / "learner" / "state.json"


def read_state(root: Path) -> dict:
    path = state_path(root)
    return json.loads(path.read_text()) if path.is_file() else {"round": 0, "heldout": [], "trained": []}


def write_state(root: Path, state: dict) -> None:
    state_path(root).parent.mkdir(parents=True, exist_ok=True)
    write_atomic(state_path(root), json.dumps(state, indent=2))


def pending_tokens(root: Path) -> int:
    """Captured tokens no round has planned yet (the server's start condition)."""
    state = read_state(root)
    seen = set(state["trained"]) | set(state["heldout"]) | set((state.get("in_progress") or {}).get("train", []))
    return sum(shard_tokens(p) for p in traffic_shards(root) if p.name not in seen)


def plan_round(root: Path, cfg: LearnConfig) -> dict:
    """The round to run: the one in progress (a restart), else a new one over the shards now on disk."""
    state = read_state(root)
    if state.get("in_progress"):
        return state["in_progress"]
    shards = traffic_shards(root)
    if not shards:
        raise LoadError(f"{root / 'traffic'}: no captured traffic to learn from")
    train_shards, held = heldout_split(shards, cfg.heldout_fraction, state["heldout"])
    if not train_shards or not held:
        raise LoadError(f"{root / 'traffic'}: {len(shards)} shard(s) cannot be split into training "
                        "and held-out traffic; capture more requests first")
    served = versions.current(root)
    plan = {"round": state["round"] + 1, "train": [p.name for p in train_shards],
            "heldout": [p.name for p in held], "served": served}
    write_state(root, {**state, "in_progress": plan})
    return plan


# ---------------------------------------------------------------------------- pausing
def pause_path(root: Path) -> Path:
    return root / "learner" / "pause"


def wait_while_paused(root: Path, poll_s: float = 0.2) -> Callable[[], None]:
    """A between-steps hook: returns at once unless DIR/learner/pause exists; waits while it does.
    Ends the process when its parent (the server) is gone."""
    parent = os.getppid()

    def hook() -> None:
        while pause_path(root).exists():
            if os.getppid() != parent:
                raise SystemExit("learn: the server is gone; the round resumes from its checkpoint")
            time.sleep(poll_s)
    return hook


# ---------------------------------------------------------------------------- data
def concat_shards(paths: list[Path], out: Path) -> Path:
    """One conversations file of several shards' complete records (damaged lines logged, skipped)."""
    recs = [r for p in paths for r in read_shard(p).records]
    if not out.is_file():
        write_atomic(out, "".join(json.dumps(r) + "\n" for r in recs))
    return out


def replay_subset(cfg: LearnConfig, traffic_tokens: int, out: Path) -> Optional[Path]:
    """The round's replay: the first conversations of the replay file up to replay_share x the
    traffic's tokens (None without a replay file, which the learner logs)."""
    if not cfg.replay or cfg.replay_share <= 0:
        return None
    if out.is_file():
        return out
    budget, lines = cfg.replay_share * traffic_tokens, []
    for line in Path(cfg.replay).read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        lines.append(line)
        budget -= len(rec["prompt_ids"]) + len(rec["response_ids"])
        if budget <= 0:
            break
    write_atomic(out, "".join(line + "\n" for line in lines))
    return out


def build_features(target, files: list[Path], key: PartKey, store_root: Path, max_len: int,
                   between: Callable[[], None]) -> None:
    """The feature store's part of every file (kept when complete), pausing between parts."""
    for path in files:
        samples = load_conversations(path, max_len)
        if samples and not part_complete(store_root / part_name(path), key, samples):
            between()
            build_part(target, samples, key, store_root / part_name(path), shard_size=64, batch_size=4)


# ---------------------------------------------------------------------------- a round
def learn_round(cfg: LearnConfig, target, between: Optional[Callable[[], None]] = None) -> dict:
    """Run (or finish) one round; returns the new version's card."""
    root, between = cfg.dir, between or (lambda: None)
    between()                  # planned once the server is idle: the round takes all traffic so far
    t0 = time.time()
    plan = plan_round(root, cfg)
    rdir = root / "learner" / f"round-{plan['round']}"
    rdir.mkdir(parents=True, exist_ok=True)
    tdir = root / "traffic"
    missing = [n for n in plan["train"] + plan["heldout"] if not (tdir / n).is_file()]
    if missing:
        log.warning("learn: %d planned shard(s) were dropped by the size bound since the round "
                    "was planned (%s...); the round goes on without them", len(missing), missing[0])
    train_files = [tdir / n for n in plan["train"] if (tdir / n).is_file()]
    heldout = concat_shards([tdir / n for n in plan["heldout"] if (tdir / n).is_file()], rdir / "heldout.jsonl")
    traffic_tokens = sum(shard_tokens(p) for p in train_files)
    replay = replay_subset(cfg, traffic_tokens, rdir / "replay.jsonl")
    if replay is None:
        log.warning("learn: no replay data (--learn-replay): the draft learns from traffic alone, "
                    "and its acceptance on other text may fall")
    served_path = versions.draft_path(root, plan["served"]) if plan["served"] is not None else None
    files = train_files + ([replay] if replay else [])
    tcfg = train_config(cfg, rdir, files, heldout, served_path)
    key = PartKey(target_fingerprint(target), aux_ids_of(served_path, target), STORE_DTYPE)
    build_features(target, files + [heldout], key, root / "features", cfg.max_len, between)
    samples, parts = run_data(tcfg)
    candidate = train(target, samples, tcfg, Dist(), parts=parts, between_steps=between)
    gate = gate_candidate(cfg, target, candidate, served_path, samples, parts, key)
    return publish(cfg, plan, candidate, target, gate, {
        "traffic_shards": len(train_files), "traffic_tokens": traffic_tokens,
        "replay": str(replay) if replay else None,
        "replay_tokens": sum(len(s.ids) for s in load_conversations(replay, cfg.max_len)) if replay else 0,
        "heldout_shards": len(plan["heldout"])}, steps_of(rdir), time.time() - t0, tcfg.lr, tcfg.epochs)


def train_config(cfg: LearnConfig, rdir: Path, files: list[Path], heldout: Path,
                 served: Optional[Path]) -> TrainConfig:
    return TrainConfig(target=cfg.model, out=str(rdir), data=tuple(str(p) for p in files),
                       eval_data=str(heldout), features_dir=str(cfg.dir / "features"),
                       init_from=str(served) if served else None, epochs=round_epochs(cfg, served),
                       lr=peak_lr(cfg, served),
                       warmup_steps=10, batch_size=cfg.batch_size, max_len=cfg.max_len,
                       eval_every=cfg.eval_every, checkpoint_every_s=cfg.checkpoint_s, autocast=cfg.autocast,
                       draft_vocab_size=cfg.draft_vocab_size, threads=1)


def peak_lr(cfg: LearnConfig, served: Optional[Path]) -> float:
    """The round's peak lr: the configured one, else by whether a served draft is fine-tuned."""
    if cfg.lr is not None:
        return cfg.lr
    return FINE_TUNE_LR if served is not None else FIRST_DRAFT_LR


def round_epochs(cfg: LearnConfig, served: Optional[Path]) -> int:
    """The round's epochs: the configured ones, else by whether a served draft is fine-tuned."""
    if cfg.epochs is not None:
        return cfg.epochs
    return FINE_TUNE_EPOCHS if served is not None else FIRST_DRAFT_EPOCHS


def aux_ids_of(served: Optional[Path], target) -> tuple[int, ...]:
    if served is None:
        return tuple(target.config.default_aux_layer_ids)
    from ..draft.formats import inspect_draft
    return tuple(inspect_draft(served, target.config)[1].aux_layer_ids)


def run_data(tcfg: TrainConfig) -> tuple[list, list[DataPart]]:
    from ..train.real import load_data
    return load_data(tcfg)


def steps_of(rdir: Path) -> int:
    log_path = rdir / "train_log.jsonl"
    if not log_path.is_file():
        return 0
    steps = [json.loads(x).get("step", 0) for x in log_path.read_text().splitlines() if x.strip()]
    return max(steps, default=0)


def gate_candidate(cfg: LearnConfig, target, candidate, served_path: Optional[Path], samples,
                   parts: list[DataPart], key: PartKey):
    """Both drafts' expected tau on the held-out part (the round's eval_data, the last part)."""
    held = samples[sum(p.count for p in parts[:-1]):]
    store = StorePart(cfg.dir / "features" / parts[-1].name, key, held)
    source = FeatureSource(held, key.aux_layer_ids, store=store)
    cand = expected_tau(candidate.eval(), target.lm_head.weight, source, range(len(held)))
    served = None
    if served_path is not None:
        from ..draft.formats import load_draft
        served_draft = load_draft(served_path, target.config, target=target).draft.eval()
        served = expected_tau(served_draft, target.lm_head.weight, source, range(len(held)))
    return judge(cand, served, cfg.margin, non_finite(candidate)), cand, served


def publish(cfg: LearnConfig, plan: dict, candidate, target, gate, data: dict, steps: int,
            seconds: float, lr: float, epochs: int) -> dict:
    from ..draft.formats import save_draft
    verdict, cand, served = gate
    root = cfg.dir
    version = versions.next_version(root)
    vdir = versions.drafts_dir(root) / f"v{version}"
    if verdict.passed or non_finite(candidate) is None:     # every finite candidate is kept
        save_draft(candidate, vdir, "specforge", target.config)
    body = {"status": "served" if verdict.passed else "rejected", "parent": plan["served"],
            "round": plan["round"], "data": data, "steps": steps, "epochs": epochs, "lr": lr,
            "gate": {"passed": verdict.passed, "reason": verdict.reason, "margin": cfg.margin,
                     "candidate": cand, "served": served, "method": "chain estimate on held-out traffic"},
            "seconds": round(seconds, 1), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    versions.write_card(root, version, body)
    if verdict.passed:
        versions.set_current(root, version)
        log.info("learn: v%d published and made current: %s", version, verdict.reason)
    else:
        log.warning("learn: candidate v%d rejected, v%s keeps serving: %s", version, plan["served"],
                    verdict.reason)
    state = read_state(root)
    write_state(root, {"round": plan["round"], "heldout": plan["heldout"],
                       "trained": sorted(set(state["trained"]) | set(plan["train"])), "in_progress": None})
    return {"version": version, **body}
