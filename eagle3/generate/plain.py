"""Plain (non-speculative) decoding on the native runtime: the baseline every speed figure uses."""
from __future__ import annotations

import time

import torch

from ..models.llama import LlamaModel
from ..models.kv_cache import KVCache
from ..sampling import SamplingParams, sample_next
from ..speculative.step import Step


class PlainDecoder:
    """One token per target forward, sampled (or argmax) from the processed distribution."""

    def __init__(self, target: LlamaModel, cache: KVCache, params: SamplingParams):
        self.target, self.cache, self.params = target, cache, params
        self.device = target.device
        self.gen = params.generator(self.device)
        self.next_token: torch.Tensor = torch.empty(0)
        self.pos = 0

    def prefill(self, prompt_ids: list[int], max_new_tokens: int) -> Step:
        self.cache.reset()
        self.cache.check_room(len(prompt_ids) + max_new_tokens)
        t0 = time.perf_counter()
        ids = torch.tensor([prompt_ids], device=self.device)
        out = self.target(ids, torch.arange(len(prompt_ids), device=self.device), self.cache,
                          logits_rows=slice(-1, None))
        self.pos = len(prompt_ids)
        return self._emit(out.logits[0, -1], t0)

    def step(self) -> Step:
        t0 = time.perf_counter()
        pos = torch.tensor([self.pos], device=self.device)
        out = self.target(self.next_token.view(1, 1), pos, self.cache)
        self.pos += 1
        return self._emit(out.logits[0, -1], t0)

    def _emit(self, logits: torch.Tensor, t0: float) -> Step:
        self.next_token = sample_next(logits, self.params, self.gen)
        token = int(self.next_token)
        return Step([token], 0, verify_s=time.perf_counter() - t0)
