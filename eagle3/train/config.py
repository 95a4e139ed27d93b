"""Training configuration: one frozen dataclass, read from a TOML/JSON file and overridden by flags."""
from __future__ import annotations

import json
import os
import types
import typing
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Optional, Union

from ..errors import InputError
from .objectives import OBJECTIVES, ObjectiveConfig


CHOICES = {"features": ("store", "online"), "optimizer": ("adamw", "muon"),
           "schedule": ("cosine", "linear", "constant"), "objective": OBJECTIVES}


@dataclass(frozen=True)
class TrainConfig:
    target: Optional[str] = None          # None = packaged SmolLM2
    out: str = "runs/train"
    data: Optional[str | tuple[str, ...]] = None   # conversations.jsonl file(s), read in order; None = <out>/data
    speculators_data: Optional[str] = None  # a speculators offline-data directory (ids, hidden states, vocab)
    speculators_layer_ids: Optional[tuple[int, ...]] = None  # its hs_<i> files' vLLM layer ids (not recorded)
    # data generation (when data is missing)
    num_prompts: int = 2000
    regen_max_new_tokens: int = 256
    regen_temperatures: tuple[float, ...] = (0.0, 1.0)
    regen_batch_size: int = 32
    # draft
    draft_vocab_size: int = 8192
    aux_layer_ids: Optional[tuple[int, ...]] = None   # "input to layer i"; None = 2, L//2, L-3
    init_from: Optional[str] = None       # start from a run's checkpoint.pt or an exported draft (keeps its vocab)
    fc_init_rms: Optional[float] = 1.0    # rescale the initial fc so fc(aux) has this median RMS (None: off)
    fc_precondition: bool = False         # AdamW on fc as if its inputs were scaled to unit RMS per dim
    # recipe switches (the draft-quality study; see docs/training.md)
    freeze_lm_head: bool = False          # lm_head stays the target's rows of the draft vocabulary
    norm_before_fc: bool = False          # RMSNorm over the fused k*Ht features before fc (Eagle 3.1)
    norm_output: bool = False             # feed the post-norm hidden back across steps (Eagle 3.1)
    init_layer_from: Optional[int] = None  # initialise the midlayer from this target layer
    draft_layers: int = 1                 # >1: plain Llama layers after the midlayer (not exported)
    feature_noise: float = 0.0            # Gaussian noise on the aux features, std relative to each row's RMS
    optimizer: str = "adamw"              # "adamw" | "muon" (Muon on the midlayer's and fc's 2-D weights)
    schedule: str = "cosine"              # "cosine" | "linear" | "constant" (after the warmup)
    # training-time test
    # TTT 3 with equal weights and peak lr 1e-3: the recipe study's best row at the same tokens
    # (held-out and MT-bench tau), and far cheaper per token than TTT 7 (studies/training-recipes/recipe_study.md)
    ttt_steps: int = 3
    step_decay: float = 1.0
    # the TTT loss per row (eagle3/train/objectives.py; the objective study: studies/training-objectives)
    objective: str = "kl"                 # "kl" | "lk" | "hass" | "griffin"
    lk_eta: float = 3.0                   # lk: KL/TV blend weight exp(-eta * mean acceptance), detached
    hass_topk: int = 10                   # hass: the target's top-K tokens distilled again ...
    hass_weight: float = 1.0              # ... with this weight
    griffin_topk: int = 4                 # griffin: a step is aligned when its top-K holds the next token
    max_len: int = 512
    batch_size: int = 8                   # conversations per global batch (all ranks)
    epochs: int = 2
    lr: float = 1e-3
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 0.5
    seed: int = 0
    features: str = "store"               # "store" (offline feature store, built once) | "online"
    features_dir: Optional[str] = None    # the store's root, shareable by runs; None = <out>/features
    eval_data: Optional[str] = None       # held-out conversations file (then eval_fraction is not used)
    autocast: str = "none"                # "bf16": matmuls in bfloat16 (fp32 master weights, fp32 loss)
    compile: bool = False                 # torch.compile the TTT loss (dynamic shapes; minutes to compile)
    eval_fraction: float = 0.02
    eval_every: int = 200                 # steps
    checkpoint_every_s: float = 300.0
    max_steps: Optional[int] = None       # stop early (the schedule still spans all epochs)
    max_tokens: Optional[int] = None      # token budget: stop at it, the schedule spans it (a study's unit)
    threads: Optional[int] = None

    def __post_init__(self):
        """Every choice and range is checked when the config is made (a file, --set, replace), not
        when a run first reaches it: a typo must not surface after the feature store was built."""
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                raise InputError(f"{name}={getattr(self, name)!r}: choose one of {', '.join(allowed)}")
        for name in ("hass_topk", "griffin_topk"):
            if getattr(self, name) < 1:
                raise InputError(f"{name}={getattr(self, name)}: a number of tokens, >= 1")
        if self.lk_eta < 0 or self.hass_weight < 0:
            raise InputError(f"lk_eta={self.lk_eta}, hass_weight={self.hass_weight}: both >= 0")
        if self.feature_noise < 0:
            raise InputError(f"feature_noise={self.feature_noise}: a standard deviation, >= 0")
        if self.eval_every < 0:
            raise InputError(f"eval_every={self.eval_every}: steps between held-out evaluations, "
                             ">= 0 (0: none)")
        if self.draft_layers < 1:
            raise InputError(f"draft_layers={self.draft_layers}: the midlayer counts, so >= 1")
        if self.max_tokens is not None and self.max_tokens <= 0:
            raise InputError(f"max_tokens={self.max_tokens}: a token budget > 0, or null for all epochs")
        if self.speculators_data and (self.data or self.eval_data):
            raise InputError("speculators_data brings its own conversations: drop data / eval_data "
                             "(its held-out share is eval_fraction)")
        if self.optimizer == "muon" and self.fc_precondition:
            raise InputError("fc_precondition rescales AdamW's per-element steps on fc; with "
                             "optimizer=muon set fc_precondition=false")

    @property
    def out_dir(self) -> Path:
        return Path(self.out)

    @property
    def data_paths(self) -> list[Path]:
        if not self.data:
            return [self.out_dir / "data" / "conversations.jsonl"]
        return [Path(p) for p in ((self.data,) if isinstance(self.data, str) else self.data)]

    @property
    def objective_config(self) -> ObjectiveConfig:
        return ObjectiveConfig(self.objective, self.lk_eta, self.hass_topk, self.hass_weight, self.griffin_topk)

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
    def from_file(cls, path: str | os.PathLike) -> "TrainConfig":
        path = Path(path)
        text = path.read_text()
        d = toml_reader().loads(text) if path.suffix == ".toml" else json.loads(text)
        return cls.from_dict(d)


def toml_reader() -> types.ModuleType:
    """tomllib (Python 3.11+), else its backport tomli, which pyproject declares for Python 3.10."""
    try:
        import tomllib
        return tomllib
    except ImportError:
        pass
    try:
        import tomli
        return tomli
    except ImportError:
        raise InputError("a TOML training config needs tomllib (Python 3.11+) or tomli on Python "
                         "3.10: pip install tomli, or give the config as JSON") from None


# ---------------------------------------------------------------------------- --set KEY=VALUE
def parse_override(item: str) -> tuple[str, Any]:
    """`KEY=VALUE` -> (key, value) typed by the field: string fields take the text as it is (a JSON
    string, list or null when it parses as one the field accepts), other fields take JSON."""
    key, sep, text = item.partition("=")
    hints = typing.get_type_hints(TrainConfig)
    if not sep:
        raise InputError(f"--set {item!r}: expected KEY=VALUE, e.g. --set lr=1e-4")
    if key not in hints:
        raise InputError(f"--set {key}: unknown training option; known: {sorted(hints)}")
    hint = hints[key]
    try:
        value = _tuples(json.loads(text))
    except json.JSONDecodeError:
        value = text
    if not _conforms(value, hint) and _conforms(text, hint):
        value = text                                   # plain text for a string field
    if not _conforms(value, hint):
        raise InputError(f"--set {key}={text!r}: expected {_type_name(hint)}, e.g. --set "
                         f"{key}={json.dumps(asdict(TrainConfig())[key])}")
    return key, value


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def _conforms(value: Any, hint: Any) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        return any(_conforms(value, a) for a in args)
    if origin is tuple:
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_conforms(v, args[0]) for v in value)
        return len(value) == len(args) and all(_conforms(v, a) for v, a in zip(value, args))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _type_name(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")
