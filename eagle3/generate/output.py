"""One request's output, a step at a time: a step's tokens in, a streamed Chunk out.

Output is the one emit/finish path of every engine (Engine, BatchScheduler, SerialScheduler): the
tokens a step emits stop at a stop id (eos unless ignore_eos, and params.stop_token_ids) or at
max_new_tokens, the text at a stop string (TextStream); the last Chunk carries the finish reason
and the GenerationResult. Plain Python: it never sees a tensor or a model.
"""
from __future__ import annotations

import time
from typing import Iterable, Optional

from ..errors import InputError
from ..sampling import SamplingParams
from ..speculative.step import Step
from .text import TextStream
from .types import Chunk, GenerationResult


def check_length(prompt_len: int, max_new_tokens: int, max_model_len: int) -> None:
    """InputError unless a prompt is given and it fits the context with max_new_tokens."""
    if prompt_len == 0:
        raise InputError("empty prompt: give some text or chat messages")
    if prompt_len + max_new_tokens > max_model_len:
        raise InputError(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) = "
            f"{prompt_len + max_new_tokens} exceeds the context ({max_model_len} tokens); "
            "shorten the prompt or lower max_new_tokens")


def stop_ids_of(params: SamplingParams, eos_ids: Iterable[int]) -> frozenset[int]:
    """The token ids that end a request: its stop_token_ids, and eos unless ignore_eos."""
    return frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else frozenset(eos_ids))


def take_tokens(tokens: list[int], stop_ids: frozenset[int],
                room: int) -> tuple[list[int], Optional[str]]:
    """The tokens emitted (up to a stop id, at most `room`), and the finish reason if they end it."""
    new: list[int] = []
    for tok in tokens:
        if tok in stop_ids:
            return new, "stop"
        new.append(tok)
        if len(new) >= room:
            return new, "length"
    return new, None


class Output:
    """A request's tokens, text, steps and finish reason; `push` turns each step into a Chunk.
    Its clock starts when it is made (wall_s and ttft_s of the result count from there)."""

    def __init__(self, tokenizer, params: SamplingParams, eos_ids: Iterable[int], prompt_tokens: int):
        self.text = TextStream(tokenizer, params.stop)
        self.stop_ids = stop_ids_of(params, eos_ids)
        self.max_new_tokens = params.max_new_tokens
        self.prompt_tokens = prompt_tokens
        self.ids: list[int] = []
        self.steps: list[Step] = []           # steps[0] is the prefill
        self.started = time.perf_counter()
        self.ttft_s = 0.0
        self.cached_tokens = 0                # prompt tokens whose k/v came from the prefix cache
        self.finish: Optional[str] = None     # "stop" | "length" | "cancelled"

    @property
    def done(self) -> bool:
        return self.finish is not None

    def push(self, step: Step) -> Chunk:
        """Emit a step's tokens up to a stop id or max_new_tokens, then cut at a stop string."""
        self.steps.append(step)
        new, finish = take_tokens(step.tokens, self.stop_ids, self.max_new_tokens - len(self.ids))
        self.ids.extend(new)
        delta = self.text.push(new)
        if self.text.stopped:
            finish = "stop"
        self.ttft_s = self.ttft_s or time.perf_counter() - self.started
        from_draft = [i < step.accepted for i in range(len(new))]
        if finish is None:
            return Chunk(delta, new, from_draft, step=step)
        self.finish = finish
        return Chunk(delta + self.text.flush(), new, from_draft, finish, self.result(), step)

    def cancel(self) -> None:
        """End it without a last chunk (its client is gone)."""
        self.finish = self.finish or "cancelled"

    def result(self) -> GenerationResult:
        return GenerationResult(self.text.text, self.ids, self.prompt_tokens, self.finish, self.steps,
                                time.perf_counter() - self.started, self.ttft_s, self.cached_tokens)
