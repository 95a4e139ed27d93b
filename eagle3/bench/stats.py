"""Per-run records and the summary over prompts: tokens/s, per-prompt speedup ratios (median and
spread), tau, acceptance per draft position, time split, greedy identity."""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

from ..speculative.step import acceptance_stats


@dataclass
class Record:
    """One generation by one system on one prompt at one temperature."""
    system: str
    family: str
    device: str
    question_id: int
    category: str
    temperature: float
    prompt_tokens: int
    new_tokens: int
    seconds: float
    tau: Optional[float] = None
    accept_lens: Optional[list[int]] = None
    draft_s: Optional[float] = None
    verify_s: Optional[float] = None
    other_s: Optional[float] = None
    tokens: Optional[list[int]] = field(default=None, repr=False)   # kept out of the JSON
    extra: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("tokens")
        d["tokens_per_s"] = self.tokens_per_s
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Record":
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


@dataclass(frozen=True)
class Spread:
    median: float
    p25: float
    p75: float
    lo: float
    hi: float
    n: int

    @classmethod
    def of(cls, xs: Sequence[float]) -> Optional["Spread"]:
        xs = sorted(x for x in xs if x is not None)
        if not xs:
            return None
        q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
        return cls(statistics.median(xs), q[0], q[2], xs[0], xs[-1], len(xs))

    def text(self, fmt: str = "{:.2f}") -> str:
        return f"{fmt.format(self.median)} [{fmt.format(self.p25)}-{fmt.format(self.p75)}]"


def by_key(records: list[Record]) -> dict[tuple[str, float, int], Record]:
    return {(r.system, r.temperature, r.question_id): r for r in records}


def ratios(records: list[Record], system: str, baseline: str, temperature: float) -> list[float]:
    """Per-prompt tokens/s ratio system / baseline (prompts where both ran)."""
    index = by_key(records)
    out = []
    for r in records:
        if r.system == system and r.temperature == temperature:
            base = index.get((baseline, temperature, r.question_id))
            if base is not None and base.tokens_per_s > 0:
                out.append(r.tokens_per_s / base.tokens_per_s)
    return out


def acceptance_per_position(records: list[Record], depth: int) -> list[float]:
    """Fraction of decode steps (pooled over prompts) accepting at least k draft tokens, k=1..depth."""
    return acceptance_stats([n for r in records for n in (r.accept_lens or [])], depth).per_position


def tau_pooled(records: list[Record]) -> Optional[float]:
    """Tokens per target forward, pooled over every decode step (our systems)."""
    lens = [n for r in records for n in (r.accept_lens or [])]
    return acceptance_stats(lens).tau if lens else None


def first_divergence(a: Sequence[int], b: Sequence[int]) -> Optional[int]:
    """Index of the first differing token (None when identical, len of the shorter when a prefix)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@dataclass(frozen=True)
class Identity:
    system: str
    reference: str
    identical: int
    compared: int
    divergences: tuple[tuple[int, int], ...]   # (question_id, first differing token index)


def greedy_identity(records: list[Record], system: str, reference: str) -> Optional[Identity]:
    """Compare temperature-0 token ids of `system` with `reference` prompt by prompt."""
    index = by_key(records)
    same, total, diverged = 0, 0, []
    for r in records:
        if r.system != system or r.temperature != 0 or r.tokens is None:
            continue
        ref = index.get((reference, 0.0, r.question_id))
        if ref is None or ref.tokens is None:
            continue
        total += 1
        at = first_divergence(r.tokens, ref.tokens)
        if at is None:
            same += 1
        else:
            diverged.append((r.question_id, at))
    return Identity(system, reference, same, total, tuple(diverged)) if total else None
