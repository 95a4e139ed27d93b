"""Training configuration: one frozen dataclass, read from a TOML/JSON file and overridden by flags."""
from __future__ import annotations

import json
import tomllib
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Optional

from ..errors import InputError


@dataclass(frozen=True)
class TrainConfig:
    target: Optional[str] = None          # None = packaged SmolLM2
    out: str = "runs/train"
    data: Optional[str | tuple[str, ...]] = None   # conversations.jsonl file(s), read in order; None = <out>/data
    # data generation (when data is missing)
    num_prompts: int = 2000
    regen_max_new_tokens: int = 256
    regen_temperatures: tuple[float, ...] = (0.0, 1.0)
    regen_batch_size: int = 32
    # draft
    draft_vocab_size: int = 8192
    aux_layer_ids: Optional[tuple[int, ...]] = None   # "input to layer i"; None = 2, L//2, L-3
    init_from: Optional[str] = None       # start from another run's checkpoint.pt or an exported draft (keeps its vocab)
    fc_init_rms: Optional[float] = 1.0    # rescale the initial fc so fc(aux) has this median RMS (None: off)
    fc_precondition: bool = False         # AdamW on fc as if its inputs were scaled to unit RMS per dim
    # training-time test
    ttt_steps: int = 7
    step_decay: float = 0.8
    max_len: int = 512
    batch_size: int = 8                   # conversations per global batch (all ranks)
    epochs: int = 2
    lr: float = 3e-4
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 0.5
    seed: int = 0
    features: str = "cache"               # "cache" (safetensors shards) | "online"
    autocast: str = "none"                # "bf16": matmuls in bfloat16 (fp32 master weights, fp32 loss)
    eval_fraction: float = 0.02
    eval_every: int = 200                 # steps
    checkpoint_every_s: float = 300.0
    max_steps: Optional[int] = None       # stop early (the schedule still spans all epochs)
    threads: Optional[int] = None

    @property
    def out_dir(self) -> Path:
        return Path(self.out)

    @property
    def data_paths(self) -> list[Path]:
        if not self.data:
            return [self.out_dir / "data" / "conversations.jsonl"]
        return [Path(p) for p in ((self.data,) if isinstance(self.data, str) else self.data)]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainConfig":
        names = {f.name: f for f in fields(cls)}
        unknown = sorted(set(d) - set(names))
        if unknown:
            raise InputError(f"unknown training option(s) {unknown}; known: {sorted(names)}")
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})

    @classmethod
    def from_file(cls, path: Path) -> "TrainConfig":
        text = path.read_text()
        d = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
        return cls.from_dict(d)
