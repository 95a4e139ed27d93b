"""Tiny random-weight target and draft for tests and `eagle3 train --dry-run` (no files needed)."""
from __future__ import annotations

from typing import Optional

import torch

from ..models.config import ModelConfig
from ..models.llama import LlamaModel
from ..draft.model import DraftConfig, Eagle3Draft
from .vocab import DraftVocab

TINY_TARGET = {"architectures": ["LlamaForCausalLM"], "vocab_size": 96, "hidden_size": 32,
               "intermediate_size": 64, "num_hidden_layers": 8, "num_attention_heads": 4,
               "num_key_value_heads": 2, "max_position_embeddings": 256, "eos_token_id": 3,
               "tie_word_embeddings": True, "rope_theta": 10000.0}


def tiny_target(seed: int = 0, std: float = 0.3) -> LlamaModel:
    gen = torch.Generator().manual_seed(seed)
    model = LlamaModel(ModelConfig.from_hf(TINY_TARGET))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model.eval()


def tiny_draft(target: LlamaModel, vocab: Optional[DraftVocab] = None, seed: int = 1) -> Eagle3Draft:
    torch.manual_seed(seed)
    vd = len(vocab.used) if vocab is not None else target.config.vocab_size
    draft = Eagle3Draft(DraftConfig.for_target(target.config, draft_vocab_size=vd))
    draft.set_embedding(target.embed_tokens.weight.detach())
    if vocab is not None:
        draft.d2t.copy_(vocab.d2t)
        draft.t2d.copy_(vocab.t2d)
    return draft
