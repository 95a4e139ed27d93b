"""Draft checkpoint formats: round trips, layer-id conventions, embeddings, legacy .bin, strict keys."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3.errors import ContractError, LoadError, UnsupportedError
from eagle3.models.config import ModelConfig
from eagle3.models.llama import LlamaModel
from eagle3.draft.model import DraftConfig, Eagle1Draft, Eagle3Draft
from eagle3.draft.formats import attach_target, inspect_draft, load_draft, save_draft
from eagle3.models.target import TargetFacts

TARGET_HF = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32,
             "intermediate_size": 64, "num_hidden_layers": 8, "num_attention_heads": 4,
             "num_key_value_heads": 2, "max_position_embeddings": 128, "rope_theta": 10000.0}
DEFAULT_IDS = (2, 4, 5)  # 2, L//2, L-3 for L = 8


def tiny_target(seed: int = 0, **overrides) -> LlamaModel:
    torch.manual_seed(seed)
    model = LlamaModel(ModelConfig.from_hf({**TARGET_HF, **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.3)
    return model.eval()


def tiny_draft(target: LlamaModel, ids=DEFAULT_IDS, draft_vocab: int = 40, seed: int = 1,
               algorithm: str = "eagle3"):
    torch.manual_seed(seed)
    cfg = DraftConfig.for_target(target.config, draft_vocab_size=draft_vocab, aux_layer_ids=ids,
                                 algorithm=algorithm)
    draft = (Eagle3Draft if algorithm == "eagle3" else Eagle1Draft)(cfg)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if "embed" not in name:
                p.normal_(1.0 if "norm" in name else 0.0, 0.3)
    draft.set_embedding(target.embed_tokens.weight)
    if algorithm == "eagle":
        draft.set_lm_head(target.lm_head.weight)
    elif draft_vocab < target.config.vocab_size:
        used = torch.randperm(target.config.vocab_size)[:draft_vocab].sort().values
        draft.d2t.copy_(used - torch.arange(draft_vocab))
        draft.t2d.zero_()
        draft.t2d[used] = True
    return draft.eval()


def draft_outputs(draft, target: LlamaModel, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of one draft forward over target features, then one step on its own hidden."""
    torch.manual_seed(seed)
    ids = torch.randint(0, target.config.vocab_size, (1, 6))
    cfg = draft.config
    width = len(cfg.aux_layer_ids) * cfg.target_hidden_size if cfg.algorithm == "eagle3" \
        else cfg.target_hidden_size
    feats = torch.randn(1, 6, width)
    cache = draft.new_cache(32)
    with torch.no_grad():
        first = draft(ids, torch.arange(6), cache, features=feats)
        second = draft(ids[:, -1:], torch.tensor([6]), cache, hidden=first.hidden[:, -1:])
    return first.logits, second.logits


def edit_config(path: Path, fn) -> None:
    hf = json.loads((path / "config.json").read_text())
    fn(hf)
    (path / "config.json").write_text(json.dumps(hf))


def specforge_native(path: Path) -> Path:
    """What SpecForge's own exporter writes: the ids only in eagle_config (output of layer i)."""
    edit_config(path, lambda hf: hf.pop("eagle_aux_hidden_state_layer_ids"))
    return path


def edit_weights(path: Path, fn) -> None:
    state = load_file(str(path / "model.safetensors"))
    fn(state)
    save_file(state, str(path / "model.safetensors"))


@pytest.fixture(scope="module")
def pair():
    target = tiny_target()
    return target, tiny_draft(target)


# ---------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("fmt", ["specforge", "speculators", "eagle"])
def test_round_trip_same_outputs(pair, tmp_path, fmt):
    target, draft = pair
    save_draft(draft, tmp_path / fmt, fmt, TargetFacts.of(target.config, "tiny-target"))
    draft2, info = load_draft(tmp_path / fmt, target=target)
    assert (info.format, info.algorithm, info.aux_layer_ids) == (fmt, "eagle3", DEFAULT_IDS)
    assert info.embedding_source == "target" and info.embedding_attached
    assert info.draft_vocab_size == 40
    for want, got in zip(draft_outputs(draft, target), draft_outputs(draft2, target)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.equal(draft2.d2t, draft.d2t) and torch.equal(draft2.t2d, draft.t2d)


def test_round_trip_custom_ids_and_bf16(tmp_path):
    target = tiny_target()
    draft = tiny_draft(target, ids=(1, 3, 6, 7)).to(torch.bfloat16)
    draft.set_embedding(target.embed_tokens.weight.to(torch.bfloat16))
    for fmt in ("specforge", "speculators"):
        save_draft(draft, tmp_path / fmt, fmt, target.config)
        loaded, info = load_draft(tmp_path / fmt, target.config, dtype=torch.bfloat16)
        assert info.aux_layer_ids == (1, 3, 6, 7)
        for key, value in draft.state_dict().items():
            if key != "embed_tokens.weight":
                assert torch.equal(loaded.state_dict()[key], value), key


def test_eagle1_round_trip(tmp_path):
    target = tiny_target()
    draft = tiny_draft(target, algorithm="eagle", draft_vocab=64)
    save_draft(draft, tmp_path / "e1", "eagle")
    loaded, info = load_draft(tmp_path / "e1", target=target)
    assert (info.algorithm, info.layer_id_convention, info.lm_head_source) == ("eagle", "none", "target")
    for want, got in zip(draft_outputs(draft, target), draft_outputs(loaded, target)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(UnsupportedError, match="EAGLE-3 layout"):
        save_draft(draft, tmp_path / "x", "specforge")
    edit_config(tmp_path / "e1", lambda hf: hf.update(bias=True))  # EAGLE-1/2 fc has a bias
    assert load_draft(tmp_path / "e1", target=target).info.algorithm == "eagle"
    edit_config(tmp_path / "e1", lambda hf: hf.update(bias=False))
    with pytest.raises(UnsupportedError, match="bias=False"):
        load_draft(tmp_path / "e1", target=target)


# ---------------------------------------------------------------------------- layer-id conventions
def test_specforge_ids_are_output_convention(pair, tmp_path):
    target, draft = pair
    out = save_draft(draft, tmp_path / "sf", "specforge", target.config)
    hf = json.loads((out / "config.json").read_text())
    assert hf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert hf["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # always: vLLM reads a lone eagle_config raw
    specforge_native(out)
    info = inspect_draft(out, target.config).info
    assert (info.layer_id_convention, info.stored_layer_ids, info.aux_layer_ids) == \
        ("output", (1, 3, 4), DEFAULT_IDS)
    assert "+1" in info.layer_id_source


def test_top_level_ids_are_input_convention(pair, tmp_path):
    target, draft = pair
    out = save_draft(draft, tmp_path / "v", "specforge", target.config)
    edit_config(out, lambda hf: (hf.pop("eagle_config"),
                                 hf.update(architectures=["Eagle3LlamaForCausalLM"],
                                           eagle_aux_hidden_state_layer_ids=[2, 4, 5])))
    info = inspect_draft(out, target.config).info
    assert (info.format, info.layer_id_convention, info.aux_layer_ids) == ("vllm", "input", DEFAULT_IDS)


def test_custom_ids_written_in_both_conventions(tmp_path):
    target = tiny_target()
    draft = tiny_draft(target, ids=(1, 3, 6))
    out = save_draft(draft, tmp_path / "sf", "specforge", target.config)
    hf = json.loads((out / "config.json").read_text())
    assert hf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 5]
    assert hf["eagle_aux_hidden_state_layer_ids"] == [1, 3, 6]
    info = inspect_draft(out, target.config).info
    assert (info.layer_id_convention, info.aux_layer_ids) == ("input+output", (1, 3, 6))


def test_disagreeing_stored_ids_raise(pair, tmp_path):
    target, draft = pair
    out = save_draft(draft, tmp_path / "sf", "specforge", target.config)
    edit_config(out, lambda hf: hf.update(eagle_aux_hidden_state_layer_ids=[1, 3, 4]))
    with pytest.raises(ContractError, match="name different layers"):
        load_draft(out, target.config)


def test_default_ids_need_the_target(pair, tmp_path):
    target, draft = pair
    out = save_draft(draft, tmp_path / "e", "eagle", target.config)
    with pytest.raises(LoadError, match="stores no aux layer ids"):
        inspect_draft(out)
    info = inspect_draft(out, target.config).info
    assert (info.layer_id_convention, info.aux_layer_ids) == ("default", DEFAULT_IDS)


def test_eagle_layout_refuses_custom_ids(tmp_path):
    target = tiny_target()
    with pytest.raises(UnsupportedError, match="cannot record layer ids"):
        save_draft(tiny_draft(target, ids=(1, 3, 6)), tmp_path / "e", "eagle", target.config)


def test_off_by_one_is_noted(pair, tmp_path):
    target, draft = pair
    out = specforge_native(save_draft(draft, tmp_path / "sf", "specforge", target.config))
    edit_config(out, lambda hf: hf["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[2, 4, 5]))
    info = inspect_draft(out, target.config).info
    assert info.aux_layer_ids == (3, 5, 6)
    assert any("INPUT-convention defaults" in n for n in info.notes)


# ---------------------------------------------------------------------------- embeddings
def test_checkpoint_without_embedding_needs_the_target(pair, tmp_path):
    target, draft = pair
    out = save_draft(draft, tmp_path / "sf", "specforge", target.config)
    assert "embed_tokens.weight" not in load_file(str(out / "model.safetensors"))
    loose, info = load_draft(out, target.config)
    assert info.embedding_source == "target" and not info.embedding_attached
    attached, info = attach_target((loose, info), target)
    assert info.embedding_attached
    assert attached.embed_tokens.weight.data_ptr() == target.embed_tokens.weight.data_ptr()


def test_checkpoint_with_embedding_keeps_its_own(pair, tmp_path):
    target, draft = pair
    out = save_draft(draft, tmp_path / "sp", "speculators", target.config)
    own = torch.randn(64, 32)
    edit_weights(out, lambda st: st.update({"embed_tokens.weight": own}))
    loaded, info = load_draft(out, target=tiny_target(seed=5))
    assert info.embedding_source == "checkpoint"
    assert torch.equal(loaded.embed_tokens.weight, own)


def test_wider_target_without_embedding_is_unsupported(pair, tmp_path):
    target, draft = pair
    out = save_draft(draft, tmp_path / "sf", "specforge", target.config)
    edit_config(out, lambda hf: hf.update(target_hidden_size=48))
    edit_weights(out, lambda st: st.update({"fc.weight": torch.zeros(32, 3 * 48)}))
    with pytest.raises(UnsupportedError, match="target_hidden_size=48"):
        load_draft(out, target.config)


# ---------------------------------------------------------------------------- legacy .bin
class NotATensor:
    pass


def test_legacy_bin_loads_with_weights_only(pair, tmp_path):
    target, draft = pair
    out = save_draft(draft, tmp_path / "bin", "eagle", target.config, legacy_bin=True)
    assert (out / "pytorch_model.bin").is_file() and not (out / "model.safetensors").exists()
    loaded, info = load_draft(out, target=target)
    assert info.weights_file == "pytorch_model.bin"
    for want, got in zip(draft_outputs(draft, target), draft_outputs(loaded, target)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_legacy_bin_with_pickled_object_is_refused(pair, tmp_path):
    target, draft = pair
    out = save_draft(draft, tmp_path / "bin", "eagle", target.config, legacy_bin=True)
    state = torch.load(out / "pytorch_model.bin", weights_only=True)
    torch.save({**state, "extra": NotATensor()}, out / "pytorch_model.bin")
    with pytest.raises(LoadError, match="weights_only"):
        load_draft(out, target.config)


# ---------------------------------------------------------------------------- strict keys
@pytest.mark.parametrize("edit, message", [
    (lambda st: st.update({"midlayer.extra.weight": torch.zeros(3)}), "unexpected key 'midlayer.extra"),
    (lambda st: st.pop("midlayer.mlp.up_proj.weight"), "missing key.*midlayer.mlp.up_proj.weight"),
    (lambda st: st.update({"norm.weight": torch.zeros(31)}),
     r"shape mismatch for 'norm.weight': checkpoint \(31,\), draft config expects \(32,\)"),
    (lambda st: st.pop("lm_head.weight"), "missing key 'lm_head.weight'"),
])
def test_strict_keys(pair, tmp_path, edit, message):
    target, draft = pair
    out = save_draft(draft, tmp_path / "sf", "specforge", target.config)
    edit_weights(out, edit)
    with pytest.raises(LoadError, match=message):
        load_draft(out, target.config)


def test_missing_vocab_map_with_smaller_draft_vocab(pair, tmp_path):
    target, draft = pair
    out = save_draft(draft, tmp_path / "sf", "specforge", target.config)
    edit_weights(out, lambda st: (st.pop("t2d"), st.pop("d2t")))
    with pytest.raises(LoadError, match="neither d2t nor t2d"):
        load_draft(out, target.config)


def test_t2d_derived_from_d2t(pair, tmp_path):
    target, draft = pair
    out = save_draft(draft, tmp_path / "sf", "specforge", target.config)
    edit_weights(out, lambda st: st.pop("t2d"))
    loaded, info = load_draft(out, target.config)
    assert torch.equal(loaded.t2d, draft.t2d) and "t2d derived from d2t" in info.notes


# ---------------------------------------------------------------------------- variant flags
@pytest.mark.parametrize("fmt, flag, value", [
    ("specforge", "norm_before_residual", True),
    ("specforge", "norm_output", False),       # SpecForge: false = no final norm
    ("specforge", "fc_norm", True),
    ("specforge", "tie_word_embeddings", True),
    ("speculators", "norm_before_residual", True),
    ("specforge", "norm_before_fc", True),     # the Eagle 3.1 switches live in speculators / vLLM layouts
])
def test_unimplemented_flags_raise(pair, tmp_path, fmt, flag, value):
    target, draft = pair
    out = save_draft(draft, tmp_path / fmt, fmt, target.config)
    edit_config(out, lambda hf: hf.update({flag: value}))
    with pytest.raises(UnsupportedError, match=f"{flag}={value}"):
        load_draft(out, target.config)


def test_eagle31_switch_that_is_not_a_boolean_raises(pair, tmp_path):
    target, draft = pair
    out = save_draft(draft, tmp_path / "sp", "speculators", target.config)
    edit_config(out, lambda hf: hf.update({"norm_output": "yes"}))
    with pytest.raises(LoadError, match="norm_output: expected one boolean"):
        load_draft(out, target.config)


def test_speculators_without_norm_before_residual_is_ambiguous(pair, tmp_path):
    target, draft = pair
    out = save_draft(draft, tmp_path / "sp", "speculators", target.config)
    edit_config(out, lambda hf: hf.pop("norm_before_residual"))
    with pytest.raises(LoadError, match="vLLM: true"):
        load_draft(out, target.config)


def test_speculators_layout_on_disk(pair, tmp_path):
    target, draft = pair
    out = save_draft(draft, tmp_path / "sp", "speculators", TargetFacts.of(target.config, "/models/t"),
                     speculative_tokens=5)
    hf = json.loads((out / "config.json").read_text())
    assert hf["architectures"] == ["Eagle3Speculator"] and hf["speculators_model_type"] == "eagle3"
    assert hf["transformer_layer_config"]["num_hidden_layers"] == 1
    assert hf["eagle_aux_hidden_state_layer_ids"] == list(DEFAULT_IDS)
    spec = hf["speculators_config"]
    assert spec["proposal_methods"][0]["speculative_tokens"] == 5
    assert spec["verifier"]["name_or_path"] == "/models/t"
    keys = load_file(str(out / "model.safetensors")).keys()
    assert "layers.0.hidden_norm.weight" in keys and not any(k.startswith("midlayer.") for k in keys)
