"""The launch-line linter on real-looking SGLang, vLLM and llama.cpp lines (no files needed)."""
from __future__ import annotations

import json

import pytest

from eagle3.doctor.cmdline import parse_line
from eagle3.doctor.launch import (DraftFacts, TargetFacts, engine_ids, lint_launch,
                                  read_target_facts, tree_consistency)

# The incident: an EAGLE-3 draft for a DeepseekV3-based target (61 layers, hidden 7168), trained on
# inputs of layers 2, 30, 58, stored SpecForge-style as eagle_config [1, 29, 57].
KIMI_DRAFT = DraftFacts("eagle3", (2, 30, 58), 163840, 32000,
                        {"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 32000,
                         "num_hidden_layers": 1,
                         "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57],
                                          "use_aux_hidden_state": True}})
KIMI = TargetFacts(61, 163840, 7168)
INCIDENT = r"""
# decode node
SGLANG_ENABLE_SPEC_V2=1 python3 -m sglang.launch_server \
    --model-path moonshotai/Kimi-K2.5 --tp 8 --trust-remote-code \
    --speculative-algo EAGLE \
    --speculative-draft-model lightseekorg/kimi-k2.5-eagle3 \
    --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4 \
    --mem-fraction-static 0.85 --host 0.0.0.0 --port 30000
"""
LLAMA_DRAFT = DraftFacts("eagle3", (2, 16, 29), 128256, 32000,
                         {"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 32000,
                          "num_hidden_layers": 1,
                          "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}})
LLAMA = TargetFacts(32, 128256, 4096)
# the same draft as `eagle3 export` writes it: the ids also at the top level, in vLLM's numbering
LLAMA_DRAFT_EXPORTED = DraftFacts("eagle3", (2, 16, 29), 128256, 32000, {
    **LLAMA_DRAFT.config, "eagle_aux_hidden_state_layer_ids": [2, 16, 29]})


def statuses(checks, name):
    return [c.status for c in checks if c.name == name]


def only(checks, name):
    found = [c for c in checks if c.name == name]
    assert len(found) == 1, [(c.name, c.status) for c in checks]
    return found[0]


def test_the_incident_line_fails_on_the_algorithm_flag():
    checks = lint_launch(INCIDENT, KIMI_DRAFT, KIMI)
    algo = only(checks, "launch.sglang.algorithm")
    assert algo.status == "fail" and algo.fix == "use --speculative-algorithm EAGLE3"
    assert "[2, 30, 58]" in algo.message and "zero" in algo.message
    assert only(checks, "launch.sglang.layer_ids").status == "pass"   # ids themselves are right
    assert any("chain" in c.message for c in checks if c.name == "launch.sglang.tree")


def test_the_incident_line_without_draft_facts_still_warns():
    algo = only(lint_launch(INCIDENT), "launch.sglang.algorithm")
    assert algo.status == "warn" and "EAGLE3" in algo.fix


def test_a_correct_sglang_line_passes():
    line = ("python3 -m sglang.launch_server --model meta-llama/Llama-3.1-8B-Instruct "
            "--speculative-algorithm EAGLE3 --speculative-draft-model-path "
            "jamesliu1/sglang-EAGLE3-Llama-3.1-Instruct-8B --speculative-num-steps 5 "
            "--speculative-eagle-topk 8 --speculative-num-draft-tokens 32 --mem-fraction 0.6 "
            "--cuda-graph-max-bs 2 --dtype float16")
    checks = lint_launch(line, LLAMA_DRAFT, LLAMA)
    assert all(c.status == "pass" for c in checks), [(c.name, c.message) for c in checks]


def test_ambiguous_prefix_is_refused_like_argparse():
    line = ("python -m sglang.launch_server --model-path m --speculative-algorithm EAGLE3 "
            "--speculative-draft d")
    checks = lint_launch(line, LLAMA_DRAFT, LLAMA)
    opt = only(checks, "launch.sglang.option")
    assert opt.status == "fail" and "--speculative-draft-model-path" in opt.message
    assert only(checks, "launch.sglang.draft_path").status == "fail"


@pytest.mark.parametrize("spec,status,method", [
    (('{"method": "eagle3", "model": "RedHatAI/Llama-3.1-8B-Instruct-speculator.eagle3", '
      '"num_speculative_tokens": 3}'), "pass", "eagle3"),
    (('{"method": "eagle", "model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", '
      '"num_speculative_tokens": 3}'), "fail", "eagle"),
    ('{"model": "yuhuili/EAGLE-LLaMA3.1-Instruct-8B", "num_speculative_tokens": 5}', "fail",
     "'eagle-' -> eagle"),
    ('{"model": "/models/llama-eagle3-draft", "num_speculative_tokens": 5}', "pass", "eagle3"),
    ('{"model": "/models/my-draft", "num_speculative_tokens": 5}', "fail", "draft_model"),
])
def test_vllm_method_explicit_and_guessed(spec, status, method):
    line = f"vllm serve meta-llama/Llama-3.1-8B-Instruct --speculative-config '{spec}' -tp 1"
    check = only(lint_launch(line, LLAMA_DRAFT, LLAMA), "launch.vllm.method")
    assert check.status == status and method in check.message
    if status == "fail":
        assert '"method": "eagle3"' in check.fix


def test_vllm_dotted_old_and_broken_spellings():
    dotted = ("vllm serve m --speculative-config.method eagle3 --speculative-config.model d "
              "--speculative_config.num_speculative_tokens 4")
    assert all(c.status == "pass" for c in lint_launch(dotted, LLAMA_DRAFT_EXPORTED, LLAMA))
    old = ("python -m vllm.entrypoints.openai.api_server --model m --speculative-model "
           "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B --num-speculative-tokens 3")
    checks = lint_launch(old, LLAMA_DRAFT, LLAMA)
    assert statuses(checks, "launch.vllm.speculative_config") == ["warn"]
    assert only(checks, "launch.vllm.method").status == "pass"
    no_n = "vllm serve m --speculative-config '{\"method\": \"eagle3\", \"model\": \"d\"}'"
    assert only(lint_launch(no_n), "launch.vllm.num_speculative_tokens").status == "fail"
    broken = "vllm serve m --speculative-config '{method: eagle3}'"
    assert statuses(lint_launch(broken), "launch.vllm.speculative_config") == ["fail"]
    plain = "vllm serve m --max-model-len 4096"
    assert statuses(lint_launch(plain), "launch.vllm.speculative_config") == ["fail"]


def test_vllm_reads_a_lone_eagle_config_raw():
    """A SpecForge draft with custom ids only in eagle_config: vLLM takes them as input ids."""
    custom = DraftFacts("eagle3", (4, 16, 30), 128256, 32000, {
        "draft_vocab_size": 32000, "num_hidden_layers": 1,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [3, 15, 29]}})
    line = ("vllm serve m --speculative-config "
            "'{\"method\": \"eagle3\", \"model\": \"d\", \"num_speculative_tokens\": 3}'")
    ids = only(lint_launch(line, custom, LLAMA), "launch.vllm.layer_ids")
    assert ids.status == "fail" and "[4, 16, 30]" in ids.fix
    assert "captures inputs of layers [3, 15, 29]" in ids.message


def test_llama_cpp_server_and_convert_lines():
    line = ("python llama.cpp/convert_hf_to_gguf.py ./kimi-eagle3 --outfile kimi-eagle3.gguf && "
            "llama-server -m kimi.gguf -md kimi-eagle3.gguf --spec-type draft-simple --draft-max 8")
    checks = lint_launch(line, KIMI_DRAFT, KIMI)
    assert only(checks, "launch.llama.cpp-convert.target_dir").status == "fail"
    assert only(checks, "launch.llama.cpp.spec_type").fix == "use --spec-type draft-eagle3"
    assert "--spec-draft-n-max" in only(checks, "launch.llama.cpp.option").fix
    ok = "llama-server -m t.gguf -md d.gguf --spec-type draft-eagle3 --spec-draft-n-max 0"
    assert only(lint_launch(ok, KIMI_DRAFT, KIMI), "launch.llama.cpp.tree").status == "fail"


def test_not_an_engine_line():
    assert only(lint_launch("python serve.py --port 8000"), "launch.engine").status == "fail"


def test_engine_views_of_the_same_config():
    cfg = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}}
    assert engine_ids("sglang", cfg, 32).ids == (2, 16, 29)
    assert engine_ids("vllm", cfg, 32).ids == (1, 15, 28)            # taken raw: one layer early
    cfg = {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}         # output ids written top-level
    assert engine_ids("vllm", cfg, 32).ids == (1, 15, 28)            # read as inputs: off by one
    assert engine_ids("llama.cpp", cfg, 32).ids == (1, 15, 28)
    assert engine_ids("sglang", cfg, 32).ids == (2, 16, 29)


def specforge_dir(tmp_path, ids) -> str:
    """A SpecForge-layout draft config on disk: the ids only in eagle_config (output of layer i)."""
    path = tmp_path / "draft"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 32000, "num_hidden_layers": 1,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(ids)}}))
    return str(path)


def test_vllm_fails_a_specforge_draft_one_layer_early(tmp_path):
    """Trained on inputs [2, 15, 27] (stored [1, 14, 26]); vLLM 0.32-0.33 captures [1, 14, 26]."""
    draft = specforge_dir(tmp_path, [1, 14, 26])
    line = ("vllm serve TARGET --speculative-config "
            f"'{{\"method\": \"eagle3\", \"model\": \"{draft}\", \"num_speculative_tokens\": 3}}'")
    ids = only(lint_launch(line, None, TargetFacts(30, 49152, 576)), "launch.vllm.layer_ids")
    assert ids.status == "fail", ids
    assert "[1, 14, 26]" in ids.message and "[2, 15, 27]" in ids.message
    assert "--format speculators" in ids.fix
    assert "top-level eagle_aux_hidden_state_layer_ids = [2, 15, 27]" in ids.fix
    sglang = (f"python -m sglang.launch_server --model-path TARGET --speculative-algorithm EAGLE3 "
              f"--speculative-draft-model-path {draft}")
    assert only(lint_launch(sglang, None, TargetFacts(30, 49152, 576)),
                "launch.sglang.layer_ids").status == "pass"          # SGLang adds 1


def test_vllm_serves_a_speculators_checkpoint_by_itself(tmp_path):
    path = tmp_path / "spec"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
        "eagle_aux_hidden_state_layer_ids": [2, 16, 29],
        "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": "meta/llama"},
                               "proposal_methods": [{"speculative_tokens": 3}]}}))
    checks = lint_launch(f"vllm serve {path}", None, LLAMA)
    assert only(checks, "launch.vllm.speculative_config").status == "pass"
    assert only(checks, "launch.vllm.method").status == "pass"
    assert only(checks, "launch.vllm.layer_ids").status == "pass"


def test_tree_rules():
    assert [c.status for c in tree_consistency("t", 5, 4, 8)] == ["pass"]
    assert [c.status for c in tree_consistency("t", 2, 2, 12)] == ["fail"]   # 6 candidates max
    assert [c.status for c in tree_consistency("t", 6, 2, 4)] == ["warn"]    # steps never verified
    assert [c.status for c in tree_consistency("t", 3, 1, 4)] == ["warn"]    # a chain


def test_parse_handles_continuations_env_and_chains():
    cmds = parse_line("A=1 B=2 nohup python -m sglang.launch_server --model-path x \\\n"
                      "  --speculative-algorithm=EAGLE3 ; vllm serve y --speculative_config '{}'")
    assert [c.engine for c in cmds] == ["sglang", "vllm"]
    assert cmds[0].options == {"model": "x", "algorithm": "EAGLE3"}
    assert cmds[1].positionals == ("y",) and cmds[1].options["speculative_config"] == "{}"


@pytest.mark.real
def test_packaged_gguf_target_is_read_from_its_metadata():
    from eagle3.runtime.assets import default_target_gguf
    gguf = str(default_target_gguf())
    facts = read_target_facts(gguf)
    assert (facts.num_layers, facts.vocab_size, facts.hidden_size) == (30, 49152, 576)
    line = f"llama-server -m {gguf} -md d.gguf --spec-type draft-eagle3"
    mismatch = only(lint_launch(line, KIMI_DRAFT, KIMI), "launch.llama.cpp.target")
    assert mismatch.status == "fail" and "(30, 576, 49152)" in mismatch.message


# ---------------------------------------------------------------------------- Eagle 3.1 norms
EAGLE31_CONFIG = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                  "draft_vocab_size": 32000, "norm_before_fc": True, "norm_output": True,
                  "eagle_aux_hidden_state_layer_ids": [2, 16, 29]}
EAGLE31_DRAFT = DraftFacts("eagle3", (2, 16, 29), 128256, 32000, EAGLE31_CONFIG, None, True, True)
VLLM_31 = ("vllm serve meta-llama/Llama-3.1-8B-Instruct --speculative-config "
           "'{\"method\": \"eagle3\", \"model\": \"/models/d-eagle3\", \"num_speculative_tokens\": 3}'")
SGLANG_31 = ("python -m sglang.launch_server --model-path meta-llama/Llama-3.1-8B-Instruct "
             "--speculative-algorithm EAGLE3 --speculative-draft-model-path /models/d "
             "--speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4")


@pytest.mark.parametrize("line,versions,status,words", [
    (VLLM_31, {"vllm": "0.32.0"}, "pass", "vLLM 0.32.0 runs norm_before_fc=true and norm_output=true"),
    (VLLM_31, {"vllm": "0.21.3"}, "fail", "0.21.3 ignores"),
    (VLLM_31, None, "warn", "runs them from 0.22"),
    (SGLANG_31, None, "fail", "SGLang does not run these norms"),
    ("llama-server -m t.gguf -md d.gguf --spec-type draft-eagle3 --spec-draft-n-max 3", None, "fail",
     "llama.cpp does not run these norms"),
])
def test_an_eagle31_draft_needs_an_engine_that_runs_its_norms(line, versions, status, words):
    engine = line.split()[0].replace("llama-server", "llama.cpp").replace("python", "sglang")
    check = only(lint_launch(line, EAGLE31_DRAFT, LLAMA, versions), f"launch.{engine}.eagle31_norms")
    assert check.status == status and words in check.message, check.message
    if status != "pass":
        assert "vLLM >= 0.22" in check.fix and "retrain without norm_before_fc / norm_output" in check.fix


def test_eagle31_norms_the_config_does_not_carry_fail_on_vllm():
    draft = DraftFacts("eagle3", (2, 16, 29), 128256, 32000, {**EAGLE31_CONFIG, "norm_output": False},
                       None, True, True)
    check = only(lint_launch(VLLM_31, draft, LLAMA, {"vllm": "0.32"}), "launch.vllm.eagle31_norms")
    assert check.status == "fail" and "does not set norm_output" in check.message


def test_eagle31_norms_are_read_from_a_config_without_draft_facts(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(EAGLE31_CONFIG))
    line = VLLM_31.replace("/models/d-eagle3", str(tmp_path))
    check = only(lint_launch(line, None, LLAMA, {"vllm": "0.21"}), "launch.vllm.eagle31_norms")
    assert check.status == "fail"
    # SpecForge's norm_output means the final norm: not an Eagle 3.1 switch
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA_DRAFT_EXPORTED.config, "norm_output": True}))
    assert not [c for c in lint_launch(line, None, LLAMA) if c.name == "launch.vllm.eagle31_norms"]


def test_a_plain_draft_gets_no_norm_check():
    assert not [c for c in lint_launch(VLLM_31, LLAMA_DRAFT_EXPORTED, LLAMA) if "eagle31" in c.name]


def test_engine_versions_flag():
    from eagle3.doctor.cli import engine_versions
    from eagle3.errors import InputError
    assert engine_versions(["vllm=0.32.0", "sglang=0.5.3"]) == {"vllm": "0.32.0", "sglang": "0.5.3"}
    for bad in ("vllm", "tgi=1.0", "vllm=latest"):
        with pytest.raises(InputError, match="--engine-version"):
            engine_versions([bad])
