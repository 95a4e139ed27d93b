"""Suffix candidates as branches of the EAGLE draft tree (host-side bookkeeping, no model).

Given the selected draft tree (tokens and parent indices, root first: the last emitted token) and
suffix continuations [s1..sm] (s1 = the token proposed after the root), each continuation walks
down from the root following s1, s2, ... while a child with that token exists (that node now has
both sources), and the rest of it becomes a new chain under the last matched node:

    draft tree            continuation [a, c, d]       merged (new nodes appended in order)
    0 -+- 1 (a) - 3 (b)                                 0 -+- 1 (a, both) -+- 3 (b)
       +- 2 (x)                                            |               +- 4 (c, suffix)
                                                           |                  - 5 (d, suffix)
                                                           +- 2 (x)

Invariants kept: parents precede children (new nodes go last, each after its parent), the
children of any node are distinct tokens (a new node is made only where no child has its token;
the sampled verifier needs this, see verify.py), the draft nodes keep their indices, and at most
`budget` nodes are added (a continuation is cut where the budget runs out; matched nodes are free).
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

from ..errors import ContractError

DRAFT, SUFFIX, BOTH = 1, 2, 3       # node source flags (bits); the root is 0


class MergedTree(NamedTuple):
    tokens: list[int]       # [T'] root first; the draft nodes, then the added suffix nodes
    parents: list[int]      # [T'] parents[0] = -1, parents[t] < t
    sources: list[int]      # [T'] DRAFT | SUFFIX bits per node; 0 for the root
    depth: int              # the longest root-to-node path (may exceed the spec depth)
    added: int              # suffix nodes added (T' - T)


def merge_suffix(tokens: Sequence[int], parents: Sequence[int],
                 continuations: Sequence[Sequence[int]], budget: int,
                 sources: Optional[Sequence[int]] = None) -> MergedTree:
    """Merge `continuations` (in order) into the tree, adding at most `budget` nodes."""
    tokens, parents = [int(t) for t in tokens], [int(p) for p in parents]
    sources = [0] + [DRAFT] * (len(tokens) - 1) if sources is None else list(sources)
    children = {(p, tok): t for t, (p, tok) in enumerate(zip(parents, tokens)) if t > 0}
    if len(children) != len(tokens) - 1:
        raise ContractError("draft tree siblings", "a repeated token under one parent",
                            "distinct tokens", "the draft tree must come from select_nodes")
    depth = node_depths(parents)
    size = len(tokens)
    for cont in continuations:
        node = 0
        for tok in cont:
            child = children.get((node, int(tok)))
            if child is None:
                if len(tokens) - size == budget:
                    break
                child = children[(node, int(tok))] = len(tokens)
                tokens.append(int(tok))
                parents.append(node)
                sources.append(0)
                depth.append(depth[node] + 1)
            sources[child] |= SUFFIX
            node = child
    return MergedTree(tokens, parents, sources, max(depth), len(tokens) - size)


def node_depths(parents: Sequence[int]) -> list[int]:
    # parents[t] < t, so one pass in index order
    depth = [0] * len(parents)
    for t in range(1, len(parents)):
        depth[t] = depth[parents[t]] + 1
    return depth
