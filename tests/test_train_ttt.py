import torch

from eagle3.train.features import Sample, collate, target_features
from eagle3.train.tiny import tiny_draft, tiny_target
from eagle3.train.ttt import TTTConfig, TTTModel, align, shift_left
from eagle3.train.vocab import build_vocab, count_tokens


def make_batch(target, lengths=(11, 7, 9), seed=0):
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for n in lengths:
        ids = torch.randint(4, 96, (n,), generator=gen)
        mask = torch.zeros(n, dtype=torch.bool)
        mask[n // 3:] = True
        samples.append(Sample(ids, mask))
    feats = target_features(target, samples, target.config.default_aux_layer_ids)
    return collate(samples, feats)


def serving_step_mask(valid, k):
    # [B, 1, T, (k+1)T]: causal (valid keys) over step 0, then only the same row for steps 1..k
    seq = valid.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()[None] & valid[:, None, :]
    eye = torch.eye(seq, dtype=torch.bool)[None].expand(valid.shape[0], seq, seq)
    return torch.cat([causal] + [eye] * k, dim=-1)[:, None]


def test_ttt_attention_equals_naive_step_by_step():
    target = tiny_target()
    vocab = build_vocab(count_tokens([torch.arange(96)], 96), 64)
    draft = tiny_draft(target, vocab)
    model = TTTModel(draft, target.lm_head.weight, TTTConfig(num_steps=4))
    a = align(make_batch(target))
    outs = model.unroll(a)
    bsz, seq = a.ids.shape
    cache = draft.new_cache(4 * seq, bsz)
    h = None
    with torch.no_grad():
        for k in range(4):
            pos = torch.arange(seq) + k
            kw = {"features": a.aux} if k == 0 else {"hidden": h}
            h = draft(shift_left(a.ids, k), pos, cache, attn_mask=serving_step_mask(a.valid, k), **kw).hidden
            real = a.valid
            torch.testing.assert_close(outs[k][real], h[real], rtol=1e-4, atol=1e-5)


def test_alignment_and_loss_terms():
    target = tiny_target()
    batch = make_batch(target)
    a = align(batch)
    assert a.ids[0, :10].tolist() == batch.ids[0, 1:11].tolist() and a.ids[0, 10] == 0
    assert a.loss_mask[1, 6] == False and a.loss_mask[1, 5] == True     # last row of sample 1 zeroed
    assert torch.equal(a.teacher_hidden[2, :8], batch.hidden[2, 1:9])
    draft = tiny_draft(target, build_vocab(count_tokens([torch.arange(96)], 96), 96))
    stats = TTTModel(draft, target.lm_head.weight)(batch)
    assert stats.step_loss.shape == (7,) and torch.isfinite(stats.loss)
    assert stats.counted[0] == int(a.loss_mask.sum())
    assert stats.counted[6] == int(shift_left(a.loss_mask, 6).sum())


def test_feature_cache_roundtrip(tmp_path):
    from eagle3.train.features import FeatureCache, FeatureSource, Sample, build_cache
    target = tiny_target()
    gen = torch.Generator().manual_seed(3)
    samples = [Sample(torch.randint(4, 96, (n,), generator=gen), torch.ones(n, dtype=torch.bool))
               for n in (5, 9, 7, 4, 6)]
    aux_ids = target.config.default_aux_layer_ids
    cache = build_cache(target, samples[:3], aux_ids, tmp_path, shard_size=2, dtype=torch.float32)
    cache = build_cache(target, samples, aux_ids, tmp_path, shard_size=2, dtype=torch.float32)  # grows
    assert FeatureCache.complete(tmp_path, aux_ids, 5)
    cached = FeatureSource(samples, aux_ids, cache=cache).batch([4, 1, 2])
    online = FeatureSource(samples, aux_ids, target=target).batch([4, 1, 2])
    for a, b in zip(cached, online):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
