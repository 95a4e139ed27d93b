"""eagle3 doctor: one passing pair, and each documented mistake reported as a failure with its fix.

The target is a tiny Llama built by hand so that a draft can really be "right": layers 0, 1 and
3.. are identities (o_proj, down_proj = 0), layer 2 scrambles the residual with a random MLP, and
lm_head makes the greedy next token f(t) for a fixed permutation f. The input to layer 2 is then
the embedding E[t]; the input to layers 3.. is a scrambled R[t]. A draft whose fc reads the first
captured state and whose lm_head maps E[t] to f(f(t)) is correct with ids (2, 4, 5) and useless
with ids shifted by one, exactly like a trained draft behind the off-by-one.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from eagle3.doctor import doctor_main, run_doctor
from eagle3.doctor.offline import ProbeSettings
from eagle3.models.config import ModelConfig
from eagle3.models.llama import LlamaModel
from eagle3.draft.model import DraftConfig, Eagle3Draft
from eagle3.draft.formats import save_draft

V, H, L = 64, 32, 8
IDS = (2, 4, 5)            # default ids for 8 layers (input convention)
PROBE = ProbeSettings(max_new_tokens=12, top_k=2, depth=3, num_draft_tokens=5, prompts=("a", "b"))


pytestmark = pytest.mark.usefixtures("one_thread")


def hf_config(vocab: int = V, hidden: int = H, layers: int = L, rope_theta: float = 10000.0) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
            "hidden_size": hidden, "intermediate_size": 64, "num_hidden_layers": layers,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
            "rms_norm_eps": 1e-6, "rope_theta": rope_theta, "tie_word_embeddings": False}


def perm(vocab: int = V) -> torch.Tensor:
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(7))


def bigram_target(vocab: int = V, hidden: int = H, layers: int = L) -> LlamaModel:
    torch.manual_seed(0)
    model = LlamaModel(ModelConfig.from_hf(hf_config(vocab, hidden, layers)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()
        model.embed_tokens.weight.copy_(F.normalize(torch.randn(vocab, hidden), dim=-1))
        mlp = model.layers[2].mlp
        for w in (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight):
            w.normal_(0.0, 0.5)
        out = model(torch.arange(vocab)[:, None], torch.zeros(1, dtype=torch.long),
                    model.new_cache(1, batch=vocab))
        f_inv = torch.argsort(perm(vocab))                  # f_inv[u] = t with f(t) = u
        model.lm_head.weight.copy_(F.normalize(out.hidden[:, 0], dim=-1)[f_inv] * 8)
    return model.eval()


def save_target(model: LlamaModel, path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    (path / "config.json").write_text(json.dumps(hf_config(cfg.vocab_size, cfg.hidden_size,
                                                           cfg.num_layers)))
    state = {("" if k.startswith("lm_head") else "model.") + k: v.contiguous()
             for k, v in model.state_dict().items()}
    save_file(state, str(path / "model.safetensors"))
    return path


def copy_draft(target: LlamaModel, ids=IDS, good: bool = True, draft_vocab=None) -> Eagle3Draft:
    """fc reads the first captured state; lm_head maps E[t] to f(f(t)) (random weights if not good)."""
    torch.manual_seed(1)
    cfg = DraftConfig.for_target(target.config, aux_layer_ids=ids, draft_vocab_size=draft_vocab)
    draft = Eagle3Draft(cfg)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if "norm" not in name and "embed" not in name:
                p.normal_(0.0, 0.3)
        if good and draft_vocab is None:
            h = target.config.hidden_size
            draft.midlayer.self_attn.o_proj.weight.zero_()
            draft.midlayer.mlp.down_proj.weight.zero_()
            draft.fc.weight.zero_()
            draft.fc.weight[:, :h] = torch.eye(h)
            f_inv = torch.argsort(perm(target.config.vocab_size))
            draft.lm_head.weight.copy_(target.embed_tokens.weight[f_inv[f_inv]] * 8)
    draft.set_embedding(target.embed_tokens.weight)
    return draft.eval()


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return save_target(bigram_target(), tmp_path_factory.mktemp("t") / "target")


@pytest.fixture(scope="module")
def target(target_dir):
    from eagle3.runtime.loader import load_model
    return load_model(target_dir)


def write_draft(tmp: Path, draft: Eagle3Draft, name: str, fmt: str = "specforge",
                target=None, edit=None) -> Path:
    out = save_draft(draft, tmp / name, fmt, target.config if target is not None else None)
    if edit is not None:
        cfg = json.loads((out / "config.json").read_text())
        edit(cfg)
        (out / "config.json").write_text(json.dumps(cfg))
    return out


def sglang(target_dir, draft_dir, algo="EAGLE3", extra="--speculative-num-steps 3 "
           "--speculative-eagle-topk 2 --speculative-num-draft-tokens 6") -> str:
    return (f"python -m sglang.launch_server --model-path {target_dir} --speculative-algorithm "
            f"{algo} --speculative-draft-model-path {draft_dir} {extra} --port 30000")


def vllm(target_dir, draft_dir, method="eagle3") -> str:
    spec = {"method": method, "model": str(draft_dir), "num_speculative_tokens": 3}
    if method is None:
        spec.pop("method")
    return f"vllm serve {target_dir} --speculative-config '{json.dumps(spec)}' --max-model-len 128"


def convert(target_dir, draft_dir) -> str:
    return (f"python convert_hf_to_gguf.py {draft_dir} --target-model-dir {target_dir} "
            "--outfile draft.gguf --outtype f16")


def by_name(report, name: str):
    found = [c for c in report.checks if c.name == name]
    assert found, f"no check {name}: {[c.name for c in report.checks]}"
    return found


def assert_fails(report, name: str, fix_has: str) -> None:
    bad = [c for c in by_name(report, name) if c.status == "fail"]
    assert bad, f"{name} did not fail:\n{report.table()}"
    assert any(fix_has in c.fix for c in bad), f"fix of {name} lacks {fix_has!r}: {bad}"
    assert not report.ok and report.exit_code == 1


# ---------------------------------------------------------------------------- the passing case
def test_the_right_pair_passes_everything(tmp_path, target_dir, target):
    draft_dir = write_draft(tmp_path, copy_draft(target), "good", target=target)
    lines = [sglang(target_dir, draft_dir), vllm(target_dir, draft_dir),
             convert(target_dir, draft_dir)]
    report = run_doctor(str(target_dir), draft_dir, lines, settings=PROBE)
    assert report.ok, report.table()
    assert report.probe["lossless"] and report.probe["tau"] >= 1.5
    names = {c.name for c in report.checks}
    assert {"target.load", "draft.format", "draft.layer_ids", "contract.fc_width", "probe.tau",
            "launch.sglang.algorithm", "launch.vllm.method", "launch.llama.cpp.layer_ids"} <= names
    assert json.loads(report.to_json())["ok"] is True


def test_cli_exit_codes_and_json(tmp_path, target_dir, target, capsys):
    good = write_draft(tmp_path, copy_draft(target), "good", target=target)
    assert doctor_main(["--target", str(target_dir), "--draft", str(good), "--no-probe",
                        "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["failures"] == 0
    assert doctor_main(["--target", str(target_dir), "--draft", str(good), "--no-probe",
                        "--launch", sglang(target_dir, good, algo="EAGLE")]) == 1
    out = capsys.readouterr().out
    assert "FAIL    launch.sglang.algorithm" in out and "fix: use --speculative-algorithm EAGLE3" in out


# ---------------------------------------------------------------------------- failing cases
def test_eagle3_draft_served_as_eagle_on_sglang(tmp_path, target_dir, target):
    draft_dir = write_draft(tmp_path, copy_draft(target), "d", target=target)
    report = run_doctor(str(target_dir), draft_dir, sglang(target_dir, draft_dir, algo="EAGLE"),
                        probe=False)
    assert_fails(report, "launch.sglang.algorithm", "--speculative-algorithm EAGLE3")
    assert "zero" in by_name(report, "launch.sglang.algorithm")[0].message


def test_running_the_draft_with_algorithm_eagle_names_eagle3(tmp_path, target_dir, target):
    draft_dir = write_draft(tmp_path, copy_draft(target), "d", target=target)
    report = run_doctor(str(target_dir), draft_dir, probe=False, algorithm="eagle")
    assert_fails(report, "draft.algorithm", "EAGLE3")


def test_vllm_method_eagle_and_guessed_method(tmp_path, target_dir, target):
    draft_dir = write_draft(tmp_path, copy_draft(target), "d", target=target)
    report = run_doctor(str(target_dir), draft_dir, [vllm(target_dir, draft_dir, "eagle"),
                                                     vllm(target_dir, draft_dir, None)], probe=False)
    checks = by_name(report, "launch.vllm.method")
    assert [c.status for c in checks] == ["fail", "fail"]
    assert all('"method": "eagle3"' in c.fix for c in checks)
    assert "draft_model" in checks[1].message        # no method, no 'eagle3' in the path


def test_missing_draft_path_on_the_line(tmp_path, target_dir, target):
    draft_dir = write_draft(tmp_path, copy_draft(target), "d", target=target)
    line = f"python -m sglang.launch_server --model-path {target_dir} --speculative-algorithm EAGLE3"
    report = run_doctor(str(target_dir), draft_dir, line, probe=False)
    assert_fails(report, "launch.sglang.draft_path", "--speculative-draft-model-path")


def test_custom_ids_only_in_eagle_config_are_dropped_by_llama_cpp_and_vllm(tmp_path, target_dir,
                                                                         target):
    draft = copy_draft(target, ids=(1, 4, 6))
    draft_dir = write_draft(tmp_path, draft, "d", target=target,
                            edit=lambda c: c.pop("eagle_aux_hidden_state_layer_ids"))
    report = run_doctor(str(target_dir), draft_dir, [convert(target_dir, draft_dir),
                                                     vllm(target_dir, draft_dir),
                                                     sglang(target_dir, draft_dir)], probe=False)
    assert_fails(report, "launch.llama.cpp.layer_ids", "top-level eagle_aux_hidden_state_layer_ids")
    assert_fails(report, "launch.vllm.layer_ids", "[1, 4, 6]")
    assert by_name(report, "launch.sglang.layer_ids")[0].status == "pass"   # SGLang reads them


def test_vllm_runs_a_specforge_draft_one_layer_early(tmp_path, target_dir, target):
    """A SpecForge-layout draft (ids only in eagle_config, output numbering) trained on the
    defaults [2, 4, 5]: vLLM takes eagle_config [1, 3, 4] raw and captures one layer early."""
    draft_dir = write_draft(tmp_path, copy_draft(target), "d", target=target,
                            edit=lambda c: c.pop("eagle_aux_hidden_state_layer_ids"))
    report = run_doctor(str(target_dir), draft_dir, [vllm(target_dir, draft_dir),
                                                     sglang(target_dir, draft_dir)], probe=False)
    assert_fails(report, "launch.vllm.layer_ids", "--format speculators")
    check = by_name(report, "launch.vllm.layer_ids")[0]
    assert "[1, 3, 4]" in check.message and "trained on [2, 4, 5]" in check.message
    assert "top-level eagle_aux_hidden_state_layer_ids = [2, 4, 5]" in check.fix
    assert by_name(report, "launch.sglang.layer_ids")[0].status == "pass"   # SGLang adds 1


def test_top_level_ids_are_shifted_by_sglang(tmp_path, target_dir, target):
    draft_dir = write_draft(tmp_path, copy_draft(target, ids=(1, 4, 6)), "d", "speculators",
                            target=target)
    report = run_doctor(str(target_dir), draft_dir, sglang(target_dir, draft_dir), probe=False)
    assert_fails(report, "launch.sglang.layer_ids", "eagle_config.eagle_aux_hidden_state_layer_ids"
                                                    " = [0, 3, 5]")
    assert "[2, 5, 7]" in by_name(report, "launch.sglang.layer_ids")[0].message


def test_draft_for_another_vocabulary(tmp_path, target_dir):
    other = bigram_target(vocab=96)
    draft_dir = write_draft(tmp_path, copy_draft(other), "d", target=other)
    report = run_doctor(str(target_dir), draft_dir, vllm(target_dir, draft_dir), probe=False)
    assert_fails(report, "contract.vocab", "vocabulary")
    assert_fails(report, "launch.vllm.vocab", "target it was trained for")


def test_draft_for_another_hidden_size(tmp_path, target_dir):
    other = bigram_target(hidden=48)
    draft_dir = write_draft(tmp_path, copy_draft(other), "d", target=other)
    report = run_doctor(str(target_dir), draft_dir, probe=False)
    assert_fails(report, "contract.hidden", "another target")
    assert_fails(report, "contract.fc_width", "capture exactly the layers")


def test_layer_ids_out_of_range(tmp_path, target_dir, target):
    deeper = bigram_target(layers=12)
    draft_dir = write_draft(tmp_path, copy_draft(deeper, ids=(2, 6, 9)), "d", target=deeper)
    report = run_doctor(str(target_dir), draft_dir, sglang(target_dir, draft_dir), probe=False)
    assert_fails(report, "contract.layer_ids", "this target has 8 layers")
    assert_fails(report, "launch.sglang.layer_ids", "eagle_config")


def test_d2t_maps_outside_the_target_vocabulary(tmp_path, target_dir, target):
    draft = copy_draft(target, draft_vocab=V // 2)
    with torch.no_grad():
        draft.d2t.copy_(torch.arange(V // 2) + 40)          # ids 40..71: past V = 64
    draft_dir = write_draft(tmp_path, draft, "d", target=target)
    report = run_doctor(str(target_dir), draft_dir, probe=False)
    assert_fails(report, "contract.vocab", "another target")


def test_tree_settings_that_cannot_be_built_or_force_a_chain(tmp_path, target_dir, target):
    draft_dir = write_draft(tmp_path, copy_draft(target), "d", target=target)
    too_many = "--speculative-num-steps 2 --speculative-eagle-topk 2 --speculative-num-draft-tokens 12"
    chain = "--speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 8"
    report = run_doctor(str(target_dir), draft_dir, [sglang(target_dir, draft_dir, extra=too_many),
                                                     sglang(target_dir, draft_dir, extra=chain)],
                        probe=False)
    assert_fails(report, "launch.sglang.tree", "--speculative-num-draft-tokens to <= 7")
    warns = [c for c in by_name(report, "launch.sglang.tree") if c.status == "warn"]
    assert any("chain" in c.message for c in warns)
    assert any("resets num_draft_tokens to steps+1 = 4" in c.message for c in warns)


def test_launch_line_serves_another_target(tmp_path, target_dir, target):
    draft_dir = write_draft(tmp_path, copy_draft(target), "d", target=target)
    other_dir = save_target(bigram_target(layers=12), tmp_path / "other")
    report = run_doctor(str(target_dir), draft_dir, sglang(other_dir, draft_dir), probe=False)
    assert_fails(report, "launch.sglang.target", "target it was trained for")


def test_untrained_draft_fails_the_probe_with_causes(tmp_path, target_dir, target):
    draft_dir = write_draft(tmp_path, copy_draft(target, good=False), "d", target=target)
    report = run_doctor(str(target_dir), draft_dir, settings=replace(PROBE, try_shifted_ids=False))
    assert_fails(report, "probe.tau", "off-by-one")
    assert report.probe["tau"] <= 1.1 and report.probe["lossless"]


def test_off_by_one_ids_fail_the_probe_and_name_the_shift(tmp_path, target_dir, target):
    """Trained on inputs of 2, 4, 5 but eagle_config says [2, 4, 5] (read as outputs: +1)."""
    draft = copy_draft(target)
    draft_dir = write_draft(tmp_path, draft, "d", target=target, edit=lambda c: (
        c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=list(IDS)),
        c.pop("eagle_aux_hidden_state_layer_ids", None)))
    report = run_doctor(str(target_dir), draft_dir, settings=PROBE)
    assert any(c.status == "warn" for c in by_name(report, "draft.note"))   # formats' hint
    assert_fails(report, "probe.tau", "eagle_config.eagle_aux_hidden_state_layer_ids = [1, 3, 4]")
    assert "[2, 4, 5]" in by_name(report, "probe.tau")[0].fix


def test_lines_written_by_eagle3_export_lint_clean(tmp_path, target_dir, target):
    from eagle3.export.writer import launch_lines
    for ids in (IDS, (1, 4, 6)):              # default ids, and custom ids every engine must see
        draft_dir = write_draft(tmp_path, copy_draft(target, ids=ids), f"d{ids[0]}", target=target)
        lines = launch_lines(draft_dir, target_dir, num_steps=3, topk=2, num_draft_tokens=6)
        report = run_doctor(str(target_dir), draft_dir, [lines.sglang, lines.vllm,
                                                         " && ".join(lines.llama_cpp)], probe=False)
        assert report.ok, report.table()
        assert {"launch.sglang.layer_ids", "launch.vllm.layer_ids",
                "launch.llama.cpp.layer_ids"} <= {c.name for c in report.checks}


@pytest.mark.real
def test_doctor_on_the_real_target_with_an_untrained_draft(tmp_path, real_model):
    """SmolLM2 (packaged GGUF) + a random-init EAGLE-3 draft: the contract holds, the probe fails."""
    target, tokenizer, _ = real_model
    torch.manual_seed(0)
    draft = Eagle3Draft(DraftConfig.for_target(target.config))
    draft_dir = save_draft(draft, tmp_path / "random", "specforge", target.config)
    line = sglang("HuggingFaceTB/SmolLM2-135M-Instruct", draft_dir, algo="EAGLE")
    report = run_doctor(target, draft_dir, line, tokenizer=tokenizer,
                        settings=ProbeSettings(prompts=("Name three colours.",), max_new_tokens=12))
    assert {c.name for c in report.failures} == {"launch.sglang.algorithm", "probe.tau"}, \
        report.table()
    assert report.probe["tau"] < 1.1 and report.probe["lossless"]
    assert not any(c.status == "fail" for c in report.checks if c.name.startswith("contract."))


def test_eagle1_draft_served_as_eagle3(tmp_path, target_dir, target):
    from eagle3.draft.model import Eagle1Draft
    torch.manual_seed(0)
    draft = Eagle1Draft(DraftConfig.for_target(target.config, algorithm="eagle"))
    draft_dir = write_draft(tmp_path, draft, "e1", "eagle", target=target)
    report = run_doctor(str(target_dir), draft_dir, [sglang(target_dir, draft_dir),
                                                     vllm(target_dir, draft_dir)], probe=False)
    assert "EAGLE-1/2" in by_name(report, "draft.algorithm")[0].message
    assert_fails(report, "launch.sglang.algorithm", "--speculative-algorithm EAGLE (")
    assert_fails(report, "launch.vllm.method", '"method": "eagle"')


def test_doctor_names_the_target_model_and_keeps_target():
    from eagle3.doctor.cli import build_parser
    new = build_parser().parse_args(["--model", "m", "--server", "u", "--served-model-name", "s"])
    old = build_parser().parse_args(["--target", "m", "--server", "u", "--served-model-name", "s"])
    assert vars(new) == vars(old) and (new.model, new.served_model_name) == ("m", "s")
