"""Greedy and sampled acceptance on hand-made trees (no model)."""
from __future__ import annotations

import pytest
import torch

from eagle3.sampling import SamplingParams, target_probs
from eagle3.speculative.tree import build_tree
from eagle3.speculative.verify import verify_greedy, verify_sampled
from spec_helpers import chi_square_p, hf_probs

pytestmark = pytest.mark.usefixtures("one_thread")

#        0 (root, token 7)
#      1 (tok 1)    2 (tok 2)
#      3 (tok 3)    5 (tok 1)
#      4 (tok 0)
PARENTS = torch.tensor([-1, 0, 0, 1, 3, 2])
TOKENS = torch.tensor([7, 1, 2, 3, 0, 1])
VOCAB = 8


def hand_tree():
    return build_tree(TOKENS, PARENTS, prefix_len=4, max_depth=3)


def argmax_logits(preds: list[int]) -> torch.Tensor:
    logits = torch.randn(len(preds), VOCAB, generator=torch.Generator().manual_seed(0))
    logits[torch.arange(len(preds)), torch.tensor(preds)] = 10.0
    return logits


def test_greedy_accepts_longest_matching_path_and_bonus():
    # target: after root -> 1, after node1 -> 3, after node3 -> 5 (node 4 holds 0: rejected)
    acc = verify_greedy(argmax_logits([1, 3, 4, 5, 6, 6]), hand_tree())
    assert acc.nodes == [0, 1, 3] and acc.tokens == [1, 3, 5] and acc.accept_len == 2


def test_greedy_full_path_bonus_from_leaf():
    acc = verify_greedy(argmax_logits([2, 0, 1, 0, 0, 6]), hand_tree())
    assert acc.nodes == [0, 2, 5] and acc.tokens == [2, 1, 6]
    acc = verify_greedy(argmax_logits([1, 3, 0, 0, 4, 0]), hand_tree())
    assert acc.nodes == [0, 1, 3, 4] and acc.tokens == [1, 3, 0, 4]


def test_greedy_nothing_accepted():
    acc = verify_greedy(argmax_logits([5, 0, 0, 0, 0, 0]), hand_tree())
    assert acc.nodes == [0] and acc.tokens == [5] and acc.accept_len == 0


def test_sampled_accepts_certain_children_and_never_emits_zero_probability():
    probs = torch.full((6, VOCAB), 1e-9)
    probs[0, 1] = probs[1, 3] = probs[3, 0] = probs[4, 6] = 1.0      # path 0-1-3-4, bonus 6
    logits = probs.log()
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        acc = verify_sampled(logits, hand_tree(), SamplingParams(temperature=1.0, top_k=1), gen)
        assert acc.nodes == [0, 1, 3, 4] and acc.tokens == [1, 3, 0, 6]


def sampled_counts(logits, params, num: int, seed: int = 0):
    """Counts of the first emitted token, and of the second one given each accepted first child."""
    tree, gen = hand_tree(), torch.Generator().manual_seed(seed)
    first = torch.zeros(VOCAB)
    second = {1: torch.zeros(VOCAB), 2: torch.zeros(VOCAB)}       # keyed by node of first token
    for _ in range(num):
        acc = verify_sampled(logits, tree, params, gen)
        first[acc.tokens[0]] += 1
        if len(acc.nodes) > 1:
            second[acc.nodes[1]][acc.tokens[1]] += 1
    return first, second


def check_lossless(logits, params, num: int = 6000):
    probs = hf_probs(logits, params)                             # transformers' warpers: independent
    first, second = sampled_counts(logits, params, num)
    assert chi_square_p(first, probs[0]) > 0.01
    for node, counts in second.items():                          # token 1 -> node 1, 2 -> node 2
        assert counts.sum() > 200, "the test tree must accept each first-level child often"
        assert chi_square_p(counts, probs[node]) > 0.01


def skewed_logits(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, VOCAB, generator=gen)
    logits[0, 1] += 1.5                                           # children of the root likely
    logits[0, 2] += 1.0
    logits[1, 3] += 1.0
    return logits


def test_sampled_is_lossless_at_temperature_one():
    check_lossless(skewed_logits(1), SamplingParams(temperature=1.0))


def test_sampled_is_lossless_with_top_p_top_k_and_temperature():
    check_lossless(skewed_logits(2), SamplingParams(temperature=1.5, top_p=0.8))
    check_lossless(skewed_logits(3), SamplingParams(temperature=1.3, top_k=4))


def permuted_rows(values: list[float], rows: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    base = torch.tensor(values)
    return torch.stack([base[torch.randperm(len(values), generator=gen)] for _ in range(rows)])


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.9), SamplingParams(temperature=0.8, top_k=40, top_p=0.6),
    SamplingParams(temperature=2.0, top_k=999), SamplingParams(temperature=0.5, top_p=0.999)])
def test_target_probs_equal_transformers_warpers(params):
    gen = torch.Generator().manual_seed(11)
    for scale in (0.5, 3.0, 10.0):
        logits = scale * torch.randn(4, 1000, generator=gen)
        ours, ref = target_probs(logits, params), hf_probs(logits, params)
        assert torch.equal(ours == 0, ref == 0) and torch.allclose(ours, ref, atol=1e-6, rtol=1e-5)


def test_target_probs_equal_transformers_warpers_on_ties():
    # top-k keeps every token tied with the k-th; top-p cuts between tied groups here
    # (sorted masses .3 .3 .15 .15 .05 .05: the mass before each is 0 .3 .6 .75 .9 .95)
    tied_k = torch.randint(0, 4, (6, 40), generator=torch.Generator().manual_seed(2)).float()
    masses = permuted_rows([0.3, 0.3, 0.15, 0.15, 0.05, 0.05], 6, seed=3).log()
    for logits, params in [(tied_k, SamplingParams(temperature=1.0, top_k=7)),
                           (tied_k, SamplingParams(temperature=0.6, top_k=1)),
                           (masses, SamplingParams(temperature=1.0, top_p=0.8)),
                           (masses, SamplingParams(temperature=1.0, top_k=3, top_p=0.5))]:
        ours, ref = target_probs(logits, params), hf_probs(logits, params)
        assert torch.equal(ours == 0, ref == 0) and torch.allclose(ours, ref, atol=1e-6)
    assert (target_probs(tied_k, SamplingParams(temperature=1.0, top_k=7)) > 0).sum(-1).min() > 7


def test_chi_square_detects_a_lossy_rule():
    # guard against a test that cannot fail: sampling from the draft's choice skews the counts
    logits = skewed_logits(1)
    probs = target_probs(logits, SamplingParams(temperature=1.0))
    biased = probs[0].clone()
    biased[1] += 0.1
    counts = torch.bincount(torch.multinomial(biased / biased.sum(), 6000, replacement=True,
                                              generator=torch.Generator().manual_seed(0)),
                            minlength=VOCAB)
    assert chi_square_p(counts, probs[0]) < 0.01


def test_sample_rows_follows_the_weights_and_skips_zeros():
    from eagle3.sampling import sample_rows
    weights = torch.tensor([[0.0, 1.0, 0.0, 3.0, 6.0, 0.0], [5.0, 0.0, 0.0, 0.0, 0.0, 5.0]])
    draws = sample_rows(weights.repeat(3000, 1), torch.Generator().manual_seed(0)).view(3000, 2)
    for row in range(2):
        counts = torch.bincount(draws[:, row], minlength=6)
        assert chi_square_p(counts, weights[row]) > 0.01      # zero-weight ids: asserted unseen


def test_sample_rows_maps_a_draw_at_the_total_to_the_last_nonzero_weight(monkeypatch):
    from eagle3 import sampling
    weights = torch.tensor([[0.0, 2.0, 0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    monkeypatch.setattr(sampling.torch, "rand", lambda *a, **k: torch.ones(2, 1, dtype=torch.float64))
    assert sampling.sample_rows(weights, torch.Generator()).tolist() == [3, 0]


def test_plain_sampling_follows_the_processed_distribution():
    from eagle3.sampling import SamplingParams, sample_next
    logits = torch.randn(40, generator=torch.Generator().manual_seed(4)) * 2
    params = SamplingParams(temperature=0.8, top_k=12, top_p=0.9)
    gen = torch.Generator().manual_seed(5)
    draws = sample_next(logits.repeat(4000, 1), params, gen)
    probs = hf_probs(logits[None], params)[0]
    counts = torch.bincount(draws, minlength=40)
    assert counts[probs == 0].sum() == 0 and chi_square_p(counts, probs) > 0.01


def test_sampling_names_weights_without_mass():
    from eagle3.sampling import sample_rows
    for bad in (torch.zeros(1, 5), torch.tensor([[1.0, float("nan"), 0.0]])):
        with pytest.raises(RuntimeError, match="no finite positive mass"):
            sample_rows(bad, torch.Generator().manual_seed(0))
