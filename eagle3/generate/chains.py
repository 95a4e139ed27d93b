"""Speculation inside the batch: each decoding request may append a chain of guessed tokens to its
row, taken from its own suffix index (the prompt and its output so far), and the batch's one
forward checks every chain at once.

A chain is checked by sampling each of its rows exactly as plain decoding samples (`check_chain`):
row i's token is drawn from the target's distribution at that row with the request's own generator
(argmax when greedy); while it equals the chain's next token the next row counts too, and the first
token that differs (or the row after the whole chain) ends the step. The emitted tokens are the
ones plain decoding would emit, drawn with the same numbers in the same order, because on a
row-stable layout every row's logits are the bits it gets decoded alone. So a request's output,
greedy or seeded sampling, is its plain output whatever the batch around it and whether or not it
speculated; for a guess that is one token (a point mass) this check accepts it with probability
p(token), which is what speculative sampling's min(1, p / q) gives there.

Which chains run (`ChainPlanner`): the machine's cost table (runtime.costs: ms of a forward by
rows) against each request's rolling acceptance. A step of N rows yielding Y expected tokens takes
a chain of k rows when (Y + E(k)) / cost(N + k) beats Y / cost(N), with E(k) = a + a^2 + ... + a^k
for the request's per-token acceptance a; the best k of each candidate is taken, candidates with the
highest a first. No chain runs when none pays, so the batch decodes plainly then.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from ..errors import InputError
from ..sampling import SamplingParams, sample_next
from ..speculative.suffix import SuffixIndex

CHAIN_MIN_MATCH = 4        # a guess needs a match this long (speculative.policy.DRAFTLESS_MIN_MATCH)
CHAIN_MAX_TOKENS = 32      # the longest chain a request gets
CHAIN_GROWTH = 2           # a chain is at most CHAIN_GROWTH x (the last one's accepted + 1) long
CHAIN_FIRST = 4            # the longest first chain of a request
PRIOR_ACCEPTED, PRIOR_TRIED = 1.0, 2.0     # the acceptance a request starts from: 0.5
MEMORY = 0.9               # the weight of a request's earlier chains in its acceptance


@dataclass
class ChainState:
    """One request's suffix index and the acceptance of its chains so far."""
    index: SuffixIndex = field(default_factory=lambda: SuffixIndex(CHAIN_MIN_MATCH, 16, 1))
    accepted: float = PRIOR_ACCEPTED           # decayed counts: guessed tokens accepted ...
    tried: float = PRIOR_TRIED                 # ... and guesses checked (an accepted one, or the miss)
    last: Optional[int] = None                 # tokens accepted of its last chain
    chains: int = 0                            # chains checked
    proposed: int = 0                          # their tokens
    hits: int = 0                              # of those, accepted

    @property
    def rate(self) -> float:
        """The chance that a guessed token is accepted given the ones before it were."""
        return self.accepted / self.tried

    def guess(self, most: int) -> list[int]:
        """The continuation its index proposes now, at most `most` tokens (and at most CHAIN_GROWTH
        x the last chain's accepted + 1); empty without a long enough match."""
        cap = CHAIN_FIRST if self.last is None else CHAIN_GROWTH * (self.last + 1)
        most = min(most, cap, CHAIN_MAX_TOKENS)
        if most < 1:
            return []
        cands = [c for c in self.index.propose(most) if c.match_len >= CHAIN_MIN_MATCH]
        return cands[0].tokens[:most] if cands else []

    def observe(self, proposed: int, accepted: int) -> None:
        """A chain of `proposed` tokens of which the first `accepted` were right."""
        missed = 1.0 if accepted < proposed else 0.0
        self.accepted = MEMORY * self.accepted + accepted
        self.tried = MEMORY * self.tried + accepted + missed
        self.last = accepted
        self.chains += 1
        self.proposed += proposed
        self.hits += accepted


def expected_tokens(rate: float, k: int) -> float:
    """Expected accepted tokens of a chain of k guesses, each right with `rate` given the earlier."""
    return sum(rate ** i for i in range(1, k + 1))


class ChainPlanner:
    """Which requests append a chain this step, and how long, from the cost of rows."""

    def __init__(self, cost_ms: Callable[[float], float], max_rows: int = 1 << 30):
        """cost_ms(rows): ms of one forward over that many rows (runtime.costs.CostTable.target);
        max_rows: the most rows a forward may hold (the kernels' row-stable limit)."""
        if cost_ms(1) <= 0:
            raise InputError(f"a forward's cost must be positive, got {cost_ms(1)} ms for 1 row")
        self.cost_ms, self.max_rows = cost_ms, max_rows

    def plan(self, candidates: Sequence[tuple[object, list[int], float]], rows: int,
             tokens: float) -> dict:
        """candidates: (key, guessed tokens, acceptance rate) per request; rows: the step's rows
        without chains; tokens: the tokens it yields without them. -> {key: chain} that pays."""
        chosen = {}
        for key, guess, rate in sorted(candidates, key=lambda c: -c[2]):
            base = tokens / self.cost_ms(rows)
            best, best_k = base, 0
            for k in range(1, min(len(guess), self.max_rows - rows) + 1):
                gain = (tokens + expected_tokens(rate, k)) / self.cost_ms(rows + k)
                if gain > best:
                    best, best_k = gain, k
            if best_k:
                chosen[key] = guess[:best_k]
                rows += best_k
                tokens += expected_tokens(rate, best_k)
        return chosen


def check_chain(logits: torch.Tensor, chain: list[int], params: SamplingParams,
                gen: torch.Generator) -> list[int]:
    """The tokens plain decoding emits over a checked chain: logits [len(chain) + 1, V] of the
    rows (the last token, then the chain), each row sampled as plain decoding samples it until a
    token differs from the chain's next (or the chain is used up). The first len - 1 tokens are
    the accepted guesses."""
    if logits.shape[0] != len(chain) + 1:
        raise ValueError(f"a chain of {len(chain)} needs {len(chain) + 1} logit rows, got {logits.shape[0]}")
    out = []
    for i in range(len(chain) + 1):
        token = int(sample_next(logits[i], params, gen))
        out.append(token)
        if i == len(chain) or token != chain[i]:
            break
    return out
