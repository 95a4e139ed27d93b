"""Dynamic tree construction: spec validation, expansion, pruning, mask/positions/paths."""
from __future__ import annotations

import math

import pytest
import torch

from eagle3.errors import InputError
from eagle3.speculative.tree import (SpecParams, build_tree, concat_levels, expand, root_frontier,
                              select_nodes)


def brute_ancestors(parents: list[int], t: int) -> list[int]:
    path = [t]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def random_parents(size: int, gen: torch.Generator) -> list[int]:
    return [-1] + [int(torch.randint(0, t, (1,), generator=gen)) for t in range(1, size)]


# ---------------------------------------------------------------------------- SpecParams
def test_spec_params_validation():
    assert SpecParams.chain(5) == SpecParams(1, 5, 6, 0.0) and SpecParams.chain(5).is_chain
    assert SpecParams(10, 7, 60).max_candidates == 10 + 6 * 100
    with pytest.raises(InputError, match="lower num_draft_tokens"):
        SpecParams(1, 3, 5)                       # a chain of 3 has only 3 candidates
    with pytest.raises(InputError):
        SpecParams(2, 2, 8)                       # 2 + 4 = 6 candidates < 7
    SpecParams(2, 2, 7)
    for bad in (dict(top_k=0), dict(depth=0), dict(num_draft_tokens=1)):
        with pytest.raises(InputError):
            SpecParams(**{**dict(top_k=2, depth=2, num_draft_tokens=3), **bad})
    assert SpecParams(4, 6, 8).cache_slack == 5 * 4 + 1   # tree rows exceed the verify block


# ---------------------------------------------------------------------------- expand
def test_expand_scores_are_cumulative_and_frontier_is_global_top_k():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2, 0.0]]))
    front, level = expand(root_frontier(), logits, 2, offset=0)
    assert level.tokens.tolist() == [0, 1] and level.parents.tolist() == [-1, -1]
    assert torch.allclose(level.scores, torch.log(torch.tensor([0.5, 0.3])))
    # second level: node 0 (p .5) has children .9/.1; node 1 (p .3) has children .6/.4
    logits2 = torch.log(torch.tensor([[0.9, 0.1, 0.0, 0.0], [0.0, 0.0, 0.6, 0.4]]))
    front2, level2 = expand(front, logits2, 2, offset=2)
    want = torch.log(torch.tensor([0.45, 0.05, 0.18, 0.12]))
    assert torch.allclose(level2.scores, want)
    assert level2.tokens.tolist() == [0, 1, 2, 3] and level2.parents.tolist() == [0, 0, 1, 1]
    assert front2.cand_idx.tolist() == [2 + 0, 2 + 2]     # global top 2: .45 and .18
    assert front2.rows.tolist() == [0, 1] and front2.tokens.tolist() == [0, 2]


# ---------------------------------------------------------------------------- select
def test_select_keeps_best_in_candidate_order_with_parents_mapped():
    scores = torch.tensor([-0.1, -1.0, -0.3, -2.0, -0.5, -3.0])
    parents = torch.tensor([-1, -1, 0, 0, 2, 1])
    level = concat_levels([(scores[:2], torch.arange(2), parents[:2]),
                           (scores[2:], torch.arange(2, 6), parents[2:])])
    sel = select_nodes(level, 5)                  # keep 4 best: cands 0, 2, 4, 1
    assert sel.cand_idx.tolist() == [0, 1, 2, 4]
    assert sel.parents.tolist() == [-1, 0, 0, 1, 3]


def test_select_with_min_prob_keeps_only_likely_paths():
    scores = torch.tensor([-0.1, -1.0, -0.3, -2.0, -0.5, -3.0])
    parents = torch.tensor([-1, -1, 0, 0, 2, 1])
    level = concat_levels([(scores, torch.arange(6), parents)])
    assert select_nodes(level, 5, math.log(0.55)).cand_idx.tolist() == [0, 2, 4]   # p .90 .74 .61
    assert select_nodes(level, 3, math.log(0.55)).cand_idx.tolist() == [0, 2]      # the cap still holds
    assert select_nodes(level, 5, math.log(0.95)).cand_idx.tolist() == [0]         # never empty
    assert select_nodes(level, 5, -math.inf).cand_idx.tolist() == [0, 1, 2, 4]
    assert SpecParams(min_prob=0.05).min_score == pytest.approx(math.log(0.05))
    with pytest.raises(InputError, match="min_prob"):
        SpecParams(min_prob=1.0)


def test_select_is_parent_closed_under_ties():
    # log-prob 0 children tie with their parents: the lower index (the parent) must win
    scores = torch.tensor([0.0, -5.0, 0.0, 0.0, 0.0, 0.0])
    parents = torch.tensor([-1, -1, 0, 0, 2, 3])
    sel = select_nodes(concat_levels([(scores, torch.arange(6), parents)]), 3)
    assert sel.cand_idx.tolist() == [0, 2]
    assert sel.parents.tolist() == [-1, 0, 1]


@pytest.mark.parametrize("spec", [SpecParams.chain(4), SpecParams(2, 3, 6, 0.0), SpecParams(3, 4, 12, 0.0),
                                  SpecParams(4, 5, 30, 0.0), SpecParams(3, 1, 4, 0.0)])
def test_full_drafting_matches_a_plain_python_reference(spec):
    gen = torch.Generator().manual_seed(spec.max_candidates)
    vocab = 12
    per_level = [torch.randn(1 if d == 0 else spec.top_k, vocab, generator=gen) * 2
                 for d in range(spec.depth)]
    front, levels = root_frontier(), []
    for d, logits in enumerate(per_level):
        front, level = expand(front, logits, spec.top_k, sum(lv.scores.numel() for lv in levels))
        levels.append(level)
    sel = select_nodes(concat_levels(levels), spec.num_draft_tokens)
    ref_tokens, ref_parents = reference_tree(per_level, spec)
    cands = concat_levels(levels)
    assert cands.tokens[sel.cand_idx].tolist() == ref_tokens
    assert sel.parents.tolist() == ref_parents


def reference_tree(per_level: list[torch.Tensor], spec: SpecParams):
    """EAGLE-2 drafting written as plain loops over (score, token, parent) candidates."""
    cands: list[tuple[float, int, int]] = []          # (score, token, parent candidate)
    frontier = [(0.0, -1)]                           # (score, candidate index)
    for logits in per_level:
        logp = torch.log_softmax(logits.double(), dim=-1)
        new = []
        for row, (score, idx) in enumerate(frontier):
            top = torch.topk(logp[row], spec.top_k)
            for lp, tok in zip(top.values.tolist(), top.indices.tolist()):
                new.append((score + lp, tok, idx))
        base = len(cands)
        cands.extend(new)
        best = sorted(range(len(new)), key=lambda i: -new[i][0])[:spec.top_k]
        frontier = [(new[i][0], base + i) for i in best]
    kept = sorted(sorted(range(len(cands)), key=lambda i: -cands[i][0])[:spec.num_draft_tokens - 1])
    where = {c: t + 1 for t, c in enumerate(kept)}
    parents = [-1] + [0 if cands[c][2] < 0 else where[cands[c][2]] for c in kept]
    return [cands[c][1] for c in kept], parents


# ---------------------------------------------------------------------------- layout
def leaf_paths(tree) -> list[list[int]]:
    """Root-to-leaf index lists, from the tree's paths and leaf flags."""
    return [[t for t in row if t >= 0] for row in tree.paths[tree.is_leaf].tolist()]


def test_hand_made_tree_layout():
    #        0
    #      1   2
    #      3   5
    #      4
    parents = torch.tensor([-1, 0, 0, 1, 3, 2])
    tree = build_tree(torch.arange(10, 16), parents, prefix_len=7, max_depth=3)
    assert tree.depth.tolist() == [0, 1, 1, 2, 3, 2]
    assert tree.positions.tolist() == [7, 8, 8, 9, 10, 9]
    assert leaf_paths(tree) == [[0, 1, 3, 4], [0, 2, 5]]
    assert tree.is_leaf.tolist() == [False, False, False, False, True, True]
    assert tree.mask[4].tolist() == [True, True, False, True, True, False]
    assert tree.mask[5].tolist() == [True, False, True, False, False, True]


@pytest.mark.parametrize("size", [2, 5, 17, 40])
def test_random_trees_mask_is_ancestry_positions_are_depth_paths_are_root_to_leaf(size):
    gen = torch.Generator().manual_seed(size)
    for _ in range(5):
        parents = random_parents(size, gen)
        paths = [brute_ancestors(parents, t) for t in range(size)]
        max_depth = max(len(p) for p in paths) - 1
        tree = build_tree(torch.arange(size), torch.tensor(parents), 100, max_depth)
        for t, path in enumerate(paths):
            assert tree.mask[t].nonzero().flatten().tolist() == path       # ancestors + self
            assert int(tree.positions[t]) == 100 + len(path) - 1
            assert [i for i in tree.paths[t].tolist() if i >= 0] == path
        leaves = [t for t in range(size) if t not in parents]
        assert leaf_paths(tree) == [paths[t] for t in leaves]
