"""The target/draft contract: the zero-acceptance incident and its relatives are errors naming the fix."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from eagle3.errors import ContractError, InputError
from eagle3.draft.contract import check_pair, normalize_algorithm, run_checks
from eagle3.draft.formats import load_draft, save_draft

from test_formats import edit_config, specforge_native, tiny_draft, tiny_target


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def error_of(target, draft, **kw) -> ContractError:
    with pytest.raises(ContractError) as exc:
        check_pair(target.config, draft, **kw)
    return exc.value


def test_good_pair_passes(target):
    draft = tiny_draft(target)
    assert check_pair(target.config, draft, algorithm="EAGLE3", target=target) == []
    checks = run_checks(target.config, draft, target=target)
    assert checks and all(c.status == "pass" for c in checks)


# ---------------------------------------------------------------------------- the incident
def test_eagle3_draft_run_as_eagle_names_the_flag(target):
    err = error_of(target, tiny_draft(target), algorithm="EAGLE")
    assert (err.field, err.found, err.expected) == ("algorithm", "EAGLE", "EAGLE3")
    assert "--speculative-algorithm EAGLE3" in err.fix and "vLLM: method eagle3" in err.fix
    assert "--algorithm EAGLE3" in str(err)


def test_eagle3_checkpoint_loaded_as_eagle_names_the_flag(target, tmp_path):
    out = save_draft(tiny_draft(target), tmp_path / "sf", "specforge", target.config)
    with pytest.raises(ContractError, match="--speculative-algorithm EAGLE3"):
        load_draft(out, target.config, algorithm="eagle")


def test_eagle1_draft_run_as_eagle3_names_the_flag(target, tmp_path):
    out = save_draft(tiny_draft(target, algorithm="eagle", draft_vocab=64), tmp_path / "e1", "eagle")
    with pytest.raises(ContractError, match="--speculative-algorithm EAGLE;"):
        load_draft(out, target.config, algorithm="EAGLE3")


def test_single_hidden_state_never_reaches_the_midlayer(target):
    draft = tiny_draft(target)
    one_state = torch.randn(1, 3, target.config.hidden_size)  # what an EAGLE (not EAGLE3) engine sends
    with pytest.raises(ContractError, match="algorithm EAGLE3"):
        draft(torch.tensor([[1, 2, 3]]), torch.arange(3), draft.new_cache(8), features=one_state)


# ---------------------------------------------------------------------------- relatives
def test_fc_width_not_matching_captured_layers(target):
    draft = tiny_draft(target)
    draft.fc = nn.Linear(2 * target.config.hidden_size, target.config.hidden_size, bias=False)
    err = error_of(target, draft)
    assert err.field == "fc.weight input width" and err.found == 64
    assert "3 captured layers [2, 4, 5]" in str(err.expected) and "capture exactly" in err.fix


def test_config_ids_not_matching_fc_at_load(target, tmp_path):
    out = specforge_native(save_draft(tiny_draft(target), tmp_path / "sf", "specforge", target.config))
    edit_config(out, lambda hf: hf["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1, 2, 3, 4]))
    with pytest.raises(ContractError, match="fc.weight input width: found 96, expected '4 layers"):
        load_draft(out, target.config)


def test_layer_ids_out_of_range(target):
    err = error_of(target, tiny_draft(target, ids=(2, 4, 9)))
    assert err.field == "aux_layer_ids" and err.found == [2, 4, 9]
    assert "8 layers" in err.fix and "[2, 4, 5]" in err.fix


def test_draft_for_a_deeper_target_is_out_of_range(target, tmp_path):
    out = specforge_native(save_draft(tiny_draft(target), tmp_path / "sf", "specforge", target.config))
    edit_config(out, lambda hf: hf["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1, 14, 26]))
    draft, info = load_draft(out, target=target)
    assert info.aux_layer_ids == (2, 15, 27)
    with pytest.raises(ContractError, match=r"aux_layer_ids: found \[2, 15, 27\]"):
        check_pair(target.config, draft, info=info)


def test_layer_ids_unordered_or_repeated(target):
    assert error_of(target, tiny_draft(target, ids=(4, 2, 5))).field == "aux_layer_ids order"
    assert error_of(target, tiny_draft(target, ids=(2, 2, 5))).field == "aux_layer_ids order"


def test_draft_for_another_vocab(target):
    other = tiny_target(vocab_size=80)
    err = error_of(target, tiny_draft(other))
    assert (err.field, err.found, err.expected) == ("vocab_size", 80, 64)
    assert "80-token vocabulary" in err.fix


def test_draft_for_another_hidden_size(target):
    err = error_of(target, tiny_draft(tiny_target(hidden_size=48)))
    assert (err.field, err.found, err.expected) == ("target_hidden_size", 48, 32)


@pytest.mark.parametrize("corrupt, field", [
    (lambda d: d.d2t.__setitem__(0, 500), "d2t targets (draft_id + d2t[draft_id])"),
    (lambda d: d.d2t.__setitem__(1, d.d2t[0] - 1), "d2t targets distinct"),
    (lambda d: d.t2d.__setitem__((~d.t2d).nonzero()[0], True), "t2d"),
])
def test_vocab_map_errors(target, corrupt, field):
    draft = tiny_draft(target)
    corrupt(draft)
    assert error_of(target, draft).field == field


def test_embedding_must_be_attached(target, tmp_path):
    out = save_draft(tiny_draft(target), tmp_path / "sf", "specforge", target.config)
    draft, info = load_draft(out, target.config)
    err = error_of(target, draft, info=info)
    assert err.field == "embed_tokens" and "attach_target" in err.fix
    draft, info = load_draft(out, target=target)
    assert check_pair(target.config, draft, info=info, target=target) == []


# ---------------------------------------------------------------------------- structured results
def test_run_checks_reports_everything_without_raising(target):
    draft = tiny_draft(tiny_target(vocab_size=80), ids=(2, 4, 5, 9))
    checks = run_checks(target.config, draft, algorithm="eagle")
    errors = {c.field for c in checks if c.status == "fail"}
    assert {"algorithm", "vocab_size", "aux_layer_ids"} <= errors
    assert any(c.status == "warn" and c.field == "aux_layer_ids count" for c in checks)
    assert all(c.status in ("pass", "warn", "fail") and c.message for c in checks)


def test_warnings_are_returned(target):
    draft = tiny_draft(target, ids=(2, 4))
    warnings = check_pair(target.config, draft)
    assert [w.field for w in warnings] == ["aux_layer_ids count"]


def test_algorithm_names():
    assert normalize_algorithm("EAGLE3") == "eagle3" and normalize_algorithm("eagle-2") == "eagle"
    with pytest.raises(InputError, match="use EAGLE3 or EAGLE"):
        normalize_algorithm("medusa")
