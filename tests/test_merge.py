"""Suffix continuations merged into draft trees: layout invariants, and lossless sampled
verification of trees whose nodes come from both sources (no model)."""
from __future__ import annotations

import random

import pytest
import torch

from eagle3.errors import ContractError
from eagle3.sampling import SamplingParams, target_probs
from eagle3.speculative.merge import BOTH, DRAFT, SUFFIX, merge_suffix
from eagle3.speculative.tree import build_tree
from eagle3.speculative.verify import verify_sampled
from spec_helpers import chi_square_p

#        0 (root, token 7)
#      1 (tok 1)    2 (tok 2)
#      3 (tok 3)    5 (tok 1)
#      4 (tok 0)
PARENTS = [-1, 0, 0, 1, 3, 2]
TOKENS = [7, 1, 2, 3, 0, 1]


# ---------------------------------------------------------------------------- merge
def test_a_continuation_follows_draft_nodes_then_hangs_a_chain():
    m = merge_suffix(TOKENS, PARENTS, [[1, 3, 5, 6]], budget=8)
    assert m.tokens == TOKENS + [5, 6] and m.parents == PARENTS + [3, 6]
    assert m.sources == [0, BOTH, DRAFT, BOTH, DRAFT, DRAFT, SUFFIX, SUFFIX]
    assert m.added == 2 and m.depth == 4              # 0-1-3-6-7: one below the draft's depth 3


def test_a_continuation_inside_the_tree_adds_nothing():
    m = merge_suffix(TOKENS, PARENTS, [[2, 1]], budget=8)
    assert m.tokens == TOKENS and m.parents == PARENTS and m.added == 0
    assert m.sources == [0, DRAFT, BOTH, DRAFT, DRAFT, BOTH]


def test_budget_cuts_the_chain_and_later_candidates_share_suffix_nodes():
    m = merge_suffix(TOKENS, PARENTS, [[4, 4, 4, 4], [2, 6]], budget=3)
    assert m.tokens[6:] == [4, 4, 4] and m.parents[6:] == [0, 6, 7] and m.added == 3
    assert m.sources[2] == BOTH and 6 not in m.tokens  # [2, 6]: matching is free, 6 found no room
    m = merge_suffix(TOKENS, PARENTS, [[5, 6, 7], [5, 6, 8]], budget=8)
    assert m.tokens[6:] == [5, 6, 7, 8] and m.parents[6:] == [0, 6, 7, 7]
    assert m.sources[6:] == [SUFFIX] * 4


def test_repeated_siblings_in_the_draft_tree_are_refused():
    with pytest.raises(ContractError, match="siblings"):
        merge_suffix([7, 1, 1], [-1, 0, 0], [[1]], budget=2)


def random_draft_tree(rng: random.Random, size: int, vocab: int):
    """Random parents with distinct tokens among siblings."""
    tokens, parents = [rng.randrange(vocab)], [-1]
    for t in range(1, size):
        free = {p: [v for v in range(vocab) if (p, v) not in set(zip(parents, tokens))]
                for p in range(t)}
        p = rng.choice([p for p in free if free[p]])
        tokens.append(rng.choice(free[p]))
        parents.append(p)
    return tokens, parents


def paths_of(tokens, parents) -> list[tuple]:
    out = []
    for t in range(len(tokens)):
        path = []
        while t > 0:
            path.append(tokens[t])
            t = parents[t]
        out.append(tuple(path[::-1]))
    return out


def brute_added(draft_paths: set, conts, budget: int) -> tuple[list[tuple], set]:
    """New root paths in creation order, and the root paths of every node a continuation reached."""
    have, new, reached = set(draft_paths), [], set()
    for cont in conts:
        for j in range(1, len(cont) + 1):
            prefix = tuple(cont[:j])
            if prefix not in have:
                if len(new) == budget:
                    break
                have.add(prefix)
                new.append(prefix)
            reached.add(prefix)
    return new, reached


def brute_layout(parents: list[int]):
    """Ancestor lists (root first) per node."""
    out = []
    for t in range(len(parents)):
        path = [t]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        out.append(path[::-1])
    return out


@pytest.mark.parametrize("seed", range(5))
def test_merged_trees_keep_the_layout_invariants(seed):
    rng = random.Random(seed)
    for _ in range(40):
        vocab = rng.randint(2, 5)
        tokens, parents = random_draft_tree(rng, rng.randint(2, 9), vocab)
        conts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 8))]
                 for _ in range(rng.randint(1, 3))]
        budget = rng.randint(0, 10)
        m = merge_suffix(tokens, parents, conts, budget)
        paths = paths_of(m.tokens, m.parents)
        new, reached = brute_added(set(paths_of(tokens, parents)), conts, budget)
        assert m.tokens[:len(tokens)] == tokens and m.parents[:len(parents)] == parents
        assert len(m.tokens) == len(tokens) + len(new) and m.added == len(new)
        assert paths[len(tokens):] == new                            # added in order
        assert len(set(paths)) == len(paths)                         # siblings distinct
        assert all(m.parents[t] < t for t in range(1, len(m.parents)))
        for t, path in enumerate(paths):
            want = (DRAFT if t < len(tokens) and t > 0 else 0) | (SUFFIX if path in reached else 0)
            assert m.sources[t] == want, (t, path)
        check_layout(m, prefix_len=rng.randint(0, 20))


def check_layout(m, prefix_len: int):
    tree = build_tree(torch.tensor(m.tokens), torch.tensor(m.parents), prefix_len, m.depth, m.sources)
    ancestors = brute_layout(m.parents)
    assert int(tree.depth.max()) == m.depth and tree.sources == m.sources
    for t, anc in enumerate(ancestors):
        assert tree.mask[t].nonzero().flatten().tolist() == anc
        assert int(tree.positions[t]) == prefix_len + len(anc) - 1
        assert [i for i in tree.paths[t].tolist() if i >= 0] == anc
        assert bool(tree.is_leaf[t]) == (t not in m.parents)


# ---------------------------------------------------------------------------- lossless, mixed trees
VOCAB = 6


def two_token_target(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A target over two tokens: logits after the root [V], and after root + a [V, V]."""
    gen = torch.Generator().manual_seed(seed)
    first = torch.randn(VOCAB, generator=gen)
    first[1] += 1.2                                   # the draft child and the suffix child
    first[2] += 1.0                                   # are both likely
    second = torch.randn(VOCAB, VOCAB, generator=gen)
    second[1, 3] += 1.5                               # the suffix chain under 1 is likely too
    return first, second


def node_logits(tokens: list[int], parents: list[int], first, second) -> torch.Tensor:
    """Logits at every node: depth 0 -> first, depth 1 (token a) -> second[a], deeper: anything
    (they only decide the third and later tokens)."""
    rows = []
    for t, p in enumerate(parents):
        rows.append(first if p < 0 else second[tokens[t]] if parents[p] < 0 else torch.randn(VOCAB))
    return torch.stack(rows)


# (draft tree, suffix continuations): siblings from both sources at the root, and a 3-deep suffix
# chain merged into a draft branch (it follows 1, then leaves it: 3 is a sibling of draft child 2)
MIXED = {
    "sibling-sources": ([0, 1, 4], [-1, 0, 1], [[2, 3], [1, 5]]),
    "chain-in-branch": ([0, 1, 2, 4, 5], [-1, 0, 1, 0, 2], [[1, 3, 2], [4, 4, 4]]),
}


def sample_pairs(tree, logits, probs2, params, num: int, seed: int = 0):
    """Counts [V, V] of the first two emitted tokens (the second from the target's row when the
    step ended after one), and how many steps accepted a suffix-only node."""
    gen = torch.Generator().manual_seed(seed)
    counts, via_suffix = torch.zeros(VOCAB, VOCAB), 0
    for _ in range(num):
        acc = verify_sampled(logits, tree, params, gen)
        first = acc.tokens[0]
        if len(acc.tokens) > 1:
            second = acc.tokens[1]
        else:                                        # the next step's first token
            second = int(torch.multinomial(probs2[first], 1, generator=gen))
        counts[first, second] += 1
        via_suffix += any(tree.sources[t] == SUFFIX for t in acc.nodes[1:])
    return counts, via_suffix


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.8, top_p=0.9)], ids=["t1", "top_p"])
@pytest.mark.parametrize("name", list(MIXED))
def test_mixed_trees_are_lossless(name, params):
    tokens, parents, conts = MIXED[name]
    m = merge_suffix(tokens, parents, conts, budget=8)
    assert {SUFFIX, BOTH} <= set(m.sources)
    first, second = two_token_target(3)
    tree = build_tree(torch.tensor(m.tokens), torch.tensor(m.parents), 5, m.depth, m.sources)
    p1, p2 = target_probs(first, params).double(), target_probs(second, params).double()
    counts, via_suffix = sample_pairs(tree, node_logits(m.tokens, m.parents, first, second), p2,
                                      params, 6000)
    assert via_suffix > 600                                  # suffix nodes were really accepted
    assert chi_square_p(counts.sum(1), p1) > 0.01            # the first token
    assert chi_square_p(counts, p1[:, None] * p2) > 0.01     # the first two tokens, jointly


@pytest.mark.usefixtures("one_thread")
def test_repeated_siblings_would_not_be_lossless():
    """Why children must be distinct: the walk counts each child's target mass once per child,
    so a token proposed twice under one node is accepted with up to twice its probability."""
    first, second = two_token_target(3)
    tokens, parents = [0, 1, 1], [-1, 0, 0]                  # token 1 from both sources, unmerged
    tree = build_tree(torch.tensor(tokens), torch.tensor(parents), 5, 1, [0, DRAFT, SUFFIX])
    params = SamplingParams(temperature=1.0)
    p1, p2 = target_probs(first, params).double(), target_probs(second, params).double()
    counts, _ = sample_pairs(tree, node_logits(tokens, parents, first, second), p2, params, 3000)
    assert chi_square_p(counts.sum(1), p1) < 0.01
