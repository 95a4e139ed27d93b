"""EAGLE-2 dynamic draft trees: spec parameters, frontier expansion, pruning, tree layout.

Pure tensor code, no model. The draft loop in engine.py calls, per draft forward:

    frontier, level = expand(frontier, draft_logits, top_k, offset)

and after `depth` levels `select_nodes` keeps the best `num_draft_tokens - 1` candidates (only those
whose path probability reaches `min_prob`, when set) and `build_tree` turns their parents into the
verification layout.

Index spaces (candidate index c = order of creation, level by level; tree index t = verify row):

    candidate   c in [0, M)      M = top_k + (depth - 1) * top_k**2; parent -1 = the root
    tree        t in [0, T)      T = num_draft_tokens; t = 0 is the root (the token the target
                                 just produced), nodes sorted by candidate index, so a parent
                                 always precedes its children

Scores are cumulative draft log-probabilities: score(child) = score(parent) + log p(child | parent).
Every log-prob is <= 0, so a child never outscores its parent (also in floating point: rounding is
monotonic); ties are broken by the lower candidate index, so the kept set is closed under parents.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from ..errors import InputError


MAX_DRAFT_TOKENS = 256   # = models.packed.STABLE_ROWS: every verify block of a row-stable target


def max_candidates(top_k: int, depth: int) -> int:
    """Draft candidates a tree of `depth` levels creates: top_k at level 1, top_k**2 at each later one
    (every frontier node gets top_k children, the best top_k of them are expanded next)."""
    return top_k + (depth - 1) * top_k * top_k


def tree_shape_problem(top_k: int, depth: int, num_draft_tokens: int,
                       max_draft_tokens: Optional[int] = MAX_DRAFT_TOKENS) -> Optional[str]:
    """Why this tree shape cannot be built, or None. `max_draft_tokens` caps the verify block (ours:
    MAX_DRAFT_TOKENS; None for an engine without that cap)."""
    for name, value in (("top_k", top_k), ("depth", depth)):
        if value < 1:
            return f"spec {name} must be >= 1, got {value}"
    cap = max_draft_tokens if max_draft_tokens is not None else math.inf
    if not 2 <= num_draft_tokens <= cap:
        return (f"num_draft_tokens must be in [2, {cap}] (the root and at least one draft token"
                + ("" if max_draft_tokens is None else "; larger verify blocks would leave the "
                   "row-stable kernels") + f"), got {num_draft_tokens}")
    most = max_candidates(top_k, depth)
    if num_draft_tokens - 1 > most:
        return (f"num_draft_tokens={num_draft_tokens} needs {num_draft_tokens - 1} draft candidates but "
                f"top_k={top_k}, depth={depth} produce at most {most} (top_k + (depth-1)*top_k^2); "
                f"lower num_draft_tokens to <= {most + 1} or raise depth/top_k")
    return None


@dataclass(frozen=True)
class SpecParams:
    """Tree shape: `top_k` children per expanded node and frontier width, `depth` draft levels,
    `num_draft_tokens` verified nodes including the root. top_k = 1 is a chain of `depth` tokens.

    `min_prob` > 0 makes the size dynamic: a candidate is verified only if the draft's probability of
    its whole path is >= min_prob (at least one draft token per step). On a CPU every verified row
    costs target compute, so nodes that will almost surely be rejected slow the step down; on a GPU
    the verify cost is flat in the tree size and 0 (always num_draft_tokens) is the usual choice.
    The default (4, 5, 8, 0.05) was the best shape at both temperatures together in
    `eagle3 bench --tune` on the 2-core CPU with the shipped draft (docs/benchmarks.md).

    `suffix_tokens` > 0 merges up to that many extra nodes per step from suffix matches over the
    prompt and output so far (speculative/suffix.py, merge.py) into the tree: verified in the same
    forward, so the block holds up to num_draft_tokens + suffix_tokens rows and a suffix chain can
    reach below `depth`. 0 (the default) is off.
    """
    top_k: int = 4
    depth: int = 5
    num_draft_tokens: int = 8
    min_prob: float = 0.05
    suffix_tokens: int = 0

    def __post_init__(self):
        if not 0.0 <= self.min_prob < 1.0:
            raise InputError(f"spec min_prob must be in [0, 1), got {self.min_prob}")
        problem = tree_shape_problem(self.top_k, self.depth, self.num_draft_tokens)
        if problem:
            raise InputError(problem)
        if not 0 <= self.suffix_tokens <= MAX_DRAFT_TOKENS - self.num_draft_tokens:
            raise InputError(f"suffix_tokens must be in [0, {MAX_DRAFT_TOKENS - self.num_draft_tokens}] "
                             f"(num_draft_tokens + suffix_tokens verified rows <= {MAX_DRAFT_TOKENS}), "
                             f"got {self.suffix_tokens}; lower suffix_tokens or num_draft_tokens")

    @classmethod
    def chain(cls, depth: int, min_prob: float = 0.0) -> "SpecParams":
        return cls(top_k=1, depth=depth, num_draft_tokens=depth + 1, min_prob=min_prob)

    @property
    def min_score(self) -> float:
        """min_prob as a cumulative log-prob bound (-inf when off)."""
        return math.log(self.min_prob) if self.min_prob > 0 else -math.inf

    @property
    def is_chain(self) -> bool:
        return self.top_k == 1

    @property
    def max_candidates(self) -> int:
        return max_candidates(self.top_k, self.depth)

    @property
    def draft_rows(self) -> int:
        """Draft-cache rows written by the tree forwards of one step (dropped afterwards)."""
        return (self.depth - 1) * self.top_k

    @property
    def max_tree_size(self) -> int:
        """Verified rows of one step: the draft tree and the merged suffix nodes."""
        return self.num_draft_tokens + self.suffix_tokens

    @property
    def cache_slack(self) -> int:
        """Cache rows needed beyond prompt + max_new_tokens (verify block or draft tree rows)."""
        return max(self.max_tree_size, self.draft_rows) + 1


# ---------------------------------------------------------------------------- expansion
class Frontier(NamedTuple):
    """The nodes expanded by the next draft forward (one forward row each)."""
    scores: torch.Tensor     # [K] float32 cumulative log-probs
    tokens: torch.Tensor     # [K] int64 draft-vocab ids
    cand_idx: torch.Tensor   # [K] int64 candidate index (-1 = root)
    rows: torch.Tensor       # [K] int64 row of the forward that produced each node


class Level(NamedTuple):
    """Every candidate created by one expansion (all are kept for the final rerank)."""
    scores: torch.Tensor     # [N] float32
    tokens: torch.Tensor     # [N] int64 draft-vocab ids
    parents: torch.Tensor    # [N] int64 candidate index of the parent (-1 = root)


def root_frontier(device: torch.device | str = "cpu") -> Frontier:
    """The root as a one-node frontier: score 0, candidate index -1."""
    zero = torch.zeros(1, dtype=torch.long, device=device)
    return Frontier(torch.zeros(1, device=device), zero, zero - 1, zero)


def top_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    # logits [..., Vd] -> log-probs [..., k] (<= 0), ids [..., k], best first
    logits = logits.float()
    vals, ids = logits.topk(k, dim=-1)
    lp = vals - logits.logsumexp(dim=-1, keepdim=True)
    return lp.clamp_(max=0.0), ids


def expand(frontier: Frontier, logits: torch.Tensor, top_k: int, offset: int) -> tuple[Frontier, Level]:
    """Children of every frontier node; the global top_k of them become the next frontier.

    logits [F, Vd]: draft logits at the frontier rows (F = 1 for the root). `offset` = number of
    candidates created before this level. Returns the next frontier ([top_k]) and the level ([F*top_k]).
    """
    lp, ids = top_logprobs(logits, top_k)                       # [F, k]
    scores = (frontier.scores[:, None] + lp).flatten()          # [F*k]
    level = Level(scores, ids.flatten(), frontier.cand_idx.repeat_interleave(top_k))
    best = scores.topk(top_k).indices                           # [k] into F*k
    nxt = Frontier(scores[best], level.tokens[best], best + offset, best // top_k)
    return nxt, level


def concat_levels(levels: list[Level]) -> Level:
    return Level(*(torch.cat(parts) for parts in zip(*levels)))


# ---------------------------------------------------------------------------- pruning
class Selection(NamedTuple):
    cand_idx: torch.Tensor   # [T-1] kept candidate indices, ascending
    parents: torch.Tensor    # [T] tree index of each node's parent; parents[0] = -1 (root)


def select_nodes(cands: Level, num_nodes: int, min_score: float = -math.inf) -> Selection:
    """Keep the best `num_nodes - 1` candidates by cumulative score, in candidate order; with a finite
    `min_score` only those scoring >= min_score, but at least one (the count is read on the host)."""
    order = torch.sort(cands.scores, descending=True, stable=True).indices
    take = num_nodes - 1
    if min_score > -math.inf:
        take = max(1, min(take, int((cands.scores >= min_score).sum())))
    kept = order[:take].sort().values                           # [T-1]
    tree_idx = torch.full_like(cands.parents, -1)
    tree_idx[kept] = torch.arange(1, kept.numel() + 1, device=kept.device)
    par = cands.parents[kept]
    tree_par = torch.where(par < 0, torch.zeros_like(par), tree_idx[par.clamp(min=0)])
    return Selection(kept, torch.cat([par.new_full((1,), -1), tree_par]))


# ---------------------------------------------------------------------------- layout
class Tree(NamedTuple):
    """A draft tree ready for one verification forward (T nodes, root first)."""
    tokens: torch.Tensor     # [T] int64 target ids; tokens[0] = root
    parents: torch.Tensor    # [T] int64; parents[0] = -1; parents[t] < t
    mask: torch.Tensor       # [T, T] bool; mask[i, j] = j is i or an ancestor of i
    depth: torch.Tensor      # [T] int64; root 0
    positions: torch.Tensor  # [T] int64; prefix_len + depth
    paths: torch.Tensor      # [T, max_depth+1] int64; row t = root..t indices, padded with -1
    is_leaf: torch.Tensor    # [T] bool
    sources: Optional[list[int]] = None   # [T] merge.DRAFT/SUFFIX bits per node (host); None:
                                          # every node but the root is a draft node

    @property
    def size(self) -> int:
        return self.tokens.numel()


def ancestry_mask(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    # parents [T] (parents[0] = -1, parents[t] < t) -> [T, T] bool, ancestors and self
    size = parents.numel()
    idx = torch.arange(size, device=parents.device)
    up = parents.clamp(min=0)                                   # the root points to itself
    mask = torch.zeros(size, size, dtype=torch.bool, device=parents.device)
    cur = idx
    for _ in range(max_depth + 1):                              # self, parent, grandparent, ...
        mask[idx, cur] = True
        cur = up[cur]
    return mask


def build_tree(tokens: torch.Tensor, parents: torch.Tensor, prefix_len: int, max_depth: int,
               sources: Optional[list[int]] = None) -> Tree:
    """tokens [T] (root first), parents [T] -> mask, positions, root-to-node paths.

    `max_depth` bounds the depth of any node (the spec depth, or a merged tree's depth); no host
    sync. `sources` (merge.py) is carried along for the acceptance statistics.
    """
    size = parents.numel()
    mask = ancestry_mask(parents, max_depth)
    depth = mask.sum(dim=1) - 1
    col = torch.arange(size, device=parents.device)
    keyed = torch.where(mask, col, size).sort(dim=1).values[:, :max_depth + 1]
    paths = keyed.masked_fill(keyed == size, -1)                # ancestors in index = depth order
    is_parent = torch.zeros(size, dtype=torch.bool, device=parents.device)
    is_parent[parents[1:]] = True
    return Tree(tokens, parents, mask, depth, prefix_len + depth, paths, ~is_parent, sources)
