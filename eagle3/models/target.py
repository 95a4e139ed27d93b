"""What the rest of the project may assume about a target: its facts (no weights) and its interface.

TargetFacts is the one description of a target that the exporter and the launch linter read: it comes
from a config.json (`from_hf`), a GGUF header (doctor/launch.py) or any loaded config (`of`: ModelConfig,
adapters.hf.TargetConfig). Target is the protocol the engine, the decoders and the doctor use; the native
LlamaModel and the generic adapter's HFTarget both satisfy it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Protocol, Sequence

from ..errors import LoadError
from .config import default_capture_ids

if TYPE_CHECKING:
    import torch
    from torch import nn
    from .llama import ForwardOutput


@dataclass(frozen=True)
class TargetFacts:
    """Layer count, width and vocabulary of a target, and where it was read."""
    num_layers: int
    vocab_size: int
    hidden_size: int
    architecture: Optional[str] = None    # architectures[0] (GGUF: general.architecture)
    path: Optional[str] = None            # directory, .gguf or hub id it was read from

    @property
    def default_aux_layer_ids(self) -> tuple[int, int, int]:
        return default_capture_ids(self.num_layers)

    @classmethod
    def of(cls, config: Any, path: Optional[str] = None) -> "TargetFacts":
        """From any loaded target config (ModelConfig, TargetConfig: the same field names)."""
        return cls(config.num_layers, config.vocab_size, config.hidden_size, config.architecture, path)

    @classmethod
    def from_hf(cls, hf: dict, path: Optional[str] = None) -> "TargetFacts":
        """From a config.json dict (multimodal wrappers: the text_config)."""
        text = {**hf, **(hf.get("text_config") or {})}
        missing = [k for k in ("num_hidden_layers", "vocab_size", "hidden_size") if k not in text]
        if missing:
            raise LoadError(f"{path or 'target'} config.json: no {', '.join(missing)}; a target config "
                            "states its layer count, vocabulary and hidden size")
        return cls(int(text["num_hidden_layers"]), int(text["vocab_size"]), int(text["hidden_size"]),
                   (hf.get("architectures") or [None])[0], path)


class TargetConfigView(Protocol):
    """The config fields the engine, the decoders and the draft contract read from any target."""
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    eos_token_ids: tuple[int, ...]

    @property
    def default_aux_layer_ids(self) -> tuple[int, int, int]: ...


class Target(Protocol):
    """A decoder-only target behind one interface (models.llama.LlamaModel, adapters.HFTarget).

    forward appends a block [B, T] at cache.length; attn_mask is bool, broadcastable to
    [B, 1, T, cache.length + T] (None = causal); capture_ids are "input to layer i", ascending.
    """
    config: TargetConfigView
    embed_tokens: "nn.Embedding"     # shared with drafts that store no embedding (formats.attach_target)
    lm_head: "nn.Module"             # shared with EAGLE-1/2 drafts that store no head

    @property
    def device(self) -> "torch.device": ...

    def new_cache(self, max_len: int, batch: int = 1) -> Any: ...

    def check_capture_ids(self, capture_ids: Sequence[int]) -> None: ...

    def forward(self, input_ids: "torch.Tensor", positions: "torch.Tensor", cache: Any,
                attn_mask: Optional["torch.Tensor"] = None,
                logits_rows: Optional["torch.Tensor | slice"] = None,
                capture_ids: Sequence[int] = ()) -> "ForwardOutput": ...

    def __call__(self, input_ids: "torch.Tensor", positions: "torch.Tensor", cache: Any,
                 attn_mask: Optional["torch.Tensor"] = None,
                 logits_rows: Optional["torch.Tensor | slice"] = None,
                 capture_ids: Sequence[int] = ()) -> "ForwardOutput": ...
