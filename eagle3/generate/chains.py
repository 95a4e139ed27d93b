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
the draft's top-1 tokens (`DraftChain`: each request's slot of the pool's draft cache, fed the
target's features of its tokens from the batch's forwards; `DraftPool` drafts every asked chain
together: one forward over their waiting rows, then one a token over the chains still going,
each chain charged what its rows add to those forwards, `DraftSpend`). Which chains run
(`ChainPlanner`): the machine's cost table (runtime.costs: ms of a target forward by rows, of a
draft forward by rows) against each source's rolling acceptance.
A step decoding B requests (a token each, in cost(B) ms of their rows alone) over N rows takes a
chain of k rows when (B + E(k)) / (cost(B) + cost(N + k) - cost(N) + its draft ms) beats
B / cost(B) by PAY_MARGIN, with E(k) = a + a^2 + ... + a^k for the source's per-token acceptance
a; the best k of each option is taken, options with the highest a first, one per request. No
chain runs when none pays, so the batch decodes plainly then.

A block may be a tree: the chain and an alternate branch beside it (`ranked_nodes`): for the suffix
index its second candidate's continuation (another first token), for the draft its second-best
first token. The branch is tried only where the chain's first guess misses, so its nodes are worth
(1 - a) b a^(d-1) tokens each, with b the source's rolling acceptance of alternates; the planner
takes the best nodes of both branches by that worth, as it takes a chain's. The forward verifies
the tree in one block (its rows see their ancestors only: models.kv_cache.with_trees), `check_tree`
samples down it as plain decoding samples, and the slot keeps the path taken (SlotCache.keep).
Where rows are dear (a CPU, where one costs ~16% of a forward) the alternates rarely pay; where they
are cheap (AMX tiles, a GPU) they add what the first guess misses.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional, Sequence

import torch

from ..errors import InputError
from ..models.kv_cache import SlotCache
from ..sampling import SamplingParams, sample_next
from ..speculative.decoder import CATCH_UP_WINDOW
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
ALT_PRIOR_ACCEPTED, ALT_PRIOR_TRIED = 0.4, 2.0   # an alternate branch's first guess starts at 0.2:
                                                # right when the chain's first guess was wrong
ALT_MAX_TOKENS = 4         # the longest alternate branch (the suffix index's second continuation)
MEMORY = 0.9               # the weight of a source's earlier chains in its acceptance
PAY_MARGIN = 0.05          # a chain must raise the step's tokens per ms by this share: the cost
                           # table is a single sequence's at ~200 cached tokens, a batch's forward
                           # costs somewhat more per row (MT-bench, 4 clients, default weights:
                           # chains taken at no margin ran 0.93x plain decoding). A source's first
                           # chain is taken without it: at a margin its prior alone could keep it
                           # from ever being tried (a copy's suffix guesses, once one-row steps got
                           # cheaper, were never checked, so never found right)


@dataclass
class ChainAcceptance:
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
class ChainState(ChainAcceptance):
    """One request's suffix index and the acceptance of its suffix chains; `draft` its EAGLE-3
    draft chain where the batch has a draft."""
    index: SuffixIndex = field(default_factory=lambda: SuffixIndex(CHAIN_MIN_MATCH, 16, 2))
    draft: Optional["DraftChain"] = None
    accepted: float = SUFFIX_PRIOR_ACCEPTED
    alt: ChainAcceptance = field(default_factory=lambda: ChainAcceptance(ALT_PRIOR_ACCEPTED, ALT_PRIOR_TRIED))
    # the index's candidates for its current length (guess and alternate ask it once a step)
    _proposed: Optional[tuple[int, list]] = field(default=None, repr=False, compare=False)

    def guess(self, most: int) -> list[int]:
        """The continuation its index proposes now, at most `most` tokens (and within `cap`);
        empty without a long enough match."""
        return self._candidate(0, self.cap(most, CHAIN_MAX_TOKENS))

    def alternate(self, most: int) -> list[int]:
        """The index's second continuation (its first token differs from guess's), at most
        `most` tokens and ALT_MAX_TOKENS; empty where there is none."""
        return self._candidate(1, min(most, ALT_MAX_TOKENS))

    def _candidate(self, rank: int, most: int) -> list[int]:
        if most < 1:
            return []
        n = len(self.index.tokens)           # the index only grows: its length names its state
        if self._proposed is None or self._proposed[0] != n:
            self._proposed = (n, [c for c in self.index.propose(CHAIN_MAX_TOKENS)
                                  if c.match_len >= CHAIN_MIN_MATCH])
        cands = self._proposed[1]
        return cands[rank].tokens[:most] if len(cands) > rank else []


class DraftChain(ChainAcceptance):
    """One request's EAGLE-3 draft inside the batch, proposing a chain of its top-1 tokens. Its slot
    of the pool's draft cache pairs, at row i, the target's features of the request's token
    offset + i with the id of the token after it (SpecDecoder's layout, from `offset` on: a request
    that joined the batch from the solo engine, or took its prompt from the prefix cache, has no
    features before it). The features of every token the target computed wait in `waiting` until a
    chain is asked for; then the pool's catch-up forward takes them."""

    def __init__(self, pool: "DraftPool", slot: int, offset: int):
        super().__init__()
        self.pool, self.slot, self.offset = pool, slot, offset
        self.alt = ChainAcceptance(ALT_PRIOR_ACCEPTED, ALT_PRIOR_TRIED)   # its second-best first tokens
        self.waiting: list[torch.Tensor] = []        # [m, F] features of the next tokens, in order
        self.head: Optional[tuple[torch.Tensor, torch.Tensor]] = None   # last row: logits, hidden

    @property
    def length(self) -> int:
        """Rows in its slot of the draft cache (0 once closed)."""
        return self.pool.cache.lengths[self.slot] if self.slot is not None else 0

    @property
    def waiting_rows(self) -> int:
        return sum(f.shape[0] for f in self.waiting)

    @property
    def catch_up_now(self) -> int:
        """The waiting rows a step charges in full (a step's worth; the rest is spread over the
        tokens the request has left: BatchScheduler._draft_ms)."""
        return min(self.waiting_rows, DRAFT_MAX_TOKENS + 1)

    def wait(self, features: torch.Tensor) -> None:
        """The target's features [m, F] of the request's next m tokens. More than
        CATCH_UP_WINDOW rows waiting: the draft will start over from the latest of them (an empty
        slot at the offset of the first kept row), as the solo decoder's draft does, so a return
        to drafting after a long stretch costs a bounded catch-up."""
        self.waiting.append(features.clone())
        extra = self.waiting_rows - CATCH_UP_WINDOW
        if extra > 0:
            rows = torch.cat(self.waiting)[extra:]
            self.offset += self.length + extra
            if self.slot is not None:
                self.pool.cache.truncate(self.slot, 0)
            self.waiting, self.head = [rows], None

    def guess(self, k: int, tokens: Sequence[int]) -> list[int]:
        """k draft tokens after `tokens` (the request's prompt and output so far): this chain
        alone through the pool."""
        return self.pool.guess([(self, k, tokens)])[0]

    def restart(self, offset: int) -> None:
        """Its draft starts over at token `offset` (the batch decoded plainly, capturing no
        features, since it was last fed): an empty slot, nothing waiting; its acceptance kept."""
        if self.slot is not None:
            self.pool.cache.truncate(self.slot, 0)
        self.offset, self.waiting, self.head = offset, [], None

    def close(self) -> None:
        """Its slot back to the pool (the request left the batch)."""
        if self.slot is not None:
            self.pool.cache.release(self.slot)
            self.slot = None


class DraftPool:
    """The batch's EAGLE-3 draft over one slotted draft cache (a slot per request's DraftChain).
    `guess` drafts every asked chain level by level: one forward over all their catch-up rows, then
    one forward a token over the chains still going, each row of a chain in its own slot (the
    draft's `forward_rows`; a draft without it, or a single chain, runs each block on its slot's
    view, as the solo engine drafts)."""

    def __init__(self, draft, max_len: int, slots: int):
        self.draft = draft
        cfg = draft.config
        self.cache = SlotCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, max_len, slots,
                               torch.float32, draft.embed_tokens.weight.device)   # where the draft runs
        self.batched = hasattr(draft, "forward_rows")

    def open(self, offset: int) -> DraftChain:
        """A chain for a request whose draft features start at token `offset`."""
        return DraftChain(self, self.cache.allocate(), offset)

    def resume(self, cache, pending: Sequence[tuple[torch.Tensor, torch.Tensor]],
               head: Optional[tuple[torch.Tensor, torch.Tensor]], offset: int = 0) -> DraftChain:
        """The draft state a request leaves the solo engine with (SpecDecoder's draft cache from
        token `offset` on, its waiting (next ids, features) rows and head): the draft keeps its
        context when the request joins a batch."""
        chain = self.open(offset)
        n = cache.length
        self.cache.write(chain.slot, cache.k[:, 0, :, :n], cache.v[:, 0, :, :n])
        chain.waiting = [f.clone() for _, f in pending]
        chain.head = None if pending or head is None else (head[0], head[1])
        return chain

    def guess(self, asks: Sequence[tuple[DraftChain, int, Sequence[int]]]) -> list[list[int]]:
        """(chain, k, the request's prompt and output so far) -> k draft tokens each (none for a
        chain with nothing to draft from)."""
        return [chain for chain, _ in self.guess_trees(asks)]

    @torch.inference_mode()
    def guess_trees(self, asks: Sequence[tuple[DraftChain, int, Sequence[int]]]
                    ) -> list[tuple[list[int], Optional[int]]]:
        """As guess, each chain with the draft's second-best first token (its alternate; None
        for a chain with nothing to draft from): the catch-ups over the waiting rows in one
        forward, then a forward per token past the first over the chains still going; each slot
        is left at its catch-up."""
        catch = [(c, t) for c, _, t in asks if c.waiting]
        if catch:
            ids, feats, blocks, offsets = [], [], [], []
            for c, tokens in catch:
                f = torch.cat(c.waiting)
                c.waiting = []
                first = c.offset + c.length + 1              # the id after the first waiting token
                nxt = list(tokens[first:first + f.shape[0]])
                if len(nxt) != f.shape[0]:
                    raise ValueError(f"{f.shape[0]} waiting feature rows but {len(nxt)} next tokens")
                ids += nxt
                feats.append(f)
                blocks.append((c.slot, f.shape[0]))
                offsets.append(c.offset)
            logits, hidden, last = self._forward(torch.tensor(ids), blocks, offsets, features=torch.cat(feats))
            for i, (c, _) in enumerate(catch):
                c.head = (logits[i], hidden[last[i]])
        going = [(c, k) for c, k, _ in asks if c.head is not None and k > 0]
        out = {id(c): [] for c, _, _ in asks}
        alts: dict[int, Optional[int]] = {id(c): None for c, _, _ in asks}
        kept = {c.slot: c.length for c, _ in going}
        heads = [c.head for c, _ in going]
        first = True
        while going:
            logits = torch.stack([lg for lg, _ in heads])
            if first and logits.shape[-1] > 1:     # the first level's runner-up: the alternate
                runner_up = self.draft.to_target_ids(logits.topk(2, dim=-1).indices[:, 1])
                for (c, _), t in zip(going, runner_up.tolist()):
                    alts[id(c)] = t
            first = False
            tokens = self.draft.to_target_ids(logits.argmax(dim=-1))
            for (c, _), t in zip(going, tokens.tolist()):
                out[id(c)].append(t)
            more = [i for i, (c, k) in enumerate(going) if len(out[id(c)]) < k]
            if not more:
                break
            lg, hid, _ = self._forward(tokens[more], [(going[i][0].slot, 1) for i in more],
                                       [going[i][0].offset for i in more],
                                       hidden=torch.stack([heads[i][1] for i in more]))
            going = [going[i] for i in more]
            heads = [(lg[j], hid[j]) for j in range(len(more))]
        for slot, length in kept.items():
            self.cache.truncate(slot, length)
        return [(out[id(c)], alts[id(c)]) for c, _, _ in asks]

    def _forward(self, ids: torch.Tensor, blocks: list[tuple[int, int]], offsets: list[int], **inputs):
        """One draft forward over blocks (slot, rows) with ids [N] and features or hidden [N, *]:
        (logits of each block's last row, hidden [N, H], each block's last row index)."""
        rows = self.cache.plan(blocks)
        positions = rows.index + torch.cat([torch.full((b.rows,), off, dtype=torch.long)
                                            for b, off in zip(rows.blocks, offsets)])
        rows = rows._replace(positions=positions.to(rows.positions.device))
        if self.batched and len(blocks) > 1:
            o = self.draft.forward_rows(ids, rows, self.cache, **inputs)
            return o.logits, o.hidden, rows.last.tolist()
        logits, hidden = [], []
        for b in rows.blocks:
            r = slice(b.first_row, b.first_row + b.rows)
            view = self.cache.view(b.slot)
            o = self.draft(ids[r][None], rows.positions[r][None], view, logits_rows=slice(-1, None),
                           **{name: x[r][None] for name, x in inputs.items()})
            self.cache.set_length(b.slot, view.length)
            logits.append(o.logits[0, -1])
            hidden.append(o.hidden[0])
        return torch.stack(logits), torch.cat(hidden), rows.last.tolist()


class DraftSpend:
    """The draft forwards a step has taken on so far, as rows by level (0: the catch-ups, then a
    row per chain and token past the first): what one more chain adds, since each level is one
    forward over every chain's rows (DraftPool)."""

    def __init__(self, cost_ms: Callable[[float], float]):
        self.cost_ms = cost_ms
        self.rows = [0] * DRAFT_MAX_TOKENS

    def _adds(self, catch_up: int, k: int) -> list[int]:
        return [catch_up] + [1] * (k - 1)

    def added_ms(self, catch_up: int, k: int) -> float:
        """ms a chain of k adds, with `catch_up` waiting rows."""
        total = 0.0
        for level, r in enumerate(self._adds(catch_up, k)):
            have = self.rows[level]
            if r:
                total += self.cost_ms(have + r) - (self.cost_ms(have) if have else 0.0)
        return total

    def take(self, catch_up: int, k: int) -> None:
        for level, r in enumerate(self._adds(catch_up, k)):
            self.rows[level] += r


@dataclass(frozen=True)
class Guess:
    """A decoding request's guess this step: a chain from `source`, and an alternate branch beside
    it (empty: the block is a chain)."""
    source: str                  # "suffix" or "draft"
    chain: list[int]
    alternate: list[int]

    @property
    def tokens(self) -> list[int]:
        """The guessed tokens in block order, after the request's last token: the chain, then
        the alternate branch."""
        return self.chain + self.alternate

    def parents(self) -> list[int]:
        """Each block row's parent (row 0, the last token: -1): the chain in order under row 0,
        the alternate branch in order under row 0 too."""
        c = len(self.chain)
        return [-1] + list(range(c)) + [0 if j == 0 else c + j for j in range(len(self.alternate))]

    def ancestors(self) -> torch.Tensor:
        """[rows, rows] bool: row i sees row j where j is i or an ancestor of it."""
        parents = self.parents()
        seen = torch.zeros(len(parents), len(parents), dtype=torch.bool)
        for i in range(len(parents)):
            j = i
            while j >= 0:
                seen[i, j] = True
                j = parents[j]
        return seen

    def observe(self, source: ChainAcceptance, path: list[int]) -> None:
        """Tell the source (ChainState or DraftChain) what the path took: the chain's accepted
        tokens (none where the path left through the alternate), and the alternate branch's where
        the chain's first guess missed."""
        c = len(self.chain)
        on_chain = len(path) > 1 and path[1] <= c
        source.observe(c, len(path) - 1 if on_chain else 0)
        if self.alternate and not on_chain:
            source.alt.observe(len(self.alternate), len(path) - 1)


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
    most: int                            # its most rows now
    rate: float                          # its per-token acceptance
    extra_ms: Callable[[int], float]     # ms spent outside the forward for k rows (the draft)
    take: Optional[Callable[[int], None]] = None   # told the k chosen (the draft's step spend)
    nodes: tuple[tuple[int, float], ...] = ()      # ranked_nodes (a tree); () a chain at `rate`
    first: bool = False                  # its source has not had a chain checked yet: taken where it
                                         # pays at all (no PAY_MARGIN), so its prior is tested once

    def expect(self, k: int) -> float:
        """Expected accepted tokens of its best k rows."""
        return sum(w for _, w in self.nodes[:k]) if self.nodes else expected_tokens(self.rate, k)

    def bound(self) -> float:
        """No block of it brings more tokens than this."""
        if self.nodes:
            return sum(w for _, w in self.nodes)
        return self.rate / (1.0 - self.rate) if self.rate < 1.0 else float("inf")

    def branches(self, k: int) -> tuple[int, int]:
        """(chain tokens, alternate tokens) of its best k rows."""
        alt = sum(b for b, _ in self.nodes[:k])
        return k - alt, alt


def worth_asking(source: "ChainAcceptance", floor: float) -> bool:
    """A source (ChainState, DraftChain) whose chain's first guess, or its alternate's where the
    chain's misses, is accepted more often than the floor rate (ChainPlanner.floor_rate)."""
    return source.rate > floor or (1.0 - source.rate) * source.alt.rate > floor


def ranked_nodes(rate: float, most: int, alt_rate: float, alt_most: int) -> tuple[tuple[int, float], ...]:
    """The guesses of a chain of `most` tokens and an alternate branch of `alt_most` beside it,
    best first, as (branch, worth): the chain's token at depth d is accepted with rate^d, the
    alternate's with (1 - rate) alt_rate rate^(d-1) (its first token where the chain's first
    missed). The chain's first token leads, and each branch keeps its order, so every prefix is a
    tree (a node after its parent)."""
    chain = [(0, rate ** d) for d in range(1, most + 1)]
    alt = [(1, (1.0 - rate) * alt_rate * rate ** (d - 1)) for d in range(1, alt_most + 1)]
    return tuple(chain[:1] + sorted(chain[1:] + alt, key=lambda n: -n[1])) if chain else ()


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
        # every option's rows may fit (not only the longest one's), up to the forward's limit
        longest = min(sum(o.most for o in options), self.max_rows - rows)
        if longest < 1:
            return chosen
        priced: dict[int, float] = {}

        def cost(added: int) -> float:      # ms of the forward by rows added, each priced once a step
            if added not in priced:
                priced[added] = self.cost_ms(rows + added)
            return priced[added]
        added = 0
        for opt in sorted(options, key=lambda o: -o.rate):
            if opt.key in chosen:
                continue
            best, best_k = (1.0 + (0.0 if opt.first else PAY_MARGIN)) * tokens / spent, 0
            # no block of this option brings more than its bound: skip what cannot pay
            if (tokens + opt.bound()) / (spent + cost(min(added + 1, longest)) - cost(added)) <= best:
                continue
            for k in range(1, min(opt.most, longest - added) + 1):
                more = cost(added + k) - cost(added) + opt.extra_ms(k)
                gain = (tokens + opt.expect(k)) / (spent + more)
                if gain > best:
                    best, best_k = gain, k
            if best_k:
                chosen[opt.key] = (opt, best_k)
                spent += cost(added + best_k) - cost(added) + opt.extra_ms(best_k)
                if opt.take is not None:
                    opt.take(best_k)
                added += best_k
                tokens += opt.expect(best_k)
        return chosen


def check_chain(logits: torch.Tensor, chain: list[int], params: SamplingParams,
                gen: torch.Generator) -> list[int]:
    """The tokens plain decoding emits over a checked chain: logits [len(chain) + 1, V] of the
    rows (the last token, then the chain), each row sampled as plain decoding samples it until a
    token differs from the chain's next (or the chain is used up). The first len - 1 tokens are
    the accepted guesses."""
    if logits.shape[0] != len(chain) + 1:
        raise ValueError(f"a chain of {len(chain)} needs {len(chain) + 1} logit rows, got {logits.shape[0]}")
    return check_tree(logits, [-1] + list(chain), list(range(-1, len(chain))), params, gen)[0]


def check_tree(logits: torch.Tensor, tokens: Sequence[int], parents: Sequence[int], params: SamplingParams,
               gen: torch.Generator) -> tuple[list[int], list[int]]:
    """The tokens plain decoding emits over a checked tree, and the rows of the path taken. Row 0
    is the request's last token (tokens[0] unused), row i > 0 guesses tokens[i] after row
    parents[i] (parents before children, a parent's children distinct tokens); logits [n, V] of
    the rows. From row 0, each row is sampled as plain decoding samples it; where a child of it
    guessed the token drawn, that child's row is next, else the step ends. -> (the tokens drawn,
    [0, the accepted rows...]): len(tokens) - 1 guesses were accepted."""
    n = len(tokens)
    if logits.shape[0] != n or len(parents) != n:
        raise ValueError(f"a tree of {n} rows needs {n} logit rows and parents, got {logits.shape[0]} "
                         f"and {len(parents)}")
    children: dict[tuple[int, int], int] = {}
    for i in range(1, n):
        if not 0 <= parents[i] < i or (parents[i], int(tokens[i])) in children:
            raise ValueError(f"tree row {i}: parent {parents[i]} must precede it and its siblings "
                             "must guess distinct tokens")
        children[(parents[i], int(tokens[i]))] = i
    out, path = [], [0]
    while True:
        token = int(sample_next(logits[path[-1]], params, gen))
        out.append(token)
        child = children.get((path[-1], token))
        if child is None:
            return out, path
        path.append(child)
