"""One owner for each fact: engine conventions (engines.py), default capture ids (models/config.py), the
tree shape rule (speculative/tree.py), the check result (checks.py), a target's facts (models/target.py).

The source scans below fail when a second copy of a fact is written somewhere else in the package."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

import eagle3
from eagle3.checks import Check
from eagle3.doctor.launch import tree_consistency
from eagle3.engines import (ENGINES, IDS_KEY, LAYOUTS, NESTED_INPUT, NESTED_OUTPUT, SGLANG, TOP_INPUT,
                            VLLM, engine_reading, vllm_method)
from eagle3.errors import InputError
from eagle3.models.config import ModelConfig, default_capture_ids
from eagle3.models.target import TargetFacts
from eagle3.speculative.tree import SpecParams, max_candidates

PACKAGE = Path(eagle3.__file__).parent


def sources() -> dict[str, str]:
    return {str(p.relative_to(PACKAGE)): p.read_text() for p in PACKAGE.rglob("*.py")}


def owners(pattern: str) -> set[str]:
    return {name for name, text in sources().items() if re.search(pattern, text)}


# ---------------------------------------------------------------------------- one owner
def test_the_ids_key_is_written_once():
    assert owners(re.escape(IDS_KEY)) == {"engines.py"}


def test_the_default_ids_rule_is_written_once():
    assert owners(r"\(\s*2,\s*[\w.]+\s*//\s*2,") == {"models/config.py"}


def test_the_tree_capacity_rule_is_written_once():
    assert owners(r"\+\s*\(\s*\w+\s*-\s*1\s*\)\s*\*\s*\w+\s*\*\s*\w+") == {"speculative/tree.py"}


def test_one_check_type_and_one_target_description():
    assert owners(r"(?m)^class Check\b") == {"checks.py"}
    assert owners(r"(?m)^class (TargetFacts|TargetInfo)\b") == {"models/target.py"}
    assert not owners(r"\bModelConfig\(") - {"models/config.py"}   # no placeholder configs


# ---------------------------------------------------------------------------- the facts themselves
@pytest.mark.parametrize("layers", [8, 30, 32, 61])
def test_every_description_of_a_target_has_the_same_defaults(layers):
    hf = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32,
          "intermediate_size": 64, "num_hidden_layers": layers, "num_attention_heads": 4}
    facts = TargetFacts.from_hf(hf)
    assert facts == TargetFacts.of(ModelConfig.from_hf(hf))
    assert facts.default_aux_layer_ids == ModelConfig.from_hf(hf).default_aux_layer_ids == \
        default_capture_ids(layers) == (2, layers // 2, layers - 3)


def test_tree_shape_rule_is_shared_by_the_doctor_and_the_engine():
    for steps in range(1, 5):
        for topk in range(2, 5):
            for tokens in range(2, 40):
                doctor_fails = any(c.status == "fail" for c in tree_consistency("t", steps, topk, tokens))
                try:
                    SpecParams(topk, steps, tokens, min_prob=0.0)
                    ours_refuses = False
                except InputError:
                    ours_refuses = True
                assert doctor_fails == ours_refuses == (tokens - 1 > max_candidates(topk, steps))


def test_status_has_one_vocabulary():
    check = Check("x", "pass", field="f", found=1, expected=1)
    assert check.status == "pass" and check.message == "f: 1"
    for old in ("ok", "error"):          # one vocabulary: the contract's old spellings are refused
        with pytest.raises(ValueError, match="not in"):
            Check("x", old)
    with pytest.raises(ValueError):
        Check("x", "bad")
    assert check.as_dict() == {"name": "x", "status": "pass", "message": "f: 1", "fix": ""}


# ---------------------------------------------------------------------------- the engine table
def test_where_each_engine_reads_the_ids():
    specforge = {"eagle_config": {IDS_KEY: [1, 14, 26]}}       # SpecForge: output of layer i
    both = {**specforge, IDS_KEY: [2, 15, 27]}                  # our specforge export
    defaults = default_capture_ids(30)
    assert engine_reading(SGLANG, specforge, defaults).ids == (2, 15, 27)       # +1
    assert engine_reading(VLLM, specforge, defaults).ids == (1, 14, 26)         # raw
    assert engine_reading(ENGINES["llama.cpp"], specforge, defaults).ids == defaults
    for engine in ENGINES.values():
        if "specforge" in engine.layouts and engine.reads:
            assert engine_reading(engine, both, defaults).ids == (2, 15, 27), engine.label
    assert VLLM.reads == (TOP_INPUT, NESTED_INPUT) and SGLANG.reads[0] == NESTED_OUTPUT
    assert LAYOUTS["specforge"].writes == (NESTED_OUTPUT, TOP_INPUT)


def test_vllm_method_names():
    assert set(VLLM.other_methods) >= {"suffix", "ngram", "dflash", "mtp", "draft_model"}
    assert vllm_method({"model": "yuhuili/EAGLE-LLaMA3-Instruct-8B"})[0] == "eagle"
    assert vllm_method({"model": "x/Qwen3-8B_eagle3"})[0] == "eagle3"
    assert vllm_method({"model": "x/draft"})[0] == "draft_model"
    assert vllm_method({"method": "EAGLE3", "model": "x"}) == ("eagle3", "set explicitly")
