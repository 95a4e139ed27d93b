"""Features captured by vLLM into the feature store: both capture layouts (vLLM's example connector,
ours), the layer-id contract, the numbering check on the target itself, and (slow, vLLM venv)
our connector inside vLLM."""
import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from eagle3.bench.vllm_peer import default_python
from eagle3.engines import IDS_KEY
from eagle3.errors import ContractError, LoadError
from eagle3.train.dryrun import synthetic_samples
from eagle3.train.store import PartKey, StorePart, build_part, target_fingerprint
from eagle3.train.tiny import tiny_target
from eagle3.train.features import target_features
from eagle3.train.vllm_features import (capture_source, check_layer_ids, read_capture, run_vllm_capture,
                                        vllm_layer_ids)
from eagle3.train.vllm_rows import rows_metadata, split_rows

VLLM_PYTHON = default_python()      # $EAGLE3_VLLM_PYTHON, else the repository's .venv-vllm


@pytest.fixture(scope="module")
def target():
    torch.set_num_threads(1)
    return tiny_target()


@pytest.fixture(scope="module")
def samples(target):
    return synthetic_samples(target, 5)


def engine_states(target, sample, layer_ids, shift: int = 0) -> torch.Tensor:
    """[T, n, H] as vLLM captures them: the stream entering layer i (i + shift here), and for id L
    the last layer's output before the final norm (read at the norm's input)."""
    L = target.config.num_layers
    seen = []
    hook = target.norm.register_forward_pre_hook(lambda m, a: seen.append(a[0][0].clone()))
    try:
        aux_ids = [i + shift for i in layer_ids if i != L]
        aux = target_features(target, [sample], aux_ids)[0].aux
    finally:
        hook.remove()
    h = target.config.hidden_size
    slots = [aux[:, k * h:(k + 1) * h] for k in range(len(aux_ids))]
    if L in layer_ids:
        slots.append(seen[0])
    return torch.stack(slots, 1)


def write_example(path: Path, target, sample, layer_ids, shift: int = 0) -> Path:
    """A file in the layout of vLLM's ExampleHiddenStatesConnector (its _submit_async_write):
    hidden_states [T, n, H], token_ids [T]."""
    save_file({"hidden_states": engine_states(target, sample, layer_ids, shift).contiguous(),
               "token_ids": sample.ids.clone()}, str(path))
    return path


def write_ours(path: Path, target, sample, layer_ids) -> Path:
    rows = split_rows(engine_states(target, sample, layer_ids), list(layer_ids), target.config.num_layers)
    save_file({**rows, "token_ids": sample.ids.clone()}, str(path),
              metadata=rows_metadata(list(layer_ids), target.config.num_layers, target.config.hidden_size,
                                     torch.float32, "tiny"))
    return path


def key_of(target):
    return PartKey(target_fingerprint(target), tuple(target.config.default_aux_layer_ids), "float32")


@pytest.mark.parametrize("layout", ["example", "ours"])
def test_captured_store_equals_our_own_capture(target, samples, tmp_path, layout):
    aux = target.config.default_aux_layer_ids
    ids = vllm_layer_ids(aux, target.config.num_layers)
    write = write_example if layout == "example" else write_ours
    files = [write(tmp_path / f"{i}.safetensors", target, s, ids) for i, s in enumerate(samples)]
    given = ids if layout == "example" else None
    part = build_part(target, samples, key_of(target), tmp_path / "vllm", shard_size=2,
                      features=capture_source(target, files, aux, given), source="vllm")
    ours = build_part(target, samples, key_of(target), tmp_path / "ours", shard_size=2)
    assert part.manifest["source"] == "vllm"
    for i in range(len(samples)):
        a, b = part.get(i), ours.get(i)
        torch.testing.assert_close(a.aux, b.aux, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(a.hidden, b.hidden, rtol=1e-5, atol=1e-4)
        assert torch.equal(a.next_ids, b.next_ids)
    StorePart(tmp_path / "vllm", key_of(target), samples)      # opens as any store part


def test_example_files_need_their_layer_ids(target, samples, tmp_path):
    ids = vllm_layer_ids(target.config.default_aux_layer_ids, target.config.num_layers)
    path = write_example(tmp_path / "0.safetensors", target, samples[0], ids)
    with pytest.raises(LoadError, match="do not record their layer ids"):
        read_capture(path, target.config.num_layers)
    with pytest.raises(ContractError, match=r"hidden_states shape"):
        read_capture(path, target.config.num_layers, ids[:-1])


@pytest.mark.parametrize("ids,fix", [
    ([1, 3, 4, 7], "'output of layer i' ids"),        # SpecForge numbering
    ([2, 4, 5], "lacks 8"),                           # no teacher state
    ([2, 3, 5, 8], "train with aux_layer_ids = [2, 3, 5]"),
])
def test_a_layer_id_list_that_is_not_the_drafts_raises_naming_the_fix(target, samples, tmp_path, ids, fix):
    path = write_example(tmp_path / "0.safetensors", target, samples[0], ids)
    cap = read_capture(path, target.config.num_layers, ids)
    with pytest.raises(ContractError) as e:
        check_layer_ids(cap, target, target.config.default_aux_layer_ids)
    assert e.value.field == f"vLLM {IDS_KEY}"
    assert e.value.expected == [2, 4, 5, 8] and str(ids) in str(e.value.found)
    assert fix in e.value.fix


def test_states_one_layer_off_are_caught_on_the_target(target, samples, tmp_path):
    """The file says [2, 4, 5, 8] but holds the streams of layers 3, 5, 6 (an engine numbering by
    output): only the numeric check against the target can see it."""
    aux = target.config.default_aux_layer_ids
    ids = vllm_layer_ids(aux, target.config.num_layers)
    files = [write_example(tmp_path / f"{i}.safetensors", target, s, ids, shift=1)
             for i, s in enumerate(samples)]
    with pytest.raises(ContractError, match=r"closest to our layer 3") as e:
        build_part(target, samples, key_of(target), tmp_path / "p",
                   features=capture_source(target, files, aux, ids))
    assert "-1" in e.value.fix


def test_states_of_another_model_are_refused(target, samples, tmp_path):
    other = tiny_target(seed=5)
    aux = target.config.default_aux_layer_ids
    ids = vllm_layer_ids(aux, target.config.num_layers)
    files = [write_example(tmp_path / f"{i}.safetensors", other, s, ids) for i, s in enumerate(samples)]
    with pytest.raises(ContractError, match="not this target's residual streams"):
        build_part(target, samples, key_of(target), tmp_path / "p",
                   features=capture_source(target, files, aux, ids))


def test_captures_of_other_conversations_raise(target, samples, tmp_path):
    aux = target.config.default_aux_layer_ids
    ids = vllm_layer_ids(aux, target.config.num_layers)
    files = [write_example(tmp_path / f"{i}.safetensors", target, s, ids) for i, s in enumerate(samples)]
    with pytest.raises(ContractError, match="capture token_ids"):
        build_part(target, samples, key_of(target), tmp_path / "p",
                   features=capture_source(target, files[::-1], aux, ids))


def test_the_connector_module_imports_nothing_of_eagle3_but_the_row_layout():
    import ast
    src = Path(__file__).parents[1] / "eagle3" / "train" / "vllm_connector.py"
    own = [n for n in ast.walk(ast.parse(src.read_text()))
           if isinstance(n, ast.ImportFrom) and (n.level or (n.module or "").startswith("eagle3"))]
    assert sorted(n.module for n in own) == ["engines", "vllm_rows"]
    engines = Path(__file__).parents[1] / "eagle3" / "engines.py"
    assert {n.module for n in ast.walk(ast.parse(engines.read_text())) if isinstance(n, ast.ImportFrom)
            and n.level} == {"errors"}
    rows = Path(__file__).parents[1] / "eagle3" / "train" / "vllm_rows.py"
    mods = {a.name for n in ast.walk(ast.parse(rows.read_text())) if isinstance(n, ast.Import) for a in n.names}
    assert mods <= {"json", "torch"}


@pytest.mark.slow
@pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason="no vLLM venv (bash scripts/vllm_env.sh)")
def test_our_connector_in_vllm_writes_rows_equal_to_our_capture(tmp_path):
    """A tiny random target as an HF checkpoint in vLLM's CPU build (fp32, eager), our connector.
    head_dim 64: vLLM's CPU attention has no kernel for the tiny target's 8."""
    from eagle3.bench.vllm_peer import VllmSettings, child_env
    from eagle3.models.config import ModelConfig
    from eagle3.models.llama import LlamaModel
    from eagle3.train.tiny import TINY_TARGET
    cfg = {**TINY_TARGET, "hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1,
           "model_type": "llama", "rms_norm_eps": 1e-6, "torch_dtype": "float32", "bos_token_id": 1}
    target = LlamaModel(ModelConfig.from_hf(cfg)).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in target.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    samples = synthetic_samples(target, 4)
    model_dir = tmp_path / "tiny"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(cfg))
    save_file({f"model.{k}": v.contiguous() for k, v in target.state_dict().items() if k != "lm_head.weight"},
              str(model_dir / "model.safetensors"))
    aux = target.config.default_aux_layer_ids
    ids = vllm_layer_ids(aux, target.config.num_layers)
    work = Path(tempfile.mkdtemp(prefix="e3v", dir="/tmp"))   # vLLM's IPC socket paths: < 108 bytes
    s = VllmSettings(python=VLLM_PYTHON, work_dir=work, threads=1, dtype="float32",
                     enforce_eager=True, max_model_len=64, chain_depth=1)
    try:
        files = run_vllm_capture(VLLM_PYTHON, child_env(s, "c"), model_dir, [x.ids.tolist() for x in samples],
                                 ids, tmp_path / "captures", dtype="float32", max_model_len=64,
                                 skip_tokenizer_init=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert read_capture(files[0], target.config.num_layers).layer_ids == tuple(ids)   # recorded
    part = build_part(target, samples, key_of(target), tmp_path / "vllm",
                      features=capture_source(target, files, aux), source="vllm")
    ours = build_part(target, samples, key_of(target), tmp_path / "ours")
    for i in range(len(samples)):
        torch.testing.assert_close(part.get(i).aux, ours.get(i).aux, rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(part.get(i).hidden, ours.get(i).hidden, rtol=1e-3, atol=1e-3)
