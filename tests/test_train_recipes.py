"""The draft-quality study's switches (TrainConfig fields), each on a tiny model, and the feature
store's contract: it refuses a store built for another target, other layers or other data."""
import json
import re
import shutil
from dataclasses import replace

import pytest
import torch

from eagle3.draft.inference import build_draft_layout
from eagle3.draft.model import DraftConfig, Eagle3Draft
from eagle3.errors import ContractError, InputError, UnsupportedError
from eagle3.draft.formats import save_draft
from eagle3.train.config import TrainConfig
from eagle3.train.dryrun import synthetic_samples
from eagle3.train.features import Sample
from eagle3.train.pipeline import DataPart, init_layer_from, make_draft, train
from eagle3.train.store import PartKey, StorePart, build_part, target_fingerprint
from eagle3.train.tiny import tiny_target
from eagle3.train.trainer import load_checkpoint, lr_at, make_optimizer
from eagle3.train.ttt import TTTConfig, TTTModel, align, shift_left
from eagle3.train.vocab import DraftVocab

from test_train_ttt import make_batch, serving_step_mask

BASE = TrainConfig(draft_vocab_size=64, batch_size=4, epochs=1, lr=3e-3, warmup_steps=1, eval_every=0,
                   eval_fraction=0.0, checkpoint_every_s=1e9, features="online", ttt_steps=3)


@pytest.fixture(scope="module")
def target():
    torch.set_num_threads(1)
    return tiny_target()


@pytest.fixture(scope="module")
def samples(target):
    return synthetic_samples(target, 12)


def vocab_of(draft) -> DraftVocab:
    return DraftVocab(draft.d2t + torch.arange(draft.d2t.numel()), draft.d2t, draft.t2d)


def trained(draft):
    return {k: v.clone() for k, v in draft.state_dict().items() if k != "embed_tokens.weight"}


def test_freeze_lm_head_keeps_the_target_rows_and_trains_the_rest(target, samples, tmp_path):
    draft = train(target, samples, replace(BASE, freeze_lm_head=True, max_steps=2), out=tmp_path / "f")
    used = draft.d2t + torch.arange(draft.d2t.numel())
    assert torch.equal(draft.lm_head.weight, target.lm_head.weight[used])
    free = train(target, samples, replace(BASE, max_steps=2), out=tmp_path / "t")
    assert not torch.equal(free.lm_head.weight, target.lm_head.weight[used])
    start = make_draft(target, BASE, vocab_of(draft))
    assert not torch.equal(draft.fc.weight, start.fc.weight)


def eagle31_draft(target, norm_before_fc: bool, norm_output: bool, seed: int = 1, layers: int = 1) -> Eagle3Draft:
    torch.manual_seed(seed)
    cfg = replace(DraftConfig.for_target(target.config), norm_before_fc=norm_before_fc, norm_output=norm_output,
                  num_layers=layers)
    draft = Eagle3Draft(cfg)
    draft.set_embedding(target.embed_tokens.weight.detach())
    with torch.no_grad():
        if draft.pre_fc_norm is not None:
            draft.pre_fc_norm.weight.uniform_(0.5, 1.5)
        draft.norm.weight.uniform_(0.5, 1.5)
    return draft


@pytest.mark.parametrize("norm_before_fc,norm_output,layers", [(True, False, 1), (False, True, 1),
                                                               (True, True, 1), (False, False, 2)])
def test_eagle31_norms_and_two_layers_training_equals_serving_step_by_step(target, norm_before_fc,
                                                                         norm_output, layers):
    draft = eagle31_draft(target, norm_before_fc, norm_output, layers=layers)
    model = TTTModel(draft, target.lm_head.weight, TTTConfig(num_steps=3))
    a = align(make_batch(target))
    outs = model.unroll(a)
    bsz, seq = a.ids.shape
    layout = build_draft_layout(draft)
    for runner in (draft, layout):                  # the module and the inference layout
        cache, h = draft.new_cache(3 * seq, bsz), None
        with torch.no_grad():
            for k in range(3):
                kw = {"features": a.aux} if k == 0 else {"hidden": h}
                out = runner(shift_left(a.ids, k), torch.arange(seq) + k, cache,
                             attn_mask=serving_step_mask(a.valid, k), **kw)
                want = draft.norm(outs[k]) if norm_output else outs[k]    # what goes to the next step
                torch.testing.assert_close(out.hidden[a.valid], want[a.valid], rtol=1e-4, atol=1e-5)
                h = out.hidden
    # the flags change the result: without them the same weights give another step 1
    if layers == 1:
        plain = TTTModel(eagle31_draft(target, False, False), target.lm_head.weight, TTTConfig(num_steps=3))
        assert not torch.allclose(plain.unroll(a)[1], outs[1], atol=1e-3)
    else:
        assert len(draft.extra_layers) == 1 and draft.new_cache(8).k.shape[0] == 2


def test_draft_layers_switch_reaches_the_draft_and_is_not_exported(target, samples, tmp_path):
    draft = train(target, samples, replace(BASE, draft_layers=2, max_steps=2), out=tmp_path)
    assert draft.config.num_layers == 2
    assert "extra_layers.0.self_attn.q_proj.weight" in draft.state_dict()
    with pytest.raises(UnsupportedError, match="num_layers"):
        save_draft(draft, tmp_path / "d", "specforge", target.config)


def test_eagle31_draft_is_not_exported_silently(target, tmp_path):
    with pytest.raises(UnsupportedError, match="norm_before_fc"):
        save_draft(eagle31_draft(target, True, False), tmp_path / "d", "specforge", target.config)


@pytest.mark.parametrize("norm_before_fc,norm_output", [(True, False), (False, True), (True, True)])
def test_eagle31_draft_round_trips_in_the_speculators_layout(target, tmp_path, norm_before_fc, norm_output):
    """The switches under speculators' (and vLLM's) config keys, the norm as input_norm.weight;
    our loader reads both back."""
    from safetensors import safe_open
    from eagle3.draft.formats import export_format, load_draft
    draft = eagle31_draft(target, norm_before_fc, norm_output)
    assert export_format(draft.config) == "speculators"
    out = save_draft(draft, tmp_path / "d", export_format(draft.config), target.config)
    hf = json.loads((out / "config.json").read_text())
    assert (hf["norm_before_fc"], hf["norm_output"]) == (norm_before_fc, norm_output)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert ("input_norm.weight" in keys) == norm_before_fc and "pre_fc_norm.weight" not in keys
    loaded = load_draft(out, target=target).draft
    assert (loaded.config.norm_before_fc, loaded.config.norm_output) == (norm_before_fc, norm_output)
    for k, v in draft.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k


def test_a_plain_draft_is_exported_as_specforge(target):
    from eagle3.draft.formats import export_format
    assert export_format(eagle31_draft(target, False, False).config) == "specforge"


def test_norm_switches_reach_the_draft_and_train_its_norm(target, samples, tmp_path):
    draft = train(target, samples, replace(BASE, norm_before_fc=True, norm_output=True, max_steps=2),
                  out=tmp_path)
    assert draft.config.norm_before_fc and draft.config.norm_output
    assert not torch.equal(draft.pre_fc_norm.weight, torch.ones_like(draft.pre_fc_norm.weight))


def test_init_layer_from_copies_the_target_layer(target, samples, tmp_path):
    draft = make_draft(target, replace(BASE, init_layer_from=5), vocab_of(train(
        target, samples, replace(BASE, max_steps=1), out=tmp_path)))
    src, mid, h = target.layers[5], draft.midlayer, target.config.hidden_size
    assert torch.equal(mid.self_attn.q_proj.weight[:, h:], src.self_attn.q_proj.weight)
    assert torch.equal(mid.self_attn.v_proj.weight[:, h:], src.self_attn.v_proj.weight)
    assert not torch.equal(mid.self_attn.q_proj.weight[:, :h], src.self_attn.q_proj.weight)
    assert torch.equal(mid.mlp.down_proj.weight, src.mlp.down_proj.weight)
    assert torch.equal(mid.hidden_norm.weight, src.input_layernorm.weight)
    with pytest.raises(InputError, match="layers 0..7"):
        init_layer_from(draft, target, 8)


def test_feature_noise_only_in_training_and_resumes_exactly(target, samples, tmp_path):
    from eagle3.train.tiny import tiny_draft
    draft = tiny_draft(target)
    batch = make_batch(target)
    noisy = TTTModel(draft, target.lm_head.weight, TTTConfig(num_steps=2, feature_noise=0.1))
    clean = TTTModel(draft, target.lm_head.weight, TTTConfig(num_steps=2))
    assert not torch.equal(noisy(batch).loss, clean(batch).loss)
    noisy.eval()
    assert torch.equal(noisy(batch).loss, clean(batch).loss)
    cfg = replace(BASE, feature_noise=0.05, epochs=2)
    full = trained(train(target, samples, cfg, out=tmp_path / "full"))
    train(target, samples, replace(cfg, max_steps=3), out=tmp_path / "part")
    resumed = trained(train(target, samples, cfg, out=tmp_path / "part"))
    for k in full:
        assert torch.equal(full[k], resumed[k]), k
    assert not torch.equal(full["fc.weight"], trained(train(target, samples, replace(BASE, epochs=2),
                                                               out=tmp_path / "clean"))["fc.weight"])


def test_muon_on_fc_and_midlayer_matrices_and_resume(target, samples, tmp_path):
    cfg = replace(BASE, optimizer="muon", epochs=2)
    full = trained(train(target, samples, cfg, out=tmp_path / "full"))
    train(target, samples, replace(cfg, max_steps=3), out=tmp_path / "part")
    resumed = trained(train(target, samples, cfg, out=tmp_path / "part"))
    for k in full:
        assert torch.equal(full[k], resumed[k]), k
    adamw = trained(train(target, samples, replace(BASE, epochs=2), out=tmp_path / "adamw"))
    assert not torch.equal(full["midlayer.mlp.up_proj.weight"], adamw["midlayer.mlp.up_proj.weight"])
    from eagle3.train.tiny import tiny_draft
    model = TTTModel(tiny_draft(target), target.lm_head.weight)
    opt = make_optimizer(model, cfg)
    muon, adam = opt.parts
    muon_ids = {id(p) for g in muon.param_groups for p in g["params"]}
    assert id(model.draft.fc.weight) in muon_ids and id(model.draft.midlayer.self_attn.q_proj.weight) in muon_ids
    assert id(model.draft.lm_head.weight) not in muon_ids and id(model.draft.norm.weight) not in muon_ids
    with pytest.raises(InputError, match="fc_precondition"):
        make_optimizer(model, replace(cfg, fc_precondition=True))


@pytest.mark.parametrize("item,words", [("schedule=step", "schedule='step'"),
                                        ("optimizer=sgd", "choose one of adamw, muon"),
                                        ("features=cache", "choose one of store, online"),
                                        ("feature_noise=-0.1", ">= 0"), ("draft_layers=0", ">= 1"),
                                        ("max_tokens=0", "budget > 0"), ("eval_every=-1", "eval_every=-1")])
def test_a_bad_switch_is_refused_when_the_config_is_made(item, words):
    from eagle3.train.config import parse_override
    key, value = parse_override(item)
    with pytest.raises(InputError, match=re.escape(words)):
        replace(BASE, **{key: value})


def test_schedules():
    cfg = replace(BASE, lr=1.0, warmup_steps=0, min_lr_ratio=0.0)
    assert [round(lr_at(s, 4, replace(cfg, schedule="linear")), 3) for s in range(5)] == [1, .75, .5, .25, 0]
    assert [lr_at(s, 4, replace(cfg, schedule="constant")) for s in range(5)] == [1.0] * 5
    assert round(lr_at(2, 4, cfg), 3) == 0.5
    with pytest.raises(InputError, match="schedule"):
        lr_at(0, 4, replace(cfg, schedule="step"))


def test_token_budget_spans_the_schedule_and_stops_the_run(target, samples, tmp_path):
    lengths = [len(s.ids) for s in samples]
    budget = int(sum(lengths) * 1.5)                 # one and a half epochs
    train(target, samples, replace(BASE, max_tokens=budget, epochs=1), out=tmp_path)
    recs = [json.loads(l) for l in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    seen = [sum(r["tokens"] for r in recs[:k + 1]) for k in range(len(recs))]
    assert seen[-1] >= budget > seen[-2]
    assert {r["epoch"] for r in recs} == {0, 1}
    assert recs[-1]["lr"] < 0.5 * BASE.lr                        # the schedule ends with the budget


def test_held_out_part_is_the_eval_set(target, samples, tmp_path):
    parts = [DataPart("a", 8), DataPart("b", 4, held_out=True)]
    cfg = replace(BASE, eval_every=2, max_steps=2)
    train(target, samples, cfg, out=tmp_path, parts=parts)
    recs = [json.loads(l) for l in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert any("eval" in r for r in recs)
    assert all(r["seqs"] == 4 for r in recs if "seqs" in r)            # 8 training samples, 2 steps
    assert load_checkpoint(tmp_path / "checkpoint.pt")["parts"] == [["a", 8, False], ["b", 4, True]]


# ---------------------------------------------------------------------------- the store's contract
def test_store_refuses_another_target_other_layers_or_other_data(target, samples, tmp_path):
    key = PartKey(target_fingerprint(target), tuple(target.config.default_aux_layer_ids), "bfloat16")
    part = build_part(target, samples, key, tmp_path / "p", shard_size=4)
    assert part.manifest["num_samples"] == 12 and part.manifest["teacher"].startswith("final normed hidden")
    other = tiny_target(seed=5)
    with pytest.raises(ContractError, match="feature store target"):
        StorePart(tmp_path / "p", replace(key, target=target_fingerprint(other)), samples)
    with pytest.raises(ContractError, match="feature store aux_layer_ids"):
        StorePart(tmp_path / "p", replace(key, aux_layer_ids=(1, 4, 5)), samples)
    changed = samples[:5] + [Sample(samples[5].ids.flip(0), samples[5].loss_mask)] + samples[6:]
    with pytest.raises(ContractError, match="feature store data"):
        StorePart(tmp_path / "p", key, changed)
    # a resumed build over the shards of another target refuses instead of mixing them
    with pytest.raises(ContractError, match="feature store target"):
        build_part(other, samples, replace(key, target=target_fingerprint(other)), tmp_path / "p", shard_size=4)
    # changed data: only the shard holding the changed conversation is rewritten
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "p").glob("shard-*")}
    build_part(target, changed, key, tmp_path / "p", shard_size=4)
    after = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "p").glob("shard-*")}
    assert [n for n in sorted(before) if before[n] != after[n]] == ["shard-00001.safetensors"]


def test_training_from_the_store_equals_online_training(target, samples, tmp_path):
    """fp32 store: the same run from stored features ends where the online one does (up to the
    store's different batching of the target forward, fp32 rounding)."""
    import eagle3.train.pipeline as pipeline
    online = trained(train(target, samples, replace(BASE, max_steps=3), out=tmp_path / "on"))
    old = pipeline.STORE_DTYPE
    pipeline.STORE_DTYPE = "float32"
    try:
        stored = trained(train(target, samples, replace(BASE, max_steps=3, features="store"),
                               out=tmp_path / "st"))
    finally:
        pipeline.STORE_DTYPE = old
    for k in online:
        torch.testing.assert_close(stored[k], online[k], rtol=1e-3, atol=1e-5)
    assert (tmp_path / "st" / "features" / "samples" / "store.json").is_file()


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="torch.compile on CPU needs a C++ compiler")
def test_compiled_training_step_matches_eager(target, samples, tmp_path):
    """compile = true trains the same draft as eager up to the compiled kernels' rounding."""
    from torch._dynamo.utils import counters
    cfg = replace(BASE, max_steps=2, ttt_steps=1)            # a small graph: the test compiles once
    eager = trained(train(target, samples, cfg, out=tmp_path / "e"))
    counters.clear()
    compiled = trained(train(target, samples, replace(cfg, compile=True), out=tmp_path / "c"))
    assert counters["stats"]["unique_graphs"] > 0             # it really ran compiled
    for k in eager:
        torch.testing.assert_close(compiled[k], eager[k], rtol=1e-3, atol=1e-4)


def test_a_study_variant_is_read_back_from_its_checkpoint(target, samples, tmp_path):
    from eagle3.train.pipeline import draft_from_checkpoint
    cfg = replace(BASE, norm_before_fc=True, draft_layers=2, max_steps=1, checkpoint_every_s=0.0)
    draft = train(target, samples, cfg, out=tmp_path)
    back = draft_from_checkpoint(tmp_path / "checkpoint.pt", target)
    assert back.config == draft.config
    for k, v in draft.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
