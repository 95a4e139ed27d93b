import torch
import pytest

from eagle3.errors import ContractError
from eagle3.train.vocab import build_vocab, count_tokens, coverage


def test_d2t_t2d_sorted_offsets_mask():
    seqs = [torch.tensor([7, 7, 7, 2, 9, 9]), torch.tensor([9, 5, 5, 0])]
    counts = count_tokens(seqs, 12)                 # 9:3, 7:3, 5:2, 2:1, 0:1
    v = build_vocab(counts, 4)
    assert v.used.tolist() == [0, 5, 7, 9]           # top-4 (tie 0 vs 2 -> lower id 0), ascending
    assert v.d2t.tolist() == [0, 4, 5, 6]
    assert (torch.arange(4) + v.d2t).tolist() == v.used.tolist()
    assert v.t2d.nonzero()[:, 0].tolist() == [0, 5, 7, 9]
    assert v.t2d.dtype == torch.bool and v.t2d.shape == (12,)


def test_identity_when_full_vocab():
    counts = count_tokens([torch.randint(0, 50, (200,))], 50)
    v = build_vocab(counts, 50)
    assert v.d2t.eq(0).all() and v.t2d.all() and v.used.tolist() == list(range(50))


def test_bad_size_and_coverage():
    counts = torch.tensor([5, 0, 3, 2])
    with pytest.raises(ContractError):
        build_vocab(counts, 5)
    cov = coverage(counts, [1, 2, 4])
    assert cov == {1: 0.5, 2: 0.8, 4: 1.0}
