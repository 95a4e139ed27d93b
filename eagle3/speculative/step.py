"""What one target forward produced (`Step`), and acceptance statistics over steps (one function).

Every report of acceptance (GenerationResult, the live monitor, the bench, the doctor's probe, the
server's /metrics) reads it from here, so "tau" and "acceptance at position k" mean one thing:

    tau            = 1 + accepted draft tokens / decode steps      (tokens per target forward)
    per_position_k = steps whose accepted length reached k / steps  (k = 1 .. depth)

A step that verified no draft token (plain decoding) counts in neither.
"""
from __future__ import annotations

from collections import Counter
from typing import Iterable, Mapping, NamedTuple, Optional


class Step(NamedTuple):
    """What one target forward produced."""
    tokens: list[int]        # emitted tokens, in order: accepted draft tokens, then the bonus token
    accepted: int            # how many leading tokens are accepted draft proposals
    draft_s: float = 0.0     # time spent in the draft model this step
    verify_s: float = 0.0    # time spent in the target forward (prefill/decode/verify)
    proposed: int = 0        # draft tokens the target checked this step (tree size - 1)
    accepted_suffix: int = 0  # of `accepted`, tokens only the suffix source proposed (merge.SUFFIX)
    arm: str = ""            # the adaptive step's choice (policy.name_of: a tree shape, "suffix"
                             # for a suffix-only step, or "plain")


class AcceptanceStats(NamedTuple):
    steps: int                          # decode steps counted
    accepted: int                       # accepted draft tokens over them
    tau: float                          # 1 + accepted / steps (1.0 for no steps)
    per_position: list[float]           # [k-1]: fraction of steps accepting >= k draft tokens
    histogram: dict[int, int]           # accepted length -> steps


def acceptance_stats(accept_lens: Iterable[int] | Mapping[int, int],
                     depth: Optional[int] = None) -> AcceptanceStats:
    """Statistics over accepted lengths per step (a sequence, or a {length: steps} histogram).

    per_position has `depth` entries (zeros past the longest accepted run), or as many as the
    longest accepted run when depth is None."""
    hist = Counter(accept_lens) if not isinstance(accept_lens, Mapping) else Counter(accept_lens)
    steps = sum(hist.values())
    accepted = sum(n * c for n, c in hist.items())
    depth = max(hist, default=0) if depth is None else depth
    per_position = [sum(c for n, c in hist.items() if n >= k) / steps if steps else 0.0
                    for k in range(1, depth + 1)]
    return AcceptanceStats(steps, accepted, 1.0 + accepted / steps if steps else 1.0, per_position,
                           {n: hist[n] for n in sorted(hist)})
