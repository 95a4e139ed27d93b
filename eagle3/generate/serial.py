"""One request at a time on an Engine, behind the scheduler interface the server drives
(scheduler.Scheduler): BatchScheduler's, for a batch of one on any target.

A request runs from its prefill to its last chunk (an Engine RequestRun: speculative when the
engine has a draft or a suffix policy) before the next is admitted; a step is one step of that run.
"""
from __future__ import annotations

from typing import Optional

from .engine import RequestRun
from .scheduler import Emitted, Request, Scheduler


class SerialScheduler(Scheduler):
    """No prefix cache: each request prefills its whole prompt."""

    def __init__(self, engine):
        super().__init__(1, engine.tokenizer, engine.eos_ids, engine.max_model_len)
        self.engine = engine
        self.run: Optional[RequestRun] = None          # the running request's

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
            self._drop(req)
        return [Emitted(req, chunk)]

    def _drop(self, req: Request) -> None:
        self.run.close()
        self.run, self.running = None, []
