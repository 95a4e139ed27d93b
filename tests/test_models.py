"""Native models vs HF transformers, feature capture, static cache semantics (tiny random models)."""
from __future__ import annotations

import pytest
import torch

from eagle3.errors import ContractError, UnsupportedError
from eagle3.models import ModelConfig
from eagle3.models.layers import tree_block_mask

from eagle3.testing import FAMILIES, hf_model_from_dict, native_from_hf


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request, tmp_path_factory):
    hf = hf_model_from_dict(FAMILIES[request.param])
    return hf, native_from_hf(hf, tmp_path_factory.mktemp(request.param))


def test_logits_match_hf(pair):
    hf, ours = pair
    ids = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
    out = ours(ids, torch.arange(40), ours.new_cache(64, batch=2), capture_ids=(0, 1, 3))
    assert (out.logits - ref.logits).abs().max() <= 1e-4
    want = torch.cat([ref.hidden_states[i] for i in (0, 1, 3)], dim=-1)
    assert torch.allclose(out.aux, want, atol=1e-5)


def test_incremental_equals_full(pair):
    _, ours = pair
    ids = torch.randint(0, 96, (1, 30), generator=torch.Generator().manual_seed(2))
    full = ours(ids, torch.arange(30), ours.new_cache(64)).logits
    cache = ours.new_cache(64)
    parts = [ours(ids[:, :17], torch.arange(17), cache).logits]
    for t in range(17, 30):
        parts.append(ours(ids[:, t:t + 1], torch.tensor([t]), cache).logits)
    assert torch.allclose(torch.cat(parts, dim=1), full, atol=1e-5)


def test_keep_subset_equals_cache_that_saw_only_subset(pair):
    _, ours = pair
    gen = torch.Generator().manual_seed(3)
    prefix = torch.randint(0, 96, (1, 12), generator=gen)
    block = torch.randint(0, 96, (1, 6), generator=gen)
    kept = torch.tensor([0, 2, 3])
    # a tree block: node 0 root, 1 and 2 children of 0, 3 child of 2, 4, 5 children of 1
    parents = [-1, 0, 0, 2, 1, 1]
    mask = torch.eye(6, dtype=torch.bool)
    for i, p in enumerate(parents):
        while p >= 0:
            mask[i, p], p = True, parents[p]
    depth = mask.sum(1) - 1
    cache = ours.new_cache(64)
    ours(prefix, torch.arange(12), cache)
    ours(block, 12 + depth, cache, attn_mask=tree_block_mask(12, mask))
    cache.keep(12, kept)
    nxt = torch.tensor([[5]])
    got = ours(nxt, torch.tensor([15]), cache).logits
    ref_cache = ours.new_cache(64)
    ours(torch.cat([prefix, block[:, kept]], dim=1), torch.arange(15), ref_cache)
    want = ours(nxt, torch.tensor([15]), ref_cache).logits
    assert cache.length == ref_cache.length == 16
    assert torch.allclose(got, want, atol=1e-5)


def test_logits_rows_selects_rows(pair):
    _, ours = pair
    ids = torch.randint(0, 96, (1, 10), generator=torch.Generator().manual_seed(4))
    full = ours(ids, torch.arange(10), ours.new_cache(16)).logits
    rows = torch.tensor([3, 9])
    part = ours(ids, torch.arange(10), ours.new_cache(16), logits_rows=rows).logits
    assert torch.allclose(part, full[:, rows], atol=1e-6)


def test_unknown_architecture_names_it():
    cfg = dict(FAMILIES["llama3"], architectures=["GPTNeoXForCausalLM"])
    with pytest.raises(UnsupportedError, match="GPTNeoXForCausalLM.*supported"):
        ModelConfig.from_hf(cfg)


def test_capture_ids_checked(pair):
    _, ours = pair
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ContractError, match="aux_layer_ids"):
        ours(ids, torch.arange(3), ours.new_cache(8), capture_ids=(1, 9))
    with pytest.raises(ContractError, match="ascending"):
        ours(ids, torch.arange(3), ours.new_cache(8), capture_ids=(2, 1))


def test_default_capture_ids():
    cfg = ModelConfig.from_hf(dict(FAMILIES["llama3"], num_hidden_layers=30))
    assert cfg.default_aux_layer_ids == (2, 15, 27)


@pytest.mark.lossless
def test_packed_model_matches_unpacked(pair):
    import copy

    from eagle3.runtime.target import build_target
    _, ours = pair
    packed = build_target(copy.deepcopy(ours))
    ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(5))
    for model in (ours, packed):
        cache = model.new_cache(32)
        full = model(ids, torch.arange(12), cache, capture_ids=(1, 2))
        one = model(ids[:, :1], torch.tensor([12]), cache)
        if model is ours:
            ref_full, ref_one = full, one
    assert torch.allclose(full.logits, ref_full.logits, atol=1e-5)
    assert torch.allclose(full.aux, ref_full.aux, atol=1e-5)
    assert torch.allclose(one.logits, ref_one.logits, atol=1e-5)


def test_top_p_filter_head_equals_full_sort():
    from transformers.generation.logits_process import TopPLogitsWarper
    from eagle3.sampling import top_p_filter
    gen = torch.Generator().manual_seed(0)
    for scale in (0.5, 3.0, 10.0):           # flat (fallback) to peaked (head path)
        logits = scale * torch.randn(4, 1000, generator=gen)
        probs = torch.softmax(logits, dim=-1)
        for top_p in (0.3, 0.9, 0.99):
            fast = top_p_filter(probs, top_p, head=16)
            full = top_p_filter(probs, top_p, head=1000)
            assert torch.allclose(fast, full, atol=1e-7)
            ref = torch.softmax(TopPLogitsWarper(top_p)(None, logits), dim=-1)   # transformers'
            assert torch.equal(fast == 0, ref == 0) and torch.allclose(fast, ref, atol=1e-6)
