"""The TTT objectives (eagle3/train/objectives.py): hand-computed values on tiny distributions, finite
losses with gradients on a tiny draft, GRIFFIN's mask against its definition, and the config's check."""
import math
import re
from dataclasses import replace

import pytest
import torch

from eagle3.errors import InputError
from eagle3.train.config import TrainConfig, parse_override
from eagle3.train.dryrun import synthetic_samples
from eagle3.train.objectives import (OBJECTIVES, ObjectiveConfig, aligned, kl, lk_loss, overlap, row_loss,
                                     soft_ce, topk_ce)
from eagle3.train.pipeline import train
from eagle3.train.tiny import tiny_draft, tiny_target
from eagle3.train.ttt import TTTConfig, TTTModel, align

from test_train_recipes import BASE, trained
from test_train_ttt import make_batch


@pytest.fixture(scope="module")
def target():
    torch.set_num_threads(1)
    return tiny_target()


def logs(*rows):
    return torch.tensor(rows, dtype=torch.float64).log()


# ---------------------------------------------------------------------------- hand-computed cases
def test_overlap_is_the_acceptance_rate():
    p, q = logs([0.75, 0.25, 0.0]), logs([0.5, 0.25, 0.25])
    assert overlap(p, q).item() == pytest.approx(0.5 + 0.25)   # min per token
    assert overlap(logs([1.0, 0.0]), logs([0.0, 1.0])).item() == 0.0
    assert overlap(q, q).item() == pytest.approx(1.0)


def test_lk_loss_by_hand_and_its_minimum_at_identical_distributions():
    p, q = logs([0.75, 0.25]), logs([0.5, 0.5])
    alpha = 0.5 + 0.25
    kl_pq = 0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5)
    lam = math.exp(-3.0 * alpha)
    one = torch.ones(1, dtype=torch.float64)
    assert lk_loss(p, q, one, 3.0).item() == pytest.approx(lam * kl_pq + (1 - lam) * (1 - alpha))
    assert lk_loss(p, p, one, 3.0).item() == pytest.approx(0.0, abs=1e-12)
    # the minimum, by value (TV has a kink at q = p): zero there, positive at any other q
    for shift in (0.3, -0.7, 2.0, 1e-3):
        other = torch.log_softmax(p + torch.tensor([[shift, 0.0]], dtype=torch.float64), -1)
        assert lk_loss(p, other, one, 3.0).item() > 1e-6


def test_lk_blend_weight_follows_the_mean_overlap_of_the_counted_rows():
    p = logs([0.75, 0.25], [0.9, 0.1])
    q = logs([0.5, 0.5], [0.2, 0.8])                  # overlaps 0.75 and 0.3
    only_first = lk_loss(p, q, torch.tensor([1.0, 0.0], dtype=torch.float64), 3.0)
    lam = math.exp(-3.0 * 0.75)                       # the second row does not count in the mean
    assert only_first[1].item() == pytest.approx(lam * kl(p, q)[1].item() + (1 - lam) * (1 - 0.3))
    both = lk_loss(p, q, torch.ones(2, dtype=torch.float64), 3.0)
    lam = math.exp(-3.0 * (0.75 + 0.3) / 2)
    assert both[1].item() == pytest.approx(lam * kl(p, q)[1].item() + (1 - lam) * (1 - 0.3))
    assert lk_loss(p, q, torch.ones(2, dtype=torch.float64), 0.0).tolist() == pytest.approx(kl(p, q).tolist())


def test_lk_blend_weight_is_a_constant_for_the_gradient():
    p = logs([0.75, 0.25], [0.9, 0.1])
    logits = logs([0.5, 0.5], [0.2, 0.8]).requires_grad_(True)
    one = torch.ones(2, dtype=torch.float64)
    lk_loss(p, torch.log_softmax(logits, -1), one, 3.0).sum().backward()
    got, logits.grad = logits.grad, None
    q = torch.log_softmax(logits, -1)
    lam = math.exp(-3.0 * overlap(p, q).mean().item())
    (lam * kl(p, q) + (1 - lam) * (1 - overlap(p, q))).sum().backward()
    torch.testing.assert_close(got, logits.grad)


def test_kl_is_the_soft_cross_entropy_less_the_entropy():
    p, q = logs([0.75, 0.25]), logs([0.5, 0.5])
    assert soft_ce(p, q).item() == pytest.approx(-math.log(0.5))
    assert kl(p, q).item() == pytest.approx(-math.log(0.5) + 0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    assert kl(p, p).item() == pytest.approx(0.0, abs=1e-12)


def test_hass_top_k_term_by_hand():
    p, q = logs([0.6, 0.3, 0.1]), logs([0.2, 0.5, 0.3])
    assert topk_ce(p, q, 1).item() == pytest.approx(-0.6 * math.log(0.2))
    assert topk_ce(p, q, 2).item() == pytest.approx(-0.6 * math.log(0.2) - 0.3 * math.log(0.5))
    assert topk_ce(p, q, 10).item() == pytest.approx(soft_ce(p, q).item())   # k >= Vd: all of it
    cfg = ObjectiveConfig("hass", hass_topk=1, hass_weight=0.5)
    w = torch.ones(1, dtype=torch.float64)
    assert row_loss(cfg, p, q, w).item() == pytest.approx(soft_ce(p, q).item() - 0.5 * 0.6 * math.log(0.2))


def test_griffin_alignment_is_top_k_membership_of_the_fed_token():
    q = logs([0.5, 0.3, 0.2], [0.1, 0.2, 0.7])
    to_target = lambda ids: ids + 10                   # draft id d is target id d + 10
    fed = torch.tensor([11, 10])
    assert aligned(q, to_target, fed, 1).tolist() == [False, False]
    assert aligned(q, to_target, fed, 2).tolist() == [True, False]
    assert aligned(q, to_target, fed, 3).tolist() == [True, True]


# ---------------------------------------------------------------------------- on a tiny draft
@pytest.mark.parametrize("name", OBJECTIVES)
def test_each_objective_is_finite_and_trains_every_draft_weight(target, name):
    draft = tiny_draft(target)
    model = TTTModel(draft, target.lm_head.weight, TTTConfig(num_steps=3, objective=ObjectiveConfig(name)))
    stats = model(make_batch(target))
    assert torch.isfinite(stats.loss) and stats.loss > 0 and torch.isfinite(stats.step_loss).all()
    stats.loss.backward()
    for key, p in draft.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, key


def test_objectives_score_the_same_accuracy(target):
    batch, draft = make_batch(target), tiny_draft(target)
    ref = TTTModel(draft, target.lm_head.weight, TTTConfig(num_steps=3))(batch)
    for name in OBJECTIVES:
        stats = TTTModel(draft, target.lm_head.weight, TTTConfig(num_steps=3, objective=ObjectiveConfig(name)))(batch)
        assert torch.equal(stats.correct, ref.correct) and torch.equal(stats.counted, ref.counted)


@torch.no_grad()
def griffin_reference(model: TTTModel, batch, k_top: int) -> torch.Tensor:
    """Per-step griffin losses by the definition: row i counts at step k (pmask at i+k) only if every
    step j < k that scored row i had ids[i+j+1] among its top-k draft tokens (as target ids)."""
    a, draft = align(batch), model.draft
    teacher = torch.log_softmax(a.teacher_hidden @ model.teacher_head.T, dim=-1)
    pmask = draft.t2d[a.teacher_argmax] & a.loss_mask
    outs, (bsz, seq) = model.unroll(a), a.ids.shape
    losses = torch.zeros(len(outs))
    for b in range(bsz):
        for i in range(seq):
            ok = True
            for k, h in enumerate(outs):
                if i + k >= seq or not a.loss_mask[b, i + k]:
                    continue
                q = torch.log_softmax(draft.lm_head(draft.norm(h[b, i])).float(), -1)
                if ok and pmask[b, i + k]:
                    losses[k] += -(teacher[b, i + k].exp() * q).sum()
                top = draft.to_target_ids(q.topk(k_top).indices)
                nxt = a.ids[b, i + k + 1] if i + k + 1 < seq else -1
                ok = ok and bool((top == nxt).any())
    return losses / a.ids.numel()


@pytest.mark.parametrize("k_top", [1, 4])
def test_griffin_drops_rows_after_a_misaligned_step_as_defined(target, k_top):
    draft, batch = tiny_draft(target), make_batch(target)
    model = TTTModel(draft, target.lm_head.weight,
                     TTTConfig(num_steps=3, objective=ObjectiveConfig("griffin", griffin_topk=k_top)))
    plain = TTTModel(draft, target.lm_head.weight, TTTConfig(num_steps=3))
    got, kl_steps = model(batch).step_loss, plain(batch).step_loss
    torch.testing.assert_close(got, griffin_reference(model, batch, k_top), rtol=1e-4, atol=1e-6)
    assert got[0] == kl_steps[0] and (got[1:] < kl_steps[1:]).all()   # a random draft misses often


def test_griffin_with_every_token_in_the_top_k_is_the_plain_loss(target):
    draft, batch = tiny_draft(target), make_batch(target)
    vd = draft.lm_head.weight.shape[0]
    griffin = ObjectiveConfig("griffin", griffin_topk=vd)
    wide = TTTModel(draft, target.lm_head.weight, TTTConfig(num_steps=3, objective=griffin))
    plain = TTTModel(draft, target.lm_head.weight, TTTConfig(num_steps=3))
    torch.testing.assert_close(wide(batch).step_loss, plain(batch).step_loss)


# ---------------------------------------------------------------------------- configuration
def test_the_default_objective_is_kl():
    assert TrainConfig().objective == "kl" and TTTConfig().objective.name == "kl"


@pytest.mark.parametrize("item,words", [("objective=tv", "objective='tv': choose one of kl, lk, hass, griffin"),
                                        ("hass_topk=0", "hass_topk=0"), ("griffin_topk=0", "griffin_topk=0"),
                                        ("lk_eta=-1", "lk_eta=-1")])
def test_a_bad_objective_is_refused_when_the_config_is_made(item, words):
    key, value = parse_override(item)
    with pytest.raises(InputError, match=re.escape(words)):
        replace(TrainConfig(), **{key: value})


def test_the_config_fields_reach_the_objective():
    cfg = TrainConfig(objective="hass", lk_eta=2.0, hass_topk=5, hass_weight=0.25, griffin_topk=3)
    assert cfg.objective_config == ObjectiveConfig("hass", 2.0, 5, 0.25, 3)


def test_each_objective_reaches_training(target, tmp_path):
    samples = synthetic_samples(target, 8)
    runs = {name: trained(train(target, samples, replace(BASE, objective=name), out=tmp_path / name))
            for name in OBJECTIVES}
    for name in OBJECTIVES[1:]:
        assert not torch.equal(runs[name]["fc.weight"], runs["kl"]["fc.weight"]), name
