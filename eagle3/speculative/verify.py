"""Verification of a draft tree against the target's logits at every tree node.

Greedy: pred[t] = argmax target logits at node t (the target's next token after t). A node is
consistent when tokens[t] == pred[parent[t]]; the accepted path is the longest run of consistent
nodes from the root; the bonus token is pred[last accepted node].

Sampled (lossless; the draft is deterministic given the context, so its proposals are fixed):
with p_u = target_probs(logits[u]) at node u and children c_1..c_m of u in tree order,

    accept c_j with probability  p_u(c_j) / (p_u(c_j) + sum_{l>j} p_u(c_l) + r_u)

where r_u = mass of p_u outside all children of u (that is p_u(c_j) / remaining mass after
rejecting c_1..c_{j-1}). On acceptance move to c_j; if every child is rejected (or u is a leaf),
the bonus token is sampled from p_u with all children of u removed, renormalised. Each emitted
token is thereby distributed exactly as p_u: the output distribution is the target's.

Why, for ANY fixed set of distinct children (draft nodes, suffix nodes, or both; merge.py). Write
p = p_u, r = 1 - sum_j p(c_j) and R_j = 1 - sum_{l<j} p(c_l) = p(c_j) + sum_{l>j} p(c_l) + r, the
mass not yet rejected (R_1 = 1). Rejecting c_l has probability 1 - p(c_l)/R_l = R_{l+1}/R_l, so

    P(emit c_j)      = prod_{l<j} R_{l+1}/R_l * p(c_j)/R_j = R_j * p(c_j)/R_j = p(c_j)
    P(emit x), x not a child = P(all rejected) * p(x)/r = R_{m+1} * p(x)/r = r * p(x)/r = p(x)

The emitted token is p-distributed; if it is a child c_j, the walk continues at c_j, whose logits
are the target's for the path to c_j, so the next token is drawn from the target's next-token
distribution by the same argument; a bonus token ends the step and the next step starts from the
extended context. By induction every emitted sequence has the target's probability.

The proposals enter only as the set {c_j}: the rule never reads a draft probability q(c_j) (unlike
min(1, p/q) with a (p - q)+ residual, which needs the proposal density). So a deterministic suffix
continuation (a point-mass proposal), top-k draft children, and siblings from both sources are all
verified by the same rule, as long as the set is fixed before the walk draws its uniforms (draft
and suffix candidates are functions of the context only). Where distinctness comes in: the
telescoping needs R_{j+1} = R_j - p(c_j), each token's mass removed once, and the bonus row is p
without the children (mass r). A token proposed twice under one node would count its mass twice:
here rest = resid_mass + sum(child_p) = 1 + p(a), and a is emitted with probability
p(a)/(1 + p(a)) + p(a)/(1 + p(a)) = 2p(a)/(1 + p(a)) > p(a) (tests/test_merge.py shows the bias).
That is why merge.py joins a suffix token to an existing child with the same token.

Both functions do their tensor work on the logits' device and copy to the host once (on the CPU
the sampled bonus token is drawn after the walk, from the one row it needs).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..sampling import SamplingParams, sample_rows, target_probs
from .tree import Tree


class Acceptance(NamedTuple):
    nodes: list[int]     # accepted tree indices, root first (len = accepted draft tokens + 1)
    tokens: list[int]    # emitted target ids: accepted draft tokens, then the bonus token

    @property
    def accept_len(self) -> int:
        """Accepted draft tokens (0 .. depth)."""
        return len(self.nodes) - 1


def verify_greedy(logits: torch.Tensor, tree: Tree) -> Acceptance:
    """logits [T, V] at the tree nodes -> the longest path matching the target argmax + bonus."""
    pred = logits.argmax(dim=-1)                                      # [T]
    ok = tree.tokens == pred[tree.parents.clamp(min=0)]
    ok[0] = True                                                      # the root is given
    paths = tree.paths                                                # [T, D+1]
    on_path = (paths >= 0) & ok[paths.clamp(min=0)]
    run = on_path.long().cumprod(dim=1).sum(dim=1)                    # [T] accepted prefix length
    best = run.argmax()
    path = paths[best]
    last = path.gather(0, (run[best] - 1).view(1))
    host = torch.cat([run[best].view(1), path, tree.tokens[path.clamp(min=0)],
                      pred[last]]).tolist()
    return _unpack(host, paths.shape[1])


def _unpack(host: list[int], width: int) -> Acceptance:
    num = host[0]
    nodes, tokens = host[1:1 + num], host[1 + width:1 + width + num]
    return Acceptance(nodes, tokens[1:] + [host[-1]])


def verify_sampled(logits: torch.Tensor, tree: Tree, params: SamplingParams,
                   gen: torch.Generator) -> Acceptance:
    """logits [T, V] -> lossless multi-draft acceptance under `target_probs(., params)`."""
    probs = target_probs(logits, params)                              # [T, V]
    child_p, resid_mass, resid = _child_tables(probs, tree)
    uniform = torch.rand(tree.size, generator=gen, device=probs.device)
    lazy = probs.device.type == "cpu"     # the bonus row is drawn after the walk, for its end only
    rows = [child_p, resid_mass, uniform, tree.parents, tree.tokens]
    if not lazy:
        rows.append(sample_rows(resid, gen))
    table = torch.stack([r.double() for r in rows]).tolist()          # the one host copy
    child_p, resid_mass, uniform, parents, tokens = table[:5]
    nodes = _walk([int(p) for p in parents], child_p, resid_mass, uniform)
    end = nodes[-1]
    last = int(sample_rows(resid[end:end + 1], gen)) if lazy else int(table[5][end])
    emitted = [int(tokens[t]) for t in nodes[1:]] + [last]
    return Acceptance(nodes, emitted)


def _child_tables(probs: torch.Tensor, tree: Tree):
    """child_p[t] = p_parent(t)(token t); resid[u] = p_u without u's children (where the walk
    ends at u, the bonus token is drawn from it) and its mass resid_mass[u]."""
    par = tree.parents.clamp(min=0)
    child_p = probs[par, tree.tokens]                                 # [T]; [0] unused
    resid = probs.clone()
    resid[par[1:], tree.tokens[1:]] = 0.0                             # drop each node's children
    resid_mass = resid.sum(dim=-1)                                    # [T]
    empty = resid_mass <= 0                                           # all mass on children: the
    resid = torch.where(empty[:, None], probs, resid)                 # walk never stops there
    return child_p, resid_mass, resid


def _walk(parents: list[int], child_p: list[float], resid_mass: list[float],
          uniform: list[float]) -> list[int]:
    children: list[list[int]] = [[] for _ in parents]
    for t, p in enumerate(parents[1:], start=1):
        children[p].append(t)
    node, nodes = 0, [0]
    while True:
        kids = children[node]
        rest = resid_mass[node] + sum(child_p[c] for c in kids)       # mass not yet rejected
        for c in kids:
            rest -= child_p[c]
            if uniform[c] * (child_p[c] + rest) < child_p[c]:
                break
        else:
            return nodes
        node = c
        nodes.append(c)
