"""Continuous batching of plain decoding: several requests decoded together, one target forward per
step over all of their rows (InferenceTarget.forward_rows on a SlotCache, a slot per sequence).

A step:  admit waiting requests into free slots (arrival order, up to max_batch running)
      -> rows: one per decoding request (its last token), then prompt chunks of the requests still
         prefilling, prefill_chunk prompt tokens at most per step (a long prompt is spread over
         several steps, so the decoding requests keep getting a token every step)
      -> one forward -> per request whose block ended its prompt or decoded: sample with its own
         SamplingParams and generator -> eos / stop strings / max tokens as Engine.run -> Chunk
      -> a finished request frees its slot before the next step; cancel() frees one at once.

Each request's output equals its Engine output alone (greedy and seeded sampling) where the layout
is row-stable (bf16 as load_engine builds it): every row of a forward gets the bits it gets alone.
Bookkeeping is plain Python; speculation inside the batch is not done yet (a request's block would
be its verify tree: SlotRows already lets blocks differ in rows).
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import torch

from ..errors import InputError
from ..sampling import SamplingParams, sample_next
from ..speculative.step import Step
from .engine import check_length
from .text import TextStream
from .types import Chunk, GenerationResult

DEFAULT_MAX_BATCH = 8       # an 8-row forward costs ~1.35x a one-row forward here (bf16 kernels)
PREFILL_CHUNK = 64          # prompt tokens per step, over all prefilling requests


@dataclass(eq=False)
class BatchRequest:
    """One request's state in the scheduler (read-only outside it)."""
    id: int
    prompt_ids: list[int]
    params: SamplingParams
    text: TextStream
    gen: torch.Generator
    stop_ids: frozenset[int]
    arrived: float = field(default_factory=time.perf_counter)
    slot: Optional[int] = None
    fed: int = 0                    # tokens (prompt, then output) whose k/v are in the cache
    out_ids: list[int] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    ttft_s: float = 0.0
    finish: Optional[str] = None    # "stop" | "length" | "cancelled"

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.prompt_ids)

    @property
    def done(self) -> bool:
        return self.finish is not None


class Emitted(NamedTuple):
    request: BatchRequest
    chunk: Chunk


class BatchScheduler:
    def __init__(self, target, tokenizer, eos_ids: set[int], max_batch: int = DEFAULT_MAX_BATCH,
                 max_model_len: int = 2048, prefill_chunk: int = PREFILL_CHUNK):
        """target: an inference layout with forward_rows (runtime.target.InferenceTarget)."""
        if max_batch < 1 or prefill_chunk < 1:
            raise InputError(f"max_batch ({max_batch}) and prefill_chunk ({prefill_chunk}) must be "
                             ">= 1")
        if not hasattr(target, "forward_rows"):
            raise InputError(f"{type(target).__name__} has no batched forward (forward_rows): "
                             "batching needs the native inference layout; use max_batch 1")
        self.target, self.tokenizer, self.eos_ids = target, tokenizer, frozenset(eos_ids)
        self.max_batch, self.max_model_len, self.prefill_chunk = max_batch, max_model_len, prefill_chunk
        self.cache = target.new_slot_cache(max_model_len, max_batch)
        self.waiting: deque[BatchRequest] = deque()
        self.running: list[BatchRequest] = []          # admission order
        self._ids = itertools.count()

    @classmethod
    def from_engine(cls, engine, max_batch: int = DEFAULT_MAX_BATCH,
                    prefill_chunk: int = PREFILL_CHUNK) -> "BatchScheduler":
        """A scheduler over an Engine's target, tokenizer, eos ids and context length."""
        return cls(engine.target, engine.tokenizer, engine.eos_ids, max_batch, engine.max_model_len,
                   prefill_chunk)

    # ------------------------------------------------------------------ requests
    def add(self, prompt_ids: list[int], params: SamplingParams = SamplingParams()) -> BatchRequest:
        """Queue a request; it joins the batch at the next step with a free slot."""
        check_length(len(prompt_ids), params.max_new_tokens, self.max_model_len)
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_ids)
        req = BatchRequest(next(self._ids), list(prompt_ids), params,
                           TextStream(self.tokenizer, params.stop),
                           params.generator(self.target.device), frozenset(stop_ids))
        self.waiting.append(req)
        return req

    def cancel(self, req: BatchRequest) -> None:
        """Stop a request now: its slot is free for the next step (no further chunks)."""
        if req.done:
            return
        req.finish = "cancelled"
        if req in self.waiting:
            self.waiting.remove(req)
        self._retire(req)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def free_slots(self) -> int:
        return self.max_batch - len(self.running)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[Emitted]:
        """One forward over every running request's rows; the chunks it produced."""
        self._admit()
        if not self.running:
            return []
        blocks = self._blocks()
        rows = self.cache.plan([(req.slot, len(ids)) for req, ids in blocks])
        t0 = time.perf_counter()
        logits = self.target.forward_rows(torch.tensor([t for _, ids in blocks for t in ids]),
                                          rows, self.cache)
        step_s = time.perf_counter() - t0
        emitted = []
        for (req, ids), row in zip(blocks, logits):
            req.fed += len(ids)
            if not req.prefilling:
                emitted.append(Emitted(req, self._emit(req, row, step_s)))
        for req in [r for r in self.running if r.done]:
            self._retire(req)
        return emitted

    def _admit(self) -> None:
        while self.waiting and self.free_slots:
            req = self.waiting.popleft()
            req.slot = self.cache.allocate()
            self.running.append(req)

    def _blocks(self) -> list[tuple[BatchRequest, list[int]]]:
        """Each running request's tokens this step: decoders first, then prompt chunks in order."""
        blocks = [(r, [r.out_ids[-1]]) for r in self.running if not r.prefilling]
        budget = self.prefill_chunk
        for r in self.running:
            if r.prefilling and budget:
                ids = r.prompt_ids[r.fed:r.fed + budget]
                blocks.append((r, ids))
                budget -= len(ids)
        return blocks

    def _emit(self, req: BatchRequest, logits: torch.Tensor, step_s: float) -> Chunk:
        """Sample the request's next token and apply its stop conditions (as Engine.run)."""
        token = int(sample_next(logits, req.params, req.gen))
        step = Step([token], 0, verify_s=step_s)
        req.steps.append(step)
        new = [] if token in req.stop_ids else [token]
        req.out_ids.extend(new)
        finish = "stop" if not new else ("length" if len(req.out_ids) >= req.params.max_new_tokens else None)
        delta = req.text.push(new)
        if req.text.stopped:
            finish = "stop"
        req.ttft_s = req.ttft_s or time.perf_counter() - req.arrived
        if finish is None:
            return Chunk(delta, new, [False] * len(new), step=step)
        req.finish = finish
        delta += req.text.flush()
        result = GenerationResult(req.text.text, req.out_ids, len(req.prompt_ids), finish, req.steps,
                                  time.perf_counter() - req.arrived, req.ttft_s)
        return Chunk(delta, new, [False] * len(new), finish, result, step)

    def _retire(self, req: BatchRequest) -> None:
        if req.slot is not None:
            self.cache.release(req.slot)
            req.slot = None
        if req in self.running:
            self.running.remove(req)
