"""One request at a time on an Engine, behind the scheduler interface the server drives
(output.Scheduler): BatchScheduler's, for a batch of one on any target.

A request runs from its prefill to its last chunk (an Engine Run: speculative when the engine has a
draft or a suffix policy) before the next is admitted; a step is one step of that run.
"""
from __future__ import annotations

from typing import Optional

from ..sampling import SamplingParams
from .engine import Run
from .output import Emitted, Output, Request, Scheduler


class SerialScheduler(Scheduler):
    """No prefix cache: each request prefills its whole prompt."""

    def __init__(self, engine):
        super().__init__(max_batch=1)
        self.engine = engine
        self.run: Optional[Run] = None          # the running request's

    def add(self, prompt_ids: list[int], params: SamplingParams = SamplingParams()) -> Request:
        """Queue a request; it starts at the first step with nothing running."""
        self.engine.check_length(len(prompt_ids), params.max_new_tokens)
        output = Output(self.engine.tokenizer, params, self.engine.eos_ids, len(prompt_ids))
        req = Request(next(self._ids), list(prompt_ids), params, output)
        self.waiting.append(req)
        return req

    def cancel(self, req: Request) -> None:
        """Stop a request now (no further chunks)."""
        if req.done:
            return
        req.output.cancel()
        if req in self.waiting:
            self.waiting.remove(req)
        else:
            self._retire()

    def step(self) -> list[Emitted]:
        """The running request's next step (the first of a new one: its prefill)."""
        if self.run is None:
            if not self.waiting:
                return []
            req = self.waiting.popleft()
            self.running = [req]
            self.run = self.engine.start(req.prompt_ids, req.params, output=req.output)
        req = self.running[0]
        chunk = self.run.step()
        if req.done:
            self._retire()
        return [Emitted(req, chunk)]

    def _retire(self) -> None:
        if self.run is not None:
            self.run.close()
        self.run, self.running = None, []
