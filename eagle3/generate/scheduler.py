"""What the server's engine thread drives: a Scheduler takes requests (add), runs steps (step: each
step's chunks, one per request that produced one) and drops a request at once (cancel).

The base keeps the requests waiting and running and makes each one's Output; subclasses run the
steps: serial.SerialScheduler (one request at a time on an Engine), batch.BatchScheduler
(continuous batching). Plain Python, tested without a model.
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, NamedTuple, Optional

from ..sampling import SamplingParams
from .output import Output, check_length
from .types import Chunk

if TYPE_CHECKING:
    from ..models.kv_cache import PrefixStore


@dataclass(eq=False)
class Request:
    """A request in a scheduler (read-only outside it)."""
    id: int
    prompt_ids: list[int]
    params: SamplingParams
    output: Output

    @property
    def done(self) -> bool:
        return self.output.done


class Emitted(NamedTuple):
    """A chunk a scheduler step produced, and its request."""
    request: Request
    chunk: Chunk


class Scheduler:
    """Requests waiting and running, each with its Output; subclasses implement step and _drop."""
    prefixes: Optional["PrefixStore"] = None    # the prefix cache (None: off)

    def __init__(self, max_batch: int, tokenizer, eos_ids: Iterable[int], max_model_len: int):
        self.max_batch, self.max_model_len = max_batch, max_model_len   # max_batch: run at once
        self.tokenizer, self.eos_ids = tokenizer, frozenset(eos_ids)
        self.waiting: deque = deque()               # added, not admitted yet (arrival order)
        self.running: list = []                     # admitted, not done (admission order)
        self._ids = itertools.count()

    def add(self, prompt_ids: list[int], params: SamplingParams = SamplingParams()) -> Request:
        """Queue a request (its length checked); it is admitted at a step with a free slot."""
        check_length(len(prompt_ids), params.max_new_tokens, self.max_model_len)
        output = Output(self.tokenizer, params, self.eos_ids, len(prompt_ids))
        req = self._request(next(self._ids), list(prompt_ids), params, output)
        self.waiting.append(req)
        return req

    def cancel(self, req: Request) -> None:
        """Stop a request now: no further chunks, its slot free for the next step."""
        if req.done:
            return
        req.output.cancel()
        if req in self.waiting:
            self.waiting.remove(req)
        else:
            self._drop(req)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def free_slots(self) -> int:
        return self.max_batch - len(self.running)

    def step(self) -> list[Emitted]:
        """Admit what fits, run one step; the chunks it produced."""
        raise NotImplementedError

    def _request(self, rid: int, prompt_ids: list[int], params: SamplingParams,
                 output: Output) -> Request:
        return Request(rid, prompt_ids, params, output)

    def _drop(self, req: Request) -> None:
        """Let a running request go (cancel): its slot and whatever else it holds."""
        raise NotImplementedError
