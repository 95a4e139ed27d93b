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

Two sources: the suffix index (free to ask), and where the batch has an EAGLE-3 draft, a chain of
the draft's top-1 tokens (`DraftChain`: each request's own draft cache, fed the target's features
of its tokens from the batch's forwards; a catch-up forward over the waiting rows, then a draft
forward per token). Which chains run (`ChainPlanner`): the machine's cost table (runtime.costs: ms
of a target forward by rows, of a draft forward by rows) against each source's rolling acceptance.
A step decoding B requests (a token each, in cost(B) ms of their rows alone) over N rows takes a
chain of k rows when (B + E(k)) / (cost(B) + cost(N + k) - cost(N) + its draft ms) beats
B / cost(B) by PAY_MARGIN, with E(k) = a + a^2 + ... + a^k for the source's per-token acceptance
a; the best k of each option is taken, options with the highest a first, one per request. No
chain runs when none pays, so the batch decodes plainly then.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional, Sequence

import torch

from ..errors import InputError
from ..sampling import SamplingParams, sample_next
from ..speculative.suffix import SuffixIndex

CHAIN_MIN_MATCH = 4        # a guess needs a match this long (speculative.policy.DRAFTLESS_MIN_MATCH)
CHAIN_MAX_TOKENS = 32      # the longest suffix chain a request gets
DRAFT_MAX_TOKENS = 6       # the longest draft chain (a draft forward per token after the first)
CHAIN_GROWTH = 2           # a chain is at most CHAIN_GROWTH x (the last one's accepted + 1) long
CHAIN_FIRST = 4            # the longest first chain of a source
PRIOR_ACCEPTED, PRIOR_TRIED = 0.7, 2.0     # the acceptance a draft chain starts from: 0.35 (the
                                           # shipped draft's first token on MT-bench; from 0.5,
                                           # draft chains at 4 clients ran 0.94x plain decoding)
SUFFIX_PRIOR_ACCEPTED = 1.4                # a suffix guess's: 0.7 (a match of 4+ tokens is a copy
                                           # more often than the draft's first guess is right)
MEMORY = 0.9               # the weight of a source's earlier chains in its acceptance
PAY_MARGIN = 0.05          # a chain must raise the step's tokens per ms by this share: the cost
                           # table is a single sequence's at ~200 cached tokens, a batch's forward
                           # costs somewhat more per row (MT-bench, 4 clients, default weights:
                           # chains taken at no margin ran 0.93x plain decoding)


@dataclass
class Rolling:
    """The acceptance of one source's chains so far (decayed counts)."""
    accepted: float = PRIOR_ACCEPTED           # guessed tokens accepted ...
    tried: float = PRIOR_TRIED                 # ... and guesses checked (an accepted one, or the miss)
    last: Optional[int] = None                 # tokens accepted of its last chain
    chains: int = 0                            # chains checked
    proposed: int = 0                          # their tokens
    hits: int = 0                              # of those, accepted

    @property
    def rate(self) -> float:
        """The chance that a guessed token is accepted given the ones before it were."""
        return self.accepted / self.tried

    def cap(self, most: int, longest: int) -> int:
        """The longest chain it may get: CHAIN_FIRST at first, then CHAIN_GROWTH x (the last
        chain's accepted + 1), within `most` and `longest`."""
        return min(most, longest, CHAIN_FIRST if self.last is None else CHAIN_GROWTH * (self.last + 1))

    def observe(self, proposed: int, accepted: int) -> None:
        """A chain of `proposed` tokens of which the first `accepted` were right."""
        missed = 1.0 if accepted < proposed else 0.0
        self.accepted = MEMORY * self.accepted + accepted
        self.tried = MEMORY * self.tried + accepted + missed
        self.last = accepted
        self.chains += 1
        self.proposed += proposed
        self.hits += accepted


@dataclass
class ChainState(Rolling):
    """One request's suffix index and the acceptance of its suffix chains; `draft` its EAGLE-3
    draft chain where the batch has a draft."""
    index: SuffixIndex = field(default_factory=lambda: SuffixIndex(CHAIN_MIN_MATCH, 16, 1))
    draft: Optional["DraftChain"] = None
    accepted: float = SUFFIX_PRIOR_ACCEPTED

    def guess(self, most: int) -> list[int]:
        """The continuation its index proposes now, at most `most` tokens (and within `cap`);
        empty without a long enough match."""
        most = self.cap(most, CHAIN_MAX_TOKENS)
        if most < 1:
            return []
        cands = [c for c in self.index.propose(most) if c.match_len >= CHAIN_MIN_MATCH]
        return cands[0].tokens[:most] if cands else []


class DraftChain(Rolling):
    """One request's EAGLE-3 draft inside the batch, proposing a chain of its top-1 tokens. Its own
    draft cache pairs, at row i, the target's features of the request's token offset + i with the
    id of the token after it (SpecDecoder's layout, from `offset` on: a request that joined the
    batch from the solo engine, or took its prompt from the prefix cache, has no features before
    it). The features of every token the target computed wait in `waiting` until a chain is asked
    for; then one draft forward catches up over them."""

    def __init__(self, draft, max_len: int, offset: int):
        super().__init__()
        self.draft, self.offset = draft, offset
        self.cache = draft.new_cache(max_len)
        self.waiting: list[torch.Tensor] = []        # [m, F] features of the next tokens, in order
        self.head: Optional[tuple[torch.Tensor, torch.Tensor]] = None   # last row: logits, hidden

    @classmethod
    def resume(cls, draft, max_len: int, cache, pending: Sequence[tuple[torch.Tensor, torch.Tensor]],
               head: Optional[tuple[torch.Tensor, torch.Tensor]]) -> "DraftChain":
        """The draft state a request leaves the solo engine with (SpecDecoder's draft cache, its
        waiting (next ids, features) rows and head), as a chain from token 0: the draft keeps
        its context when the request joins a batch."""
        chain = cls(draft, max_len, 0)
        n = cache.length
        chain.cache.k[:, :, :, :n] = cache.k[:, :, :, :n]
        chain.cache.v[:, :, :, :n] = cache.v[:, :, :, :n]
        chain.cache.length = n
        chain.waiting = [f.clone() for _, f in pending]
        chain.head = None if pending or head is None else (head[0], head[1])
        return chain

    @property
    def waiting_rows(self) -> int:
        return sum(f.shape[0] for f in self.waiting)

    def wait(self, features: torch.Tensor) -> None:
        """The target's features [m, F] of the request's next m tokens."""
        self.waiting.append(features.clone())

    @torch.inference_mode()
    def guess(self, k: int, tokens: Sequence[int]) -> list[int]:
        """k draft tokens after `tokens` (the request's prompt and output so far): a catch-up over
        the waiting rows, then a draft forward per token past the first; the draft cache is left
        at the catch-up."""
        if self.waiting:
            feats = torch.cat(self.waiting)
            self.waiting = []
            start = self.cache.length
            first = self.offset + start + 1                  # the id after the first waiting token
            ids = torch.tensor(tokens[first:first + feats.shape[0]], dtype=torch.long)
            if ids.numel() != feats.shape[0]:
                raise ValueError(f"{feats.shape[0]} waiting feature rows but {ids.numel()} next tokens")
            positions = torch.arange(self.offset + start, self.offset + start + ids.numel())
            out = self.draft(ids[None], positions, self.cache, features=feats[None], logits_rows=slice(-1, None))
            self.head = (out.logits[0, -1], out.hidden[0, -1])
        if self.head is None:
            return []
        n = self.cache.length
        logits, hidden = self.head
        out = []
        for d in range(k):
            token = self.draft.to_target_ids(logits.argmax().view(1))
            out.append(int(token))
            if d + 1 == k:
                break
            o = self.draft(token.view(1, 1), torch.tensor([self.offset + n + d]), self.cache,
                           hidden=hidden.view(1, 1, -1), logits_rows=slice(-1, None))
            logits, hidden = o.logits[0, -1], o.hidden[0, -1]
        self.cache.truncate(n)
        return out


def expected_tokens(rate: float, k: int) -> float:
    """Expected accepted tokens of a chain of k guesses, each right with `rate` given the earlier:
    rate + rate^2 + ... + rate^k."""
    if rate >= 1.0:
        return float(k)
    return rate * (1.0 - rate ** k) / (1.0 - rate)


class Option(NamedTuple):
    """One way a request could extend its row this step."""
    key: object                          # the request
    source: str                          # "suffix" or "draft"
    most: int                            # its longest chain now
    rate: float                          # its per-token acceptance
    extra_ms: Callable[[int], float]     # ms spent outside the forward for a chain of k (the draft)


NO_EXTRA = lambda k: 0.0                 # noqa: E731  a suffix guess costs nothing to make


class ChainPlanner:
    """Which requests append a chain this step, from which source and how long, by cost."""

    def __init__(self, cost_ms: Callable[[float], float], max_rows: int = 1 << 30):
        """cost_ms(rows): ms of one forward over that many rows (runtime.costs.CostTable.target);
        max_rows: the most rows a forward may hold (the kernels' row-stable limit)."""
        if cost_ms(1) <= 0:
            raise InputError(f"a forward's cost must be positive, got {cost_ms(1)} ms for 1 row")
        self.cost_ms, self.max_rows = cost_ms, max_rows

    def floor_rate(self, rows: int, decoders: int) -> float:
        """The acceptance a source needs for any chain to pay this step: even a chain that never
        ends (rate / (1 - rate) tokens) for one row's cost must beat the margin. A source at or
        below it is not asked for a guess (asking costs time in every step of a large batch)."""
        if rows >= self.max_rows:
            return 1.0
        base = self.cost_ms(max(decoders, 1))
        need = (1.0 + PAY_MARGIN) * decoders * (base + self.cost_ms(rows + 1) - self.cost_ms(rows)) / base - decoders
        return need / (1.0 + need) if need > 0 else 0.0

    def plan(self, options: Sequence[Option], rows: int, decoders: int) -> dict:
        """options: ways requests could extend their rows (several per request allowed); rows: the
        step's rows without chains (prompt chunks included); decoders: the requests it decodes,
        a token each. -> {key: (option, k)}: at most one option per request, the highest
        acceptance first, each with the k that most raises the decoded tokens per ms (by more
        than PAY_MARGIN), where a
        chain is charged what its rows add to this forward (and its draft ms) and the tokens are
        weighed against a forward of the decoders' rows alone (prompt chunks are paid for anyway,
        and do not make a chain cheaper)."""
        chosen = {}
        tokens, spent = float(decoders), self.cost_ms(max(decoders, 1))
        longest = min(max((o.most for o in options), default=0), self.max_rows - rows)
        if longest < 1:
            return chosen
        cost = [self.cost_ms(rows + k) for k in range(longest + 1)]    # by rows added; once a step
        added = 0
        for opt in sorted(options, key=lambda o: -o.rate):
            if opt.key in chosen:
                continue
            best, best_k = (1.0 + PAY_MARGIN) * tokens / spent, 0
            # no chain of this rate brings more than rate / (1 - rate) tokens: skip what cannot pay
            if opt.rate < 1.0 and (tokens + opt.rate / (1.0 - opt.rate)) / (
                    spent + cost[min(added + 1, longest)] - cost[added]) <= best:
                continue
            for k in range(1, min(opt.most, longest - added) + 1):
                more = cost[added + k] - cost[added] + opt.extra_ms(k)
                gain = (tokens + expected_tokens(opt.rate, k)) / (spent + more)
                if gain > best:
                    best, best_k = gain, k
            if best_k:
                chosen[opt.key] = (opt, best_k)
                spent += cost[added + best_k] - cost[added] + opt.extra_ms(best_k)
                added += best_k
                tokens += expected_tokens(opt.rate, best_k)
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
