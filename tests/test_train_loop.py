import json
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from eagle3.train.config import TrainConfig
from eagle3.train.dryrun import synthetic_samples
from eagle3.train.pipeline import train
from eagle3.train.tiny import tiny_target
from eagle3.train.trainer import Dist, epoch_batches, lr_at, load_checkpoint

BASE = TrainConfig(draft_vocab_size=64, batch_size=4, epochs=2, lr=3e-3, warmup_steps=3, eval_every=0,
                   eval_fraction=0.0, checkpoint_every_s=1e9, features="online", ttt_steps=3)


def weights(draft):
    return {k: v.clone() for k, v in draft.state_dict().items() if k != "embed_tokens.weight"}


def log(path):
    return [json.loads(l) for l in (path / "train_log.jsonl").read_text().splitlines()]


def test_loss_decreases_on_tiny_task(tmp_path):
    torch.set_num_threads(1)
    target = tiny_target(std=1.0)          # peaky teacher: a learnable synthetic task
    samples = synthetic_samples(target, 16)
    train(target, samples, replace(BASE, epochs=6, ttt_steps=2), out=tmp_path)
    recs = [r for r in log(tmp_path) if "loss" in r]
    assert len(recs) == 24
    first = sum(r["loss"] for r in recs[:4]) / 4
    last = sum(r["loss"] for r in recs[-4:]) / 4
    assert last < 0.7 * first, (first, last)
    assert sum(r["acc"][0] for r in recs[-4:]) > sum(r["acc"][0] for r in recs[:4])


def test_resumed_run_matches_uninterrupted(tmp_path):
    torch.set_num_threads(1)
    target = tiny_target()
    samples = synthetic_samples(target, 12)
    full = weights(train(target, samples, BASE, out=tmp_path / "full"))
    train(target, samples, replace(BASE, max_steps=4), out=tmp_path / "part")
    assert load_checkpoint(tmp_path / "part" / "checkpoint.pt")["step"] == 4
    resumed = weights(train(target, samples, BASE, out=tmp_path / "part"))
    assert len(log(tmp_path / "part")) == len(log(tmp_path / "full")) == 6
    for k in full:
        assert torch.equal(full[k], resumed[k]), k
    assert not torch.equal(full["fc.weight"], weights(train(target, samples, replace(BASE, max_steps=4),
                                                               out=tmp_path / "other"))["fc.weight"])


def test_data_order_and_schedule():
    lengths = [5, 9, 3, 7, 8, 2, 6, 4, 1, 10]
    a = epoch_batches(lengths, list(range(10)), 3, seed=0, epoch=0)
    assert a == epoch_batches(lengths, list(range(10)), 3, seed=0, epoch=0)
    assert a != epoch_batches(lengths, list(range(10)), 3, seed=0, epoch=1)
    assert sorted(i for b in a for i in b) == list(range(10))
    cfg = TrainConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, 100, cfg) == pytest.approx(0.1) and lr_at(9, 100, cfg) == pytest.approx(1.0)
    assert lr_at(100, 100, cfg) == pytest.approx(0.1) and lr_at(55, 100, cfg) == pytest.approx(0.55)


def _ddp_worker(rank, store, out, result):
    torch.set_num_threads(1)
    # a file store, not a TCP port: no race with another process taking a "free" port
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    target = tiny_target()
    samples = synthetic_samples(target, 12)
    draft = train(target, samples, BASE, Dist(rank, 2), out=out)
    if rank == 0:
        torch.save(weights(draft), result)
    # both ranks tear gloo down together: once, under load, rank 1 destroyed its group while rank 0
    # was still exporting and died in teardown ("terminate called without an active exception")
    dist.barrier()
    dist.destroy_process_group()


def test_ddp_two_ranks_match_one_process(tmp_path):
    torch.set_num_threads(1)
    target = tiny_target()
    one = weights(train(target, synthetic_samples(target, 12), BASE, out=tmp_path / "one"))
    result = tmp_path / "ddp.pt"
    mp.spawn(_ddp_worker, args=(tmp_path / "store", tmp_path / "ddp", result), nprocs=2, join=True)
    two = torch.load(result, weights_only=True)
    for k in one:
        torch.testing.assert_close(two[k], one[k], rtol=1e-4, atol=1e-5)
    assert not torch.equal(one["fc.weight"], tiny_draft_fc_init(target))


def tiny_draft_fc_init(target):
    from eagle3.train.pipeline import make_draft, prepare
    samples = synthetic_samples(target, 12)
    return make_draft(target, BASE, prepare(samples, BASE, 96, None).vocab).fc.weight.detach()


def test_warm_start_from_another_run(tmp_path):
    torch.set_num_threads(1)
    target = tiny_target(std=1.0)
    samples = synthetic_samples(target, 12)
    train(target, samples, BASE, out=tmp_path / "a")
    warm = train(target, samples, replace(BASE, init_from=str(tmp_path / "a" / "checkpoint.pt"), max_steps=1),
                 out=tmp_path / "b")
    first_a, first_b = log(tmp_path / "a")[0]["loss"], log(tmp_path / "b")[0]["loss"]
    assert first_b < first_a
    assert warm.fc.weight.shape == (32, 3 * 32)


def test_warm_start_from_an_exported_draft_directory(tmp_path):
    from eagle3.draft.formats import save_draft
    torch.set_num_threads(1)
    target = tiny_target(std=1.0)
    samples = synthetic_samples(target, 12)
    trained = train(target, samples, BASE, out=tmp_path / "a")
    save_draft(trained, tmp_path / "exported", "specforge", target.config)
    warm = train(target, samples, replace(BASE, init_from=str(tmp_path / "exported"), max_steps=1),
                 out=tmp_path / "b")
    assert log(tmp_path / "b")[0]["loss"] < log(tmp_path / "a")[0]["loss"]
    assert warm.fc.weight.shape == (32, 3 * 32)


def test_warm_start_with_more_data_keeps_the_source_vocabulary(tmp_path):
    torch.set_num_threads(1)
    target = tiny_target(std=1.0)
    first = train(target, synthetic_samples(target, 12), replace(BASE, max_steps=1), out=tmp_path / "a")
    more = synthetic_samples(target, 40, seed=1)
    fresh = train(target, more, replace(BASE, max_steps=1), out=tmp_path / "fresh")
    assert not torch.equal(fresh.d2t, first.d2t)          # the new data alone picks another vocabulary
    warm = train(target, more, replace(BASE, init_from=str(tmp_path / "a" / "checkpoint.pt"), max_steps=1),
                 out=tmp_path / "b")
    assert torch.equal(warm.d2t, first.d2t) and torch.equal(warm.t2d, first.t2d)


def test_fc_precondition_scales_each_column_update_of_fc_only(tmp_path):
    """fc_precondition = AdamW on fc in unit-RMS input coordinates: the first update of every fc
    column is the plain update times median(r)/r; every other parameter moves as without it."""
    from eagle3.train.pipeline import build_run
    from eagle3.train.trainer import train_step
    torch.set_num_threads(1)
    target = tiny_target(std=1.0)
    samples = synthetic_samples(target, 12)
    moved = {}
    for flag in (False, True):
        cfg = replace(BASE, fc_precondition=flag)
        (tmp_path / str(flag)).mkdir()
        run, model = build_run(target, samples, cfg, Dist(), tmp_path / str(flag))
        before = weights(model.draft)
        train_step(run.model, run.opt, run.source, run.train_idx[:4], max(run.lengths[i] for i in run.train_idx[:4]),
                   cfg.lr, cfg, Dist())
        moved[flag] = {k: v - before[k] for k, v in weights(model.draft).items() if v.is_floating_point()}
        scale = model.fc_update_scale
    assert scale is not None and scale.shape == (3 * 32,) and float(scale.min()) < 1 < float(scale.max())
    torch.testing.assert_close(moved[True]["fc.weight"], moved[False]["fc.weight"] * scale[None, :])
    for k in moved[False]:
        if k != "fc.weight":
            torch.testing.assert_close(moved[True][k], moved[False][k])


def test_warm_start_from_a_draft_trained_on_other_layers_is_refused(tmp_path):
    from eagle3.errors import ContractError
    torch.set_num_threads(1)
    target = tiny_target(std=1.0)
    samples = synthetic_samples(target, 12)
    train(target, samples, replace(BASE, max_steps=1), out=tmp_path / "a")       # default ids
    other = replace(BASE, max_steps=1, aux_layer_ids=(1, 3, 5),
                    init_from=str(tmp_path / "a" / "checkpoint.pt"))
    with pytest.raises(ContractError, match="aux_layer_ids"):
        train(target, samples, other, out=tmp_path / "b")
