"""Exports for SGLang / vLLM / llama.cpp: read back, ids in each engine's numbering, launch commands."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagle3.export.cli import export_main
from eagle3.export.writer import export_draft, launch_lines
from eagle3.draft.formats import load_draft, save_draft
from eagle3.models.target import TargetFacts

from test_formats import DEFAULT_IDS, TARGET_HF, edit_config, tiny_draft, tiny_target


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture()
def target_dir(tmp_path) -> Path:
    """A local target directory: export and launch lines only read its config.json."""
    path = tmp_path / "target"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(TARGET_HF))
    return path


def config_of(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


# ---------------------------------------------------------------------------- export_draft
@pytest.mark.parametrize("fmt", ["specforge", "speculators"])
def test_export_reads_back(target, tmp_path, fmt):
    draft = tiny_draft(target)
    result = export_draft(draft, tmp_path / fmt, fmt, target.config, target_path="t")
    assert (result.format, result.info.format, result.info.aux_layer_ids) == (fmt, fmt, DEFAULT_IDS)
    loaded, _ = load_draft(result.path, target=target)
    assert torch.equal(loaded.lm_head.weight, draft.lm_head.weight)


def test_export_refuses_a_broken_pair(target, tmp_path):
    from eagle3.errors import ContractError
    with pytest.raises(ContractError, match="aux_layer_ids"):
        export_draft(tiny_draft(target, ids=(2, 4, 9)), tmp_path / "x", "specforge",
                     target.config)
    assert not (tmp_path / "x").exists()


def test_export_bf16(target, tmp_path):
    result = export_draft(tiny_draft(target), tmp_path / "bf", "speculators",
                          target.config, dtype=torch.bfloat16)
    assert config_of(result.path)["torch_dtype"] == "bfloat16"


@pytest.mark.parametrize("ids", [DEFAULT_IDS, (1, 3, 6)])
@pytest.mark.parametrize("fmt", ["specforge", "speculators"])
def test_every_engine_reads_the_trained_ids_from_our_export(target, tmp_path, fmt, ids):
    """engines.py's readings of each export: every engine that loads the layout captures `ids`
    (the default ids too: vLLM would take a lone eagle_config list raw, one layer early)."""
    from eagle3.engines import ENGINES, engine_reading
    path = save_draft(tiny_draft(target, ids=ids), tmp_path / fmt, fmt, target.config)
    config = config_of(path)
    readers = [e for e in ENGINES.values() if fmt in e.layouts]
    assert readers
    for engine in readers:
        assert engine_reading(engine, config, DEFAULT_IDS).ids == ids, engine.label


# ---------------------------------------------------------------------------- export_main
def test_export_main_writes_both_layouts(target, target_dir, tmp_path, capsys):
    src = save_draft(tiny_draft(target), tmp_path / "src", "eagle", target.config)
    rc = export_main(["--draft", str(src), "--out", str(tmp_path / "out"), "--model", str(target_dir),
                      "--depth", "3", "--top-k", "2", "--num-draft-tokens", "6"])
    out = capsys.readouterr().out
    assert rc == 0
    sf, sp = config_of(tmp_path / "out/specforge"), config_of(tmp_path / "out/speculators")
    assert sf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert sf["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # else vLLM reads eagle_config raw
    assert sp["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert sp["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert sp["speculators_config"]["verifier"]["name_or_path"] == str(target_dir)
    assert "--speculative-num-draft-tokens 6" in out and "--spec-draft-n-max 3" in out
    assert str(tmp_path / "out/speculators") in out  # vLLM is pointed at the speculators export


def test_export_takes_generate_flag_names_and_keeps_the_old_ones():
    from eagle3.export.cli import parse_args
    new = parse_args(["--draft", "d", "--out", "o", "--model", "m", "--top-k", "2", "--depth", "3"])
    old = parse_args(["--draft", "d", "--out", "o", "--target", "m", "--topk", "2", "--num-steps", "3"])
    assert vars(new) == vars(old) and (new.model, new.top_k, new.depth) == ("m", 2, 3)


def test_export_main_custom_ids_top_level_for_vllm_and_llama_cpp(target, target_dir, tmp_path, capsys):
    src = save_draft(tiny_draft(target, ids=(1, 3, 6)), tmp_path / "src", "specforge", target.config)
    assert export_main(["--draft", str(src), "--out", str(tmp_path / "o"), "--target",
                        str(target_dir), "--format", "specforge"]) == 0
    hf = config_of(tmp_path / "o")
    assert hf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 5]  # SGLang: output
    assert hf["eagle_aux_hidden_state_layer_ids"] == [1, 3, 6]                  # vLLM, llama.cpp: input
    assert "WRONG LAYERS" not in capsys.readouterr().out


def test_export_main_reports_contract_errors(target_dir, tmp_path, capsys):
    other = tiny_target(vocab_size=80)
    src = save_draft(tiny_draft(other), tmp_path / "src", "specforge", other.config)
    rc = export_main(["--draft", str(src), "--out", str(tmp_path / "o"), "--target", str(target_dir)])
    assert rc == 2 and "vocab" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_export_main_algorithm_flag_must_match(target, target_dir, tmp_path, capsys):
    src = save_draft(tiny_draft(target), tmp_path / "src", "specforge", target.config)
    rc = export_main(["--draft", str(src), "--out", str(tmp_path / "o"), "--target", str(target_dir),
                      "--algorithm", "EAGLE"])
    assert rc == 2 and "--speculative-algorithm EAGLE3" in capsys.readouterr().err


# ---------------------------------------------------------------------------- launch lines
def test_launch_lines(target, target_dir, tmp_path):
    draft_dir = save_draft(tiny_draft(target), tmp_path / "d", "specforge", target.config)
    lines = launch_lines(draft_dir, target_dir, num_steps=4, topk=3, num_draft_tokens=10)
    sglang = shlex.split(lines.sglang)
    assert sglang[:3] == ["python", "-m", "sglang.launch_server"]
    flags = dict(zip(sglang[3::2], sglang[4::2]))
    assert flags == {"--model-path": str(target_dir), "--speculative-algorithm": "EAGLE3",
                     "--speculative-draft-model-path": str(draft_dir), "--speculative-num-steps": "4",
                     "--speculative-eagle-topk": "3", "--speculative-num-draft-tokens": "10"}
    vllm = shlex.split(lines.vllm)
    assert vllm[:3] == ["vllm", "serve", str(target_dir)] and vllm[3] == "--speculative-config"
    assert json.loads(vllm[4]) == {"method": "eagle3", "model": str(draft_dir),
                                   "num_speculative_tokens": 4}
    convert, convert_target, serve = (shlex.split(x) for x in lines.llama_cpp)
    assert convert[1].endswith("convert_hf_to_gguf.py") and convert[2] == str(draft_dir)
    assert convert[3:5] == ["--target-model-dir", str(target_dir)]
    assert convert_target[2] == str(target_dir)
    assert serve[0] == "llama-server" and serve[serve.index("-md") + 1] == convert[-1]
    assert serve[serve.index("--spec-type") + 1] == "draft-eagle3"


def test_launch_lines_with_a_target_gguf(target, target_dir, tmp_path):
    draft_dir = save_draft(tiny_draft(target), tmp_path / "d", "specforge", target.config)
    lines = launch_lines(draft_dir, target_dir, target_gguf="/m/t.gguf")
    assert len(lines.llama_cpp) == 2 and "-m /m/t.gguf" in lines.llama_cpp[1]


def test_launch_lines_warn_about_ids_only_in_eagle_config(target, target_dir, tmp_path):
    draft_dir = save_draft(tiny_draft(target, ids=(1, 3, 6)), tmp_path / "d", "specforge",
                           target.config)
    edit_config(draft_dir, lambda hf: hf.pop("eagle_aux_hidden_state_layer_ids"))  # a foreign export
    notes = " ".join(launch_lines(draft_dir, target_dir).notes)
    assert "WRONG LAYERS" in notes and "[2, 4, 5] instead of [1, 3, 6]" in notes


def test_launch_lines_four_layers_and_speculators(target, target_dir, tmp_path):
    draft_dir = save_draft(tiny_draft(target, ids=(1, 3, 5, 6)), tmp_path / "d", "speculators",
                           target.config)
    notes = " ".join(launch_lines(draft_dir, target_dir).notes)
    assert "4 captured layers" in notes and "give it the specforge export" in notes


def test_launch_lines_eagle1(target, target_dir, tmp_path):
    draft_dir = save_draft(tiny_draft(target, algorithm="eagle", draft_vocab=64), tmp_path / "d", "eagle")
    lines = launch_lines(draft_dir, target_dir, topk=1, num_steps=3)
    assert "--speculative-algorithm EAGLE " in lines.sglang
    assert "--speculative-num-draft-tokens 4" in lines.sglang  # a chain: steps + 1
    assert json.loads(shlex.split(lines.vllm)[4])["method"] == "eagle"
    assert lines.llama_cpp == () and any("llama.cpp has no EAGLE-1/2" in n for n in lines.notes)


# ---------------------------------------------------------------------------- llama.cpp's own converter
LLAMA_CPP = os.environ.get("EAGLE3_LLAMA_CPP_DIR")


@pytest.mark.real
@pytest.mark.skipif(not LLAMA_CPP, reason=(
    "set EAGLE3_LLAMA_CPP_DIR to a llama.cpp checkout (e.g. vendor/llama.cpp of the llama-cpp-python "
    "0.3.36 sdist; its converter also needs sentencepiece, add its location with "
    "EAGLE3_EXTRA_PYTHONPATH) to run its convert_hf_to_gguf.py on our exports"))
@pytest.mark.parametrize("fmt", ["specforge", "speculators"])
def test_llama_cpp_converter_reads_our_exports(tmp_path, fmt):
    """llama.cpp must record the ids we trained on (it reads only top-level ids) and d2t as ids."""
    from eagle3.models.config import ModelConfig
    from eagle3.runtime.loader import resolve_model
    from eagle3.draft.model import DraftConfig, Eagle3Draft
    lcpp, src = Path(LLAMA_CPP), resolve_model(None)
    sys.path.insert(0, str(lcpp / "gguf-py"))
    import gguf
    cfg = ModelConfig.from_hf(config_of(src.hf_dir))
    draft = Eagle3Draft(DraftConfig.for_target(cfg, draft_vocab_size=2048, aux_layer_ids=(1, 15, 27)))
    used = torch.randperm(cfg.vocab_size)[:2048].sort().values
    draft.d2t.copy_(used - torch.arange(2048))
    draft.t2d.zero_()
    draft.t2d[used] = True
    ddir = save_draft(draft, tmp_path / fmt, fmt, TargetFacts.of(cfg, str(src.hf_dir)))
    paths = [str(lcpp / "gguf-py"), os.environ.get("EAGLE3_EXTRA_PYTHONPATH", "")]
    proc = subprocess.run([sys.executable, str(lcpp / "convert_hf_to_gguf.py"), str(ddir),
                           "--target-model-dir", str(src.hf_dir), "--outfile", str(tmp_path / "d.gguf")],
                          capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, paths))})
    assert proc.returncode == 0, proc.stderr[-2000:]
    reader = gguf.GGUFReader(str(tmp_path / "d.gguf"))
    field = reader.fields["eagle3.target_layers"]
    assert [int(field.parts[i][0]) for i in field.data] == [1, 15, 27]
    d2t = next(t for t in reader.tensors if t.name == "d2t")
    assert torch.equal(torch.from_numpy(d2t.data.astype("int64")), used)


# ---------------------------------------------------------------------------- the real target
@pytest.mark.real
def test_real_smollm2_export(tmp_path, capsys):
    """A draft for the packaged SmolLM2 (30 layers): SGLang ids 1, 14, 26 = input ids 2, 15, 27."""
    from eagle3.models.config import ModelConfig
    from eagle3.runtime.loader import resolve_model
    from eagle3.draft.model import DraftConfig, Eagle3Draft
    src = resolve_model(None)
    cfg = ModelConfig.from_hf(config_of(src.hf_dir))
    draft = Eagle3Draft(DraftConfig.for_target(cfg, draft_vocab_size=2048))
    draft.t2d[2048:] = False  # draft ids 0..2047 = target ids 0..2047 (d2t all zero)
    start = save_draft(draft, tmp_path / "d", "eagle", cfg)
    assert export_main(["--draft", str(start), "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert config_of(tmp_path / "o/specforge")["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == \
        [1, 14, 26]
    assert config_of(tmp_path / "o/speculators")["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    assert f"-m {src.gguf}" in out and "--speculative-algorithm EAGLE3" in out
