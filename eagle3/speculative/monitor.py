"""Live acceptance watch: counters for /metrics and a loud warning when nothing is accepted.

A draft that is paired wrongly with its target still runs; it only proposes tokens the target never
accepts (the zero-acceptance incident). The monitor sees every decode step; when the mean accepted
length over a full window is 1.0 token per target forward (no draft token accepted) and the draft
has never done much better (lifetime accepted tokens per step below `floor`), it warns once and
reports `degraded` until acceptance comes back. The second condition keeps a working draft quiet
through a stretch it cannot predict (sampling at T=1 with the shipped draft meets long runs of
zeros in degenerate text while its lifetime acceptance stays well above the floor); a mis-paired
draft stays near 0 from its first step.
"""
from __future__ import annotations

import logging
from collections import Counter, deque
from typing import Any

from .policy import DRAFT_MEASURE_STEPS
from .step import Step, acceptance_stats

log = logging.getLogger("eagle3.speculative")

DEGRADED_MESSAGE = (
    "SPECULATION IS NOT WORKING: the target accepted 0 draft tokens in each of the last {n} steps "
    "(mean accepted length 1.0). Usual causes: wrong aux layer ids (the 'input to layer i' vs "
    "'output of layer i' off-by-one), the wrong algorithm (an EAGLE-3 draft served as EAGLE, or the "
    "reverse), or a draft trained for another target model. Generation stays correct, only slower."
)


class AcceptanceMonitor:
    def __init__(self, window: int = 32, floor: float = 0.05):
        self.window, self.floor = window, floor
        self.recent: deque[int] = deque(maxlen=window)   # accepted draft tokens per step
        self.steps = 0
        self.proposed = 0
        self.accepted = 0
        self.accept_hist: Counter[int] = Counter()       # accepted draft tokens -> steps
        self.warned = False

    def observe(self, step: Step) -> None:
        """Record one decode step (not the prefill). A step that verified no draft token (plain
        decoding on an engine that has a draft) says nothing about acceptance and is skipped."""
        if step.proposed <= 0:
            return
        self.steps += 1
        self.proposed += step.proposed
        self.accepted += step.accepted
        self.accept_hist[step.accepted] += 1
        self.recent.append(step.accepted)
        if self.degraded and not self.warned:
            self.warned = True
            log.warning(DEGRADED_MESSAGE.format(n=self.window))

    @property
    def degraded(self) -> bool:
        """True while a full window of steps accepted no draft token at all and the lifetime
        acceptance is below `floor` accepted draft tokens per step."""
        return (len(self.recent) == self.window and not any(self.recent)
                and self.accepted < self.floor * self.steps)

    @property
    def tau(self) -> float:
        """Mean tokens per target forward since start (accepted draft tokens + 1); 0.0 before any step."""
        return acceptance_stats(self.accept_hist).tau if self.steps else 0.0

    @property
    def window_tau(self) -> float:
        return 1.0 + sum(self.recent) / len(self.recent) if self.recent else 0.0

    def acceptance_per_position(self) -> list[float]:
        """Fraction of steps whose accepted draft length reached position 1, 2, ..."""
        return acceptance_stats(self.accept_hist).per_position

    def snapshot(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "proposed_tokens": self.proposed,
            "accepted_tokens": self.accepted,
            "tau": self.tau,
            "window_tau": self.window_tau,
            "degraded": self.degraded,
            "accept_len_histogram": {k: self.accept_hist[k] for k in sorted(self.accept_hist)},
            "acceptance_per_position": self.acceptance_per_position(),
        }


DRAFT_COLLAPSED_MESSAGE = (
    "THE DRAFT IS NOT ACCEPTED: its own proposals accepted {accepted} tokens over {steps} verify steps "
    "(tau {tau:.2f}). Suffix-only blocks and plain steps keep the server at plain speed, so nothing "
    "else shows it. Usual causes: draft weights lost or never trained (an RL weight update or memory "
    "release that did not restore them, a random draft), a d2t rebuilt after training, or a draft "
    "paired with the wrong target.")


# A draft whose latest own steps (at least DRAFT_MEASURE_STEPS) accepted fewer tokens than this a
# step has collapsed: 0 or 1 accepted over 32 steps. The shipped draft's own steps accept ~0.25
# (sampled) to ~0.4 (greedy) tokens each, so 32 of them fall that low with a chance of ~1e-3 or
# less; judged over 4 steps (0.7^4: one fresh server in four), the shipped draft was reported
# collapsed at a server's start. A random draft accepts ~0.
DRAFT_FLOOR = 0.05


def is_draft_step(step: Step) -> bool:
    """A step whose verified block holds the draft's own proposals: not a suffix-only block (arm
    "suffix", from the solo policy or a suffix chain in the batch) and not a plain step."""
    return step.proposed > 0 and step.arm not in ("suffix", "plain")


class DraftWatch:
    """The draft's own acceptance, apart from suffix-only blocks and plain steps: the adaptive
    policy stops asking a useless draft, so the overall rolling tau stays healthy (suffix blocks
    accept) while the draft itself accepts nothing. `collapsed` while the draft's latest own steps
    (at least `min_steps`, at most `window`) accepted less than `floor` tokens each on average;
    `steps` and `accepted` count since start."""

    def __init__(self, min_steps: int = DRAFT_MEASURE_STEPS, floor: float = DRAFT_FLOOR, window: int = 64):
        self.min_steps, self.floor = min_steps, floor
        self.recent: deque[int] = deque(maxlen=window)   # the draft's own accepted tokens per step
        self.steps = 0
        self.accepted = 0

    def observe(self, step: Step) -> None:
        if is_draft_step(step):
            own = step.accepted - step.accepted_suffix
            self.steps += 1
            self.accepted += own
            self.recent.append(own)

    @property
    def tau(self) -> float:
        """1 + the draft's own accepted tokens per draft step (0.0 before any)."""
        return 1.0 + self.accepted / self.steps if self.steps else 0.0

    @property
    def collapsed(self) -> bool:
        return len(self.recent) >= self.min_steps and sum(self.recent) < self.floor * len(self.recent)

    def snapshot(self) -> dict[str, Any]:
        return {"steps": self.steps, "accepted_tokens": self.accepted, "tau": self.tau,
                "collapsed": self.collapsed}
