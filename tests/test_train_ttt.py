from typing import NamedTuple

import torch

from eagle3.train.features import Sample, collate, target_features
from eagle3.train.tiny import tiny_draft, tiny_target
from eagle3.train.ttt import TTTConfig, TTTModel, align, shift_left
from eagle3.train.vocab import build_vocab, count_tokens


def make_samples(lengths=(11, 7, 9), seed=0):
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for n in lengths:
        ids = torch.randint(4, 96, (n,), generator=gen)
        mask = torch.zeros(n, dtype=torch.bool)
        mask[n // 3:] = True
        samples.append(Sample(ids, mask))
    return samples


def make_batch(target, lengths=(11, 7, 9), seed=0):
    samples = make_samples(lengths, seed)
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


class Terms(NamedTuple):
    step_loss: torch.Tensor    # [num_steps]
    correct: torch.Tensor      # [num_steps]
    counted: torch.Tensor      # [num_steps] loss-masked rows
    gated: torch.Tensor        # [num_steps] of those, rows whose target argmax is outside the draft vocab


@torch.no_grad()
def reference_terms(target, draft, used: torch.Tensor, samples, width: int, num_steps: int) -> Terms:
    """The TTT loss terms by their definition (ttt.py docstring), without ttt.py: one sample at a
    time through the target's and the draft's own serving forwards. Aligned row j of a sample of n
    tokens pairs feature j with token j+1 and learns the target after token j+1; it counts iff
    j < n-1 and token j is in the loss mask. Step k, row i reads aligned row j = i+k; its loss is
    CE(softmax over the draft vocab of the target logits after token j+1, draft logits at row i),
    kept iff the target's full-vocab argmax there is in the draft vocab; sum / (B * width)."""
    in_vocab = set(used.tolist())
    loss, correct, counted, gated = (torch.zeros(num_steps) for _ in range(4))
    for s in samples:
        n = len(s.ids)
        out = target(s.ids[None], torch.arange(n), target.new_cache(n),
                     capture_ids=target.config.default_aux_layer_ids)
        full = out.logits[0]                                       # [n, V]
        teacher = torch.softmax(full[:, used], dim=-1)             # [n, Vd]
        counts = [bool(s.loss_mask[j]) and j < n - 1 for j in range(n)]
        cache, h = draft.new_cache(num_steps * n), None
        for k in range(num_steps):
            ids = torch.tensor([int(s.ids[i + k + 1]) if i + k + 1 < n else 0 for i in range(n)])
            kw = {"features": out.aux} if k == 0 else {"hidden": h}
            step = draft(ids[None], torch.arange(n) + k, cache,
                         attn_mask=serving_step_mask(torch.ones(1, n, dtype=torch.bool), k), **kw)
            h = step.hidden
            for i in range(n - k):
                j = i + k
                if not counts[j]:
                    continue
                logits = step.logits[0, i]
                best = int(full[j + 1].argmax())
                if best in in_vocab:
                    loss[k] += -(teacher[j + 1] * torch.log_softmax(logits, -1)).sum()
                else:
                    gated[k] += 1
                correct[k] += int(used[logits.argmax()]) == best
                counted[k] += 1
    return Terms(loss / (len(samples) * width), correct, counted, gated)


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
    check_alignment(a, batch, make_samples())
    check_loss_terms(target, batch, make_samples())


def check_alignment(a, batch, samples):
    """Every aligned field against its definition, row by row (ttt.py docstring)."""
    for b, s in enumerate(samples):
        n, width = len(s.ids), batch.ids.shape[1]
        for j in range(width):
            nxt = j + 1 < n
            assert int(a.ids[b, j]) == (int(s.ids[j + 1]) if nxt else 0)
            want = batch.hidden[b, j + 1] if nxt else torch.zeros(batch.hidden.shape[-1])
            assert torch.equal(a.teacher_hidden[b, j], want)
            assert int(a.teacher_argmax[b, j]) == (int(batch.next_ids[b, j + 1]) if nxt else 0)
            assert bool(a.loss_mask[b, j]) == (j < n - 1 and bool(s.loss_mask[j]))
            assert torch.equal(a.aux[b, j], batch.aux[b, j])


def check_loss_terms(target, batch, samples):
    gen = torch.Generator().manual_seed(5)
    vocab = build_vocab(count_tokens([torch.randint(0, 96, (400,), generator=gen)], 96), 40)
    draft = tiny_draft(target, vocab)
    cfg = TTTConfig(num_steps=5, step_decay=0.7)
    stats = TTTModel(draft, target.lm_head.weight, cfg)(batch)
    ref = reference_terms(target, draft, vocab.used, samples, batch.ids.shape[1], cfg.num_steps)
    # the case exercises every term: each step has a loss, some rows are gated by the draft vocab
    assert ref.step_loss.min() > 0 and 0 < ref.gated[0] < ref.counted[0]
    torch.testing.assert_close(stats.step_loss, ref.step_loss, rtol=1e-4, atol=1e-6)
    weights = torch.tensor([cfg.step_decay ** k for k in range(cfg.num_steps)])
    torch.testing.assert_close(stats.loss, (weights * ref.step_loss).sum(), rtol=1e-4, atol=1e-6)
    assert stats.counted.tolist() == ref.counted.int().tolist()
    assert stats.correct.tolist() == ref.correct.int().tolist()


def test_feature_store_roundtrip_equals_online_features_and_teacher(tmp_path):
    from eagle3.train.features import FeatureSource, Sample
    from eagle3.train.store import FeatureStore, PartKey, build_part, target_fingerprint
    target = tiny_target()
    gen = torch.Generator().manual_seed(3)
    samples = [Sample(torch.randint(4, 96, (n,), generator=gen), torch.ones(n, dtype=torch.bool))
               for n in (5, 9, 7, 4, 6)]
    aux_ids = target.config.default_aux_layer_ids
    key = PartKey(target_fingerprint(target), tuple(aux_ids), "float32")
    build_part(target, samples[:3], key, tmp_path / "a", shard_size=2)
    part = build_part(target, samples, key, tmp_path / "a", shard_size=2)          # grows, resumes
    stored = FeatureSource(samples, aux_ids, store=FeatureStore([(part, 5)])).batch([4, 1, 2])
    online = FeatureSource(samples, aux_ids, target=target).batch([4, 1, 2])
    # equal up to fp32 rounding: the store batches conversations by length, online batches differ
    for a, b in zip(stored, online):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    head = target.lm_head.weight[:40]                  # the teacher the trainer computes from them
    torch.testing.assert_close(stored.hidden @ head.T, online.hidden @ head.T, rtol=1e-5, atol=1e-5)
    assert part.manifest["bytes_per_token"] == 4 * (3 * 32 + 32) + 4   # fp32 aux + hidden, int32 argmax
