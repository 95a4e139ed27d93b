"""Bad input gets a clear error, never traceback soup or a silent fallback."""
from __future__ import annotations

import json

import pytest
import torch

from eagle3.errors import InputError, LoadError, UnsupportedError
from eagle3.generate import Engine, SamplingParams
from eagle3.runtime.loader import gguf_to_hf_dir, load_model, resolve_model
from eagle3.testing import FAMILIES, hf_model_from_dict


@pytest.fixture(scope="module")
def saved_tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    hf_model_from_dict(FAMILIES["llama3"]).save_pretrained(path, safe_serialization=True)
    return path


def test_truncated_safetensors(saved_tiny, tmp_path):
    data = (saved_tiny / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    (tmp_path / "config.json").write_text((saved_tiny / "config.json").read_text())
    with pytest.raises(LoadError, match="corrupt or truncated"):
        load_model(tmp_path)


def test_garbage_safetensors(saved_tiny, tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    (tmp_path / "config.json").write_text((saved_tiny / "config.json").read_text())
    with pytest.raises(LoadError, match="corrupt or truncated"):
        load_model(tmp_path)


def test_missing_and_unexpected_keys_and_shapes(saved_tiny, tmp_path):
    from safetensors.torch import load_file, save_file
    state = load_file(str(saved_tiny / "model.safetensors"))
    (tmp_path / "config.json").write_text((saved_tiny / "config.json").read_text())
    missing = {k: v for k, v in state.items() if "layers.1.mlp.up_proj" not in k}
    save_file(missing, str(tmp_path / "model.safetensors"))
    with pytest.raises(LoadError, match="missing key.*layers.1.mlp.up_proj"):
        load_model(tmp_path)
    save_file(dict(state, extra=torch.zeros(2)), str(tmp_path / "model.safetensors"))
    with pytest.raises(LoadError, match="unexpected key 'extra'"):
        load_model(tmp_path)
    bad = dict(state)
    bad["model.norm.weight"] = torch.zeros(7)
    save_file(bad, str(tmp_path / "model.safetensors"))
    with pytest.raises(LoadError, match=r"model.norm.weight.*\(7,\).*\(64,\)"):
        load_model(tmp_path)


def test_unknown_architecture_in_directory(saved_tiny, tmp_path):
    cfg = json.loads((saved_tiny / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedError, match="MambaForCausalLM"):
        load_model(tmp_path)


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"NOPE" + b"\x00" * 64)
    with pytest.raises(LoadError, match="not a GGUF"):
        gguf_to_hf_dir(bad)


@pytest.mark.slow
def test_truncated_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE3_CACHE", str(tmp_path / "cache"))
    real = resolve_model(None).gguf
    bad = tmp_path / "cut.gguf"
    with open(real, "rb") as f:
        bad.write_bytes(f.read(1 << 20))
    with pytest.raises(LoadError, match="cannot read GGUF"):
        gguf_to_hf_dir(bad)


def test_loader_takes_str_paths_like_path_objects(saved_tiny, tmp_path):
    from eagle3.adapters.hf import load_hf_model
    from eagle3.runtime.loader import checkpoint_files, read_hf_config
    by_path, by_str = load_model(saved_tiny), load_model(str(saved_tiny))
    for (name, a), (_, b) in zip(by_path.state_dict().items(), by_str.state_dict().items()):
        assert torch.equal(a, b), name
    assert read_hf_config(str(saved_tiny)) == read_hf_config(saved_tiny)
    assert checkpoint_files(str(saved_tiny)) == checkpoint_files(saved_tiny)
    assert resolve_model(saved_tiny).hf_dir == resolve_model(str(saved_tiny)).hf_dir == saved_tiny
    assert load_hf_model(str(saved_tiny)).config.hidden_size == by_path.config.hidden_size
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"NOPE" + b"\x00" * 64)
    with pytest.raises(LoadError, match="not a GGUF"):
        gguf_to_hf_dir(str(bad))


def test_missing_model_path():
    with pytest.raises(LoadError, match="not found"):
        resolve_model("/nonexistent/model")


@pytest.fixture(scope="module")
def tiny_engine(saved_tiny):
    from eagle3.runtime.loader import load_tokenizer
    tok = load_tokenizer(resolve_model(None).hf_dir)
    return Engine(load_model(saved_tiny), tok, max_model_len=64)


def test_empty_prompt(tiny_engine):
    with pytest.raises(InputError, match="empty prompt"):
        tiny_engine.generate("")
    with pytest.raises(InputError, match="empty prompt"):
        tiny_engine.generate(prompt_ids=[])
    with pytest.raises(InputError, match="messages is empty"):
        tiny_engine.generate(messages=[])


def test_prompt_longer_than_cache(tiny_engine):
    with pytest.raises(InputError, match="exceeds the context"):
        tiny_engine.generate(prompt_ids=[5] * 60, params=SamplingParams(max_new_tokens=10))


def test_bad_sampling_params():
    with pytest.raises(InputError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(InputError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(InputError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
