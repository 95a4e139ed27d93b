"""EAGLE-3 and EAGLE-1/2 draft models: one nn.Module each, used for both training and serving.

Inputs are explicit, so a feature can never be silently skipped (the zero-acceptance incident):
- `features=`: what the target hands over. EAGLE-3: the captured aux states [.., k*Ht]; their width
  must equal fc.in_features or a ContractError is raised, every call. EAGLE-1/2: the target's final
  hidden state [.., Ht].
- `hidden=`: the draft's own previous output [.., H] (tree expansion / training-time test steps).
Exactly one of them is given.

Positions: the row pairing the feature of token i with the embedding of token i+1 has position i.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
from torch import nn

from ..errors import ContractError
from ..models.config import ModelConfig, RopeConfig
from ..models.layers import MLP, Attention, RMSNorm, Rotary, causal_block_mask
from ..models.llama import DecoderLayer, as_block, rows_of
from ..models.kv_cache import KVCache

ALGORITHMS = ("eagle3", "eagle")


@dataclass(frozen=True)
class DraftConfig:
    algorithm: str                       # "eagle3" | "eagle" (EAGLE-1/2)
    hidden_size: int                     # H
    target_hidden_size: int              # Ht
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position: int
    vocab_size: int                      # target vocabulary V
    draft_vocab_size: int                # Vd (== V for EAGLE-1/2)
    aux_layer_ids: tuple[int, ...] = ()  # "input to layer i" convention; empty for EAGLE-1/2
    # Eagle 3.1 variants (speculators' meaning): trained, served, written in the speculators layout
    norm_before_fc: bool = False         # RMSNorm over the fused k*Ht features before fc
    norm_output: bool = False            # the hidden fed back across steps is the post-norm one
    num_layers: int = 1                  # >1: Llama layers after the midlayer (the study's (j); not exported)

    def __post_init__(self):
        if self.algorithm not in ALGORITHMS:
            raise ContractError("algorithm", self.algorithm, ALGORITHMS, "use eagle3 or eagle")
        if self.algorithm == "eagle3" and not self.aux_layer_ids:
            raise ContractError("aux_layer_ids", self.aux_layer_ids, "at least one layer id",
                                "an EAGLE-3 draft must say which target layers it reads")
        if self.algorithm == "eagle" and (self.norm_before_fc or self.norm_output):
            raise ContractError("norm_before_fc/norm_output", True, False,
                                "the Eagle 3.1 norms exist for EAGLE-3 drafts only")
        if self.num_layers < 1 or (self.algorithm == "eagle" and self.num_layers != 1):
            raise ContractError("num_layers", self.num_layers, "1 (EAGLE-1/2) or >= 1 (EAGLE-3)",
                                "a draft has its midlayer and optionally more layers after it")
        if self.draft_vocab_size > self.vocab_size:
            raise ContractError("draft_vocab_size", self.draft_vocab_size, f"<= {self.vocab_size}",
                                "the draft vocabulary must be a subset of the target's")

    @property
    def fc_in_features(self) -> int:
        if self.algorithm == "eagle3":
            return len(self.aux_layer_ids) * self.target_hidden_size
        return 2 * self.hidden_size

    @classmethod
    def for_target(cls, target: ModelConfig, draft_vocab_size: Optional[int] = None,
                   aux_layer_ids: Optional[tuple[int, ...]] = None,
                   algorithm: str = "eagle3") -> "DraftConfig":
        """The usual draft for `target`: same width, heads and rope; one layer."""
        ids = () if algorithm == "eagle" else tuple(aux_layer_ids or target.default_aux_layer_ids)
        return cls(algorithm=algorithm, hidden_size=target.hidden_size,
                   target_hidden_size=target.hidden_size, num_heads=target.num_heads,
                   num_kv_heads=target.num_kv_heads, head_dim=target.head_dim,
                   intermediate_size=target.intermediate_size, rms_norm_eps=target.rms_norm_eps,
                   rope=target.rope, max_position=target.max_position,
                   vocab_size=target.vocab_size,
                   draft_vocab_size=draft_vocab_size or target.vocab_size, aux_layer_ids=ids)


class DraftOutput(NamedTuple):
    logits: Optional[torch.Tensor]  # [B, R, Vd] draft-vocab logits for the requested rows
    hidden: torch.Tensor            # [B, T, H] output fed back as `hidden=` on the next step


class Eagle3Layer(nn.Module):
    """The midlayer: attention reads cat(input_layernorm(embedding), hidden_norm(hidden)), 2H wide."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = Attention(2 * h, h, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = MLP(h, cfg.intermediate_size)

    def attn_input(self, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)

    def forward(self, emb, hidden, cos, sin, k_buf, v_buf, start, mask):
        x = self.attn_input(emb, hidden)
        h = hidden + self.self_attn(x, cos, sin, k_buf, v_buf, start, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3ExtraLayer(DecoderLayer):
    """A layer after the midlayer (num_layers > 1): the target's pre-norm Llama layer (its
    forward), without biases or q/k norms."""

    def __init__(self, cfg: DraftConfig):
        nn.Module.__init__(self)
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = Attention(h, h, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = MLP(h, cfg.intermediate_size)


def block_mask(cache: KVCache, seq: int, attn_mask: Optional[torch.Tensor],
               device: torch.device) -> Optional[torch.Tensor]:
    """The caller's mask, or plain causal for a block of several tokens."""
    if attn_mask is None and seq > 1:
        return causal_block_mask(cache.length, seq, device)
    return attn_mask


class DraftBase(nn.Module):
    """Shared plumbing: embedding taken from the target, rotary, cache, vocab mapping."""

    config: DraftConfig

    def _init_common(self, cfg: DraftConfig) -> None:
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.rotary = Rotary(cfg.rope, cfg.head_dim, cfg.max_position)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        # identity mapping of the first Vd target ids until a real vocabulary is set
        self.register_buffer("t2d", torch.arange(cfg.vocab_size) < cfg.draft_vocab_size)

    def set_embedding(self, weight: torch.Tensor) -> None:
        """Use the target's token embedding [V, H] (frozen, shared, not copied)."""
        want = (self.config.vocab_size, self.config.hidden_size)
        if tuple(weight.shape) != want:
            raise ContractError("embed_tokens.weight", tuple(weight.shape), want,
                                "the draft was built for a target with another vocabulary or "
                                "hidden size; pair it with its own target")
        self.embed_tokens.weight = nn.Parameter(weight, requires_grad=False)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def new_cache(self, max_len: int, batch: int = 1) -> KVCache:
        p = self.embed_tokens.weight
        return KVCache(self.config.num_layers, self.config.num_kv_heads, self.config.head_dim, max_len, batch,
                       p.dtype, p.device)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def check_features(self, features: torch.Tensor) -> None:
        want = self.expected_feature_width
        if features.shape[-1] != want:
            cfg = self.config
            raise ContractError(
                "draft features width", features.shape[-1], want,
                f"this {cfg.algorithm.upper()} draft reads {self.feature_description}. Serve it "
                f"with algorithm {cfg.algorithm.upper()} and capture layers "
                f"{list(cfg.aux_layer_ids) or 'none'} from its own target")

    def check_inputs(self, features: Optional[torch.Tensor], hidden: Optional[torch.Tensor]) -> None:
        """Exactly one of features= / hidden=, each of its contracted width."""
        if (features is None) == (hidden is None):
            raise ValueError("pass exactly one of features= (from the target) or hidden= (draft's own)")
        if features is not None:
            self.check_features(features)
        elif hidden.shape[-1] != self.config.hidden_size:
            raise ContractError("draft hidden width", hidden.shape[-1], self.config.hidden_size,
                                "hidden= takes the draft's own previous output")

    def _select(self, features: Optional[torch.Tensor], hidden: Optional[torch.Tensor]):
        self.check_inputs(features, hidden)
        return self.fuse(features) if features is not None else hidden

    def _logits(self, h: torch.Tensor, logits_rows) -> Optional[torch.Tensor]:
        wanted = rows_of(h, logits_rows)
        return None if wanted is None else self.head(wanted)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache, *,
                features: Optional[torch.Tensor] = None, hidden: Optional[torch.Tensor] = None,
                attn_mask: Optional[torch.Tensor] = None,
                logits_rows: Optional[torch.Tensor | slice] = None) -> DraftOutput:
        """One draft forward over a block [B, T], appending its KV at cache.length."""
        input_ids, positions = as_block(input_ids, positions)
        seq = input_ids.shape[1]
        h = self._select(features, hidden)
        cache.check_room(seq)
        mask = block_mask(cache, seq, attn_mask, input_ids.device)
        cos, sin = self.rotary(positions)
        out = self.layer_forward(self.embed_tokens(input_ids), h, cos, sin, cache, mask)
        cache.advance(seq)
        return DraftOutput(self._logits(out, logits_rows), self.feedback(out))

    def feedback(self, out: torch.Tensor) -> torch.Tensor:
        return out


class Eagle3Draft(DraftBase):
    """EAGLE-3: fc over k fused target states, 2H-input midlayer, final norm, draft-vocab head."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        if cfg.algorithm != "eagle3":
            raise ContractError("algorithm", cfg.algorithm, "eagle3", "use Eagle1Draft for EAGLE-1/2")
        self._init_common(cfg)
        self.fc = nn.Linear(cfg.fc_in_features, cfg.hidden_size, bias=False)
        self.pre_fc_norm = RMSNorm(cfg.fc_in_features, cfg.rms_norm_eps) if cfg.norm_before_fc else None
        self.midlayer = Eagle3Layer(cfg)
        self.extra_layers = nn.ModuleList(Eagle3ExtraLayer(cfg) for _ in range(cfg.num_layers - 1))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)

    expected_feature_width = property(lambda self: self.fc.in_features)
    feature_description = property(lambda self: (
        f"{len(self.config.aux_layer_ids)} target states of width {self.config.target_hidden_size} "
        f"concatenated ({self.fc.in_features} wide)"))

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        return self.fc(features if self.pre_fc_norm is None else self.pre_fc_norm(features))

    def feedback(self, out: torch.Tensor) -> torch.Tensor:
        """The hidden handed to the next draft step: the layer's output, or its norm (norm_output)."""
        return self.norm(out) if self.config.norm_output else out

    def layer_forward(self, emb, h, cos, sin, cache: KVCache, mask) -> torch.Tensor:
        h = self.midlayer(emb, h, cos, sin, *cache.layer(0), cache.length, mask)
        for i, layer in enumerate(self.extra_layers):
            h = layer(h, cos, sin, *cache.layer(i + 1), cache.length, mask)
        return h

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h))


class Eagle1Layer(nn.Module):
    """EAGLE-1/2 decoder layer: a Llama layer whose input norm is skipped (its input is fc output)."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        h = cfg.hidden_size
        self.self_attn = Attention(h, h, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = MLP(h, cfg.intermediate_size)

    def forward(self, x, cos, sin, k_buf, v_buf, start, mask):
        h = x + self.self_attn(x, cos, sin, k_buf, v_buf, start, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle1Draft(DraftBase):
    """EAGLE-1/2: fc over cat(embedding, last target hidden) -> one Llama layer -> target lm_head.

    `features=` is the target's final (normed) hidden state; the draft predicts the next one and the
    target's own lm_head turns it into logits (full vocabulary; d2t is all zeros).
    """

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        if cfg.algorithm != "eagle":
            raise ContractError("algorithm", cfg.algorithm, "eagle", "use Eagle3Draft for EAGLE-3")
        self._init_common(cfg)
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=True)
        self.layers = nn.ModuleList([Eagle1Layer(cfg)])
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)  # the target's head

    expected_feature_width = property(lambda self: self.config.target_hidden_size)
    feature_description = property(lambda self: (
        f"the target's last hidden state ({self.config.target_hidden_size} wide)"))

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        return features  # fc needs the embedding too: applied in layer_forward

    def layer_forward(self, emb, h, cos, sin, cache: KVCache, mask) -> torch.Tensor:
        x = self.fc(torch.cat([emb, h], dim=-1))
        return self.layers[0](x, cos, sin, *cache.layer(0), cache.length, mask)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(h)

    def set_lm_head(self, weight: torch.Tensor) -> None:
        """EAGLE-1/2 drafts use the target's lm_head [V, H]."""
        self.lm_head.weight = nn.Parameter(weight, requires_grad=False)


def build_draft(cfg: DraftConfig) -> DraftBase:
    return Eagle3Draft(cfg) if cfg.algorithm == "eagle3" else Eagle1Draft(cfg)
