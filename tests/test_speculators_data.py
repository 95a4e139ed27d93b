"""speculators' offline training data read by `eagle3 train`: a tiny dataset in each layout for
the tiny target, trained a few steps; the draft loads, passes the doctor and drafts tokens."""
import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from eagle3.doctor import run_doctor
from eagle3.doctor.offline import ProbeSettings
from eagle3.draft.formats import export_format, load_draft, save_draft
from eagle3.errors import ContractError
from eagle3.train import speculators_data
from eagle3.train.config import TrainConfig
from eagle3.train.dryrun import synthetic_samples
from eagle3.train.pipeline import train
from eagle3.train.real import speculators_run
from eagle3.train.speculators_data import read_speculators_data
from eagle3.train.tiny import tiny_target

from test_vllm_features import engine_states

VD = 48
BASE = TrainConfig(draft_vocab_size=VD, batch_size=4, epochs=1, lr=3e-3, warmup_steps=1, eval_every=0,
                   eval_fraction=0.0, checkpoint_every_s=1e9, ttt_steps=2, max_steps=3)


@pytest.fixture(scope="module")
def target():
    torch.set_num_threads(1)
    return tiny_target()


@pytest.fixture(scope="module")
def samples(target):
    return synthetic_samples(target, 8)


def speculators_vocab(samples, vocab_size: int, draft_vocab_size: int):
    """token_freq.pt and d2t / t2d as speculators builds them (frequency, then id; ascending)."""
    freq: dict[int, int] = {}
    for s in samples:
        for t in s.ids[s.loss_mask].tolist():
            freq[t] = freq.get(t, 0) + 1
    chosen = sorted(sorted(freq, key=lambda t: (-freq[t], t))[:draft_vocab_size])
    chosen += [t for t in range(vocab_size) if t not in chosen][:draft_vocab_size - len(chosen)]
    chosen = sorted(chosen)
    d2t = np.array(chosen, dtype=np.int64) - np.arange(draft_vocab_size)
    t2d = np.zeros(vocab_size, dtype=bool)
    t2d[chosen] = True
    return freq, d2t, t2d


def write_pt_layout(root, target, samples, output_ids=(1, 3, 4, 7), shift=0, vocab=True):
    """Releases 0.3-0.4: data_<i>.pt with the OUTPUT of each listed layer (+1 = our input ids)."""
    root.mkdir(parents=True)
    inputs = [i + 1 for i in output_ids]
    for i, s in enumerate(samples):
        states = engine_states(target, s, inputs, shift).to(torch.bfloat16)      # [T, n, H]
        torch.save({"input_ids": s.ids.clone(), "loss_mask": s.loss_mask.long(),
                    "hidden_states": [states[:, j].contiguous() for j in range(states.shape[1])]},
                   root / f"data_{i}.pt")
    (root / "data_config.json").write_text(json.dumps({
        "version": "2.0", "hidden_states": {"layer_ids": list(output_ids)},
        "model": {"target_model_path": "tiny", "hidden_size": target.config.hidden_size},
        "format": {"file_pattern": "data_{idx}.pt"}}))
    freq, d2t, t2d = speculators_vocab(samples, target.config.vocab_size, VD)
    torch.save(freq, root / "token_freq.pt")
    if vocab:
        np.save(root / "d2t.npy", d2t)
        np.save(root / "t2d.npy", t2d)
    return d2t


def test_pt_layout_trains_a_draft_that_loads_passes_the_doctor_and_drafts(target, samples, tmp_path):
    write_pt_layout(tmp_path / "data", target, samples)
    # a map of the data's own (the first VD ids), not what counting the data here would choose
    np.save(tmp_path / "data" / "d2t.npy", np.zeros(VD, dtype=np.int64))
    np.save(tmp_path / "data" / "t2d.npy", np.arange(target.config.vocab_size) < VD)
    cfg, got, parts, external = speculators_run(replace(BASE, speculators_data=str(tmp_path / "data"),
                                                        out=str(tmp_path / "run")), target)
    assert cfg.aux_layer_ids == (2, 4, 5) and len(got) == len(samples)
    draft = train(target, got, cfg, out=tmp_path / "run", parts=parts, external=external)
    assert torch.equal(draft.d2t, torch.zeros(VD, dtype=torch.long))     # the data's own map
    out = save_draft(draft, tmp_path / "draft", export_format(draft.config), target.config)
    loaded = load_draft(out, target=target)
    assert loaded.info.aux_layer_ids == (2, 4, 5) and loaded.info.draft_vocab_size == VD
    report = run_doctor(target, out, settings=ProbeSettings(max_new_tokens=12))
    assert report.ok, report.table()
    assert report.probe["lossless"] and report.probe["tau"] > 1.0          # it drafted accepted tokens
    manifest = json.loads(next((tmp_path / "run" / "features").glob("*/store.json")).read_text())
    assert manifest["source"].startswith("speculators pt data")


def test_token_freq_builds_the_map_when_d2t_is_absent(target, samples, tmp_path):
    d2t = write_pt_layout(tmp_path / "data", target, samples, vocab=False)
    data = read_speculators_data(tmp_path / "data", 8, target.config.vocab_size, VD, 512)
    assert data.layout == "pt" and data.layer_ids == (2, 4, 5, 8)
    assert torch.equal(data.vocab.d2t, torch.from_numpy(d2t))


def test_output_numbered_ids_are_shifted_and_checked_on_the_target(target, samples, tmp_path):
    """A data_config that names input ids for states captured at outputs is one layer off: the
    numbering check against the target refuses to build the store."""
    write_pt_layout(tmp_path / "data", target, samples, shift=1)
    cfg, got, parts, external = speculators_run(replace(BASE, speculators_data=str(tmp_path / "data"),
                                                        out=str(tmp_path / "run")), target)
    with pytest.raises(ContractError, match="closest to our layer 3"):
        train(target, got, cfg, out=tmp_path / "run", parts=parts, external=external)


def test_data_layers_and_vocab_must_match_the_run(target, samples, tmp_path):
    write_pt_layout(tmp_path / "data", target, samples)
    with pytest.raises(ContractError, match="aux_layer_ids") as e:
        speculators_run(replace(BASE, speculators_data=str(tmp_path / "data"), aux_layer_ids=(2, 4, 6)), target)
    assert e.value.expected == [2, 4, 5]
    with pytest.raises(ContractError, match="d2t.npy") as e:
        speculators_run(replace(BASE, speculators_data=str(tmp_path / "data"), draft_vocab_size=32), target)
    assert "draft_vocab_size=48" in e.value.fix
    (tmp_path / "data" / "data_config.json").write_text(json.dumps({"hidden_states": {"layer_ids": [1, 3, 4]}}))
    with pytest.raises(ContractError, match="last layer"):
        speculators_run(replace(BASE, speculators_data=str(tmp_path / "data")), target)


def test_hs_layout_reads_vllm_files_with_the_prepared_ids(target, samples, tmp_path, monkeypatch):
    """Later releases: hidden_states/hs_<i>.safetensors (vLLM's example-connector files, input
    numbering, default ids 2, L//2, L-3, L) beside the prepared dataset (Arrow; stubbed here)."""
    from safetensors.torch import save_file
    root = tmp_path / "data"
    (root / "hidden_states").mkdir(parents=True)
    ids = [2, 4, 5, 8]
    for i, s in enumerate(samples):
        save_file({"hidden_states": engine_states(target, s, ids).to(torch.bfloat16).contiguous(),
                   "token_ids": s.ids.clone()}, str(root / "hidden_states" / f"hs_{i}.safetensors"))
    rows = [(s.ids.tolist(), s.loss_mask.long().tolist()) for s in samples]
    monkeypatch.setattr(speculators_data, "read_prepared", lambda folder: rows)
    cfg, got, parts, external = speculators_run(replace(BASE, speculators_data=str(root), max_len=16,
                                                        out=str(tmp_path / "run")), target)
    assert cfg.aux_layer_ids == (2, 4, 5) and external.vocab is None
    assert max(len(s.ids) for s in got) == 16 < max(len(s.ids) for s in samples)   # rows cut to match
    draft = train(target, got, cfg, out=tmp_path / "run", parts=parts, external=external)
    assert draft.config.aux_layer_ids == (2, 4, 5)


def test_speculators_data_options():
    from eagle3.errors import InputError
    from eagle3.train.config import parse_override
    with pytest.raises(InputError, match="drop data"):
        TrainConfig(speculators_data="runs/spec", data="runs/data/conversations.jsonl")
    assert parse_override("speculators_layer_ids=[2,15,27,30]") == ("speculators_layer_ids", (2, 15, 27, 30))
