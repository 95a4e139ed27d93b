"""sampling.sample_each: the rows of a batched decode step sampled together, each as alone."""
from __future__ import annotations

import pytest
import torch

from eagle3.sampling import SamplingParams, sample_each, sample_next

PARAMS = [SamplingParams(temperature=1.0, seed=1), SamplingParams(seed=9),      # greedy
          SamplingParams(temperature=1.0, seed=2), SamplingParams(temperature=0.7, top_k=40, seed=3),
          SamplingParams(temperature=1.0, seed=4), SamplingParams(temperature=0.7, top_k=40, seed=5),
          SamplingParams(temperature=0.9, top_p=0.8, seed=6), SamplingParams(temperature=1e-6, seed=8)]


def test_each_row_gets_the_token_it_gets_alone_and_its_generator_moves_as_alone():
    """Many draws of 8 rows (49152 wide, three rows in one group, greedy rows, top-k and top-p
    groups): every token equals sample_next on that row alone with a twin generator, and every
    generator ends in the same state as its twin."""
    g = torch.Generator().manual_seed(0)
    gens = [p.generator() for p in PARAMS]
    twins = [p.generator() for p in PARAMS]
    for _ in range(40):
        logits = torch.randn(len(PARAMS), 49152, generator=g) * 3
        got = sample_each(logits, PARAMS, gens)
        alone = [int(sample_next(logits[i], p, twins[i])) for i, p in enumerate(PARAMS)]
        assert got == alone
    assert all(torch.equal(a.get_state(), b.get_state()) for a, b in zip(gens, twins))


def test_a_count_mismatch_is_named():
    with pytest.raises(ValueError, match="3 rows, 2 params, 2 generators"):
        sample_each(torch.zeros(3, 5), PARAMS[:2], [torch.Generator()] * 2)
