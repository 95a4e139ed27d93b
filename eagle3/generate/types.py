"""Data returned by generation: per-step stats, streamed chunks, the final result."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Optional, Protocol

from ..speculative.step import Step, acceptance_stats


class Chunk(NamedTuple):
    """A streamed piece of output."""
    text: str                          # new text (stop strings removed, incomplete UTF-8 held back)
    token_ids: list[int]               # new token ids
    from_draft: list[bool]             # per new token: an accepted draft proposal (not the bonus)
    finish_reason: Optional[str] = None     # "stop" | "length" on the last chunk
    result: Optional["GenerationResult"] = None  # filled on the last chunk
    step: Optional[Step] = None        # the engine step behind this chunk (the first: the prefill)


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str
    steps: list[Step] = field(default_factory=list)   # steps[0] is the prefill
    wall_s: float = 0.0
    ttft_s: float = 0.0
    cached_tokens: int = 0          # prompt tokens whose k/v came from the prefix cache

    @property
    def decode_steps(self) -> list[Step]:
        return self.steps[1:]

    @property
    def tau(self) -> float:
        """Mean tokens per target decode forward (accepted draft tokens + 1); 1.0 without a draft."""
        return acceptance_stats([s.accepted for s in self.decode_steps]).tau

    @property
    def arms(self) -> dict[str, int]:
        """Decode steps per adaptive choice (tree shape name or "plain"); empty without a policy."""
        counts: dict[str, int] = {}
        for s in self.decode_steps:
            if s.arm:
                counts[s.arm] = counts.get(s.arm, 0) + 1
        return counts

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.wall_s if self.wall_s > 0 else 0.0

    def acceptance_per_position(self, depth: int) -> list[float]:
        """Fraction of decode steps whose accepted draft length reached position 1..depth."""
        return acceptance_stats([s.accepted for s in self.decode_steps], depth).per_position


class Decoder(Protocol):
    """Produces tokens for one sequence: a prefill, then one step per target forward."""

    def prefill(self, prompt_ids: list[int], max_new_tokens: int) -> Step: ...

    def step(self) -> Step: ...
