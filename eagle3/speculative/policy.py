"""The adaptive step: which tree shape to draft next, or plain decoding, from measured costs and the
rolling acceptance of each choice.

Arms are named choices: PLAIN (one target row, no draft forward) and SpecParams shapes. For each
shape the policy keeps rolling averages of what its steps did (`Rolling`: the plain mean of the
first ~1/(1 - memory) steps, then exponential with weight `memory` on the past):

    tokens   emitted tokens per step (accepted draft tokens + 1)
    rows     target rows verified per step (the tree's size; dynamic under min_prob)
    levels   draft forwards per step (tree levels run, plus the extend over the accepted tokens)

and predicts a step's cost from the machine's cost table (runtime.costs: target ms by rows, draft ms
by rows), not from the step's own wall time, which is noisy on a shared CPU:

    cost(shape) = target_ms(rows) + levels * draft_ms(top_k) + overhead_ms
    cost(PLAIN) = target_ms(1)                       (tokens = 1 exactly: nothing to learn)
    rate(arm)   = tokens(arm) / cost(arm)

`choose` returns the arm of the highest rate. A shape not tried yet goes first (in the given order);
every `probe_every` steps the shape chosen least recently is taken instead, so a stretch where the
draft starts to pay again (or a better shape) is found after a fallback. overhead_ms (tree building,
verification, bookkeeping) is measured: the average of wall time minus predicted forwards over the
speculative steps seen. Choosing never changes what is emitted: every arm is lossless.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Union

from .step import Step
from .tree import SpecParams

PLAIN = "plain"
Arm = Union[str, SpecParams]

# the adaptive step's default choices (with PLAIN): the default tree, the same with up to 8 suffix
# nodes, and a small tree with suffix nodes for stretches where deep drafts are rejected
DEFAULT_SHAPES = (SpecParams(4, 5, 8, 0.05, suffix_tokens=8), SpecParams(4, 5, 8, 0.05),
                  SpecParams(2, 3, 4, 0.1, suffix_tokens=4))


@dataclass
class Rolling:
    """A rolling mean: the plain mean of the first ~1/(1 - memory) values, then an exponential
    average with weight `memory` on the past. So the first value is not blended with a zero prior,
    and one lucky or unlucky early step weighs 1/n, like every other, instead of ~memory."""
    memory: float
    value: float = 0.0
    count: int = 0

    def add(self, x: float) -> None:
        self.count += 1
        self.value += (x - self.value) * max(1.0 / self.count, 1.0 - self.memory)


@dataclass
class ArmStats:
    memory: float
    steps: int = 0
    last_step: int = -1

    def __post_init__(self):
        self.tokens, self.rows, self.levels = (Rolling(self.memory) for _ in range(3))


@dataclass
class AdaptivePolicy:
    shapes: tuple[SpecParams, ...]
    costs: object                              # runtime.costs.CostTable
    memory: float = 0.9
    probe_every: int = 16
    allow_plain: bool = True
    stats: dict = field(default_factory=dict)  # SpecParams -> ArmStats
    chosen: Counter = field(default_factory=Counter)
    overhead_ms: float = 0.0
    steps: int = 0

    def __post_init__(self):
        if not self.shapes:
            raise ValueError("AdaptivePolicy needs at least one tree shape")
        self.stats = {s: ArmStats(self.memory) for s in self.shapes}

    # ------------------------------------------------------------------ choice
    def choose(self) -> Arm:
        untried = [s for s in self.shapes if self.stats[s].steps == 0]
        if untried:
            return untried[0]
        if self.probe_every and self.steps % self.probe_every == self.probe_every - 1:
            return min(self.shapes, key=lambda s: self.stats[s].last_step)
        arms: list[Arm] = list(self.shapes) + ([PLAIN] if self.allow_plain else [])
        return max(arms, key=self.rate)

    def rate(self, arm: Arm) -> float:
        """Predicted tokens per ms of `arm`."""
        if arm == PLAIN:
            return 1.0 / self.costs.target(1)
        s = self.stats[arm]
        return s.tokens.value / self.cost_ms(arm)

    def cost_ms(self, arm: Arm) -> float:
        if arm == PLAIN:
            return self.costs.target(1)
        s = self.stats[arm]
        return (self.costs.target(s.rows.value) + s.levels.value * self.costs.draft(arm.top_k)
                + self.overhead_ms)

    # ------------------------------------------------------------------ feedback
    def observe(self, arm: Arm, step: Step, levels: int, wall_ms: float) -> None:
        """One step taken with `arm`: its Step, the draft forwards it ran, its wall time."""
        self.chosen[name_of(arm)] += 1
        self.steps += 1
        if arm == PLAIN:
            return
        s = self.stats[arm]
        rows = step.proposed + 1
        s.tokens.add(len(step.tokens))
        s.rows.add(rows)
        s.levels.add(levels)
        s.steps += 1
        s.last_step = self.steps
        predicted = self.costs.target(rows) + levels * self.costs.draft(arm.top_k)
        n = sum(st.steps for st in self.stats.values())
        self.overhead_ms += (max(wall_ms - predicted, 0.0) - self.overhead_ms) / n

    def summary(self) -> dict:
        """How the choices spread (arm name -> steps) and each shape's averages."""
        return {"chosen": dict(self.chosen), "overhead_ms": round(self.overhead_ms, 3),
                "shapes": {name_of(s): {"tokens": round(st.tokens.value, 3), "rows": round(st.rows.value, 2),
                                      "levels": round(st.levels.value, 2), "steps": st.steps}
                           for s, st in self.stats.items()}}


def name_of(arm: Arm) -> str:
    if arm == PLAIN:
        return PLAIN
    s: SpecParams = arm
    base = f"chain{s.depth}" if s.is_chain else f"tree{s.top_k}x{s.depth}n{s.num_draft_tokens}"
    return base + (f"p{s.min_prob:g}" if s.min_prob else "") + (f"s{s.suffix_tokens}" if s.suffix_tokens else "")
