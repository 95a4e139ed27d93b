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
