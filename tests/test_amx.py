"""bf16 linears on AMX tiles (csrc/linear_amx.cpp run_amx): the choice, its gates, and a layout
that keeps one path per weight. The kernel's numbers (rounded matmul, row stability over threads
and blocks of up to 40 rows) are in test_kernels.py, parametrised over both bf16 paths."""
import re
import shutil
from pathlib import Path

import pytest
import torch

from eagle3 import kernels

needs_amx = pytest.mark.skipif(not kernels.amx(), reason=f"no AMX tiles here: {kernels.why()}")
AMX_OPS = ("tdpbf16ps", "tdpbssd", "tileloadd", "tilezero", "tilestored", "ldtilecfg", "tilerelease")
built = pytest.mark.skipif(kernels.small_linear(torch.float32) is None,
                           reason=f"small-M kernels not available here: {kernels.why()}")


def _tiny_layout(hidden=64, intermediate=128):
    from eagle3.runtime.target import build_target
    from spec_helpers import tiny_target
    return build_target(tiny_target(layers=2, hidden=hidden, intermediate=intermediate),
                        torch.bfloat16, row_stable=True)


@needs_amx
def test_a_bf16_layout_runs_every_linear_on_amx_and_says_so():
    layout = _tiny_layout()
    assert all(l.amx for l in layout.linears), [l.amx for l in layout.linears]
    assert layout.weights_name == "torch.bfloat16, amx"
    assert all(layer.one_call is not None for layer in layout.layers)
    assert "+ amx" in kernels.why()


@needs_amx
def test_a_width_amx_cannot_tile_keeps_that_weight_on_the_vector_path_and_the_layer_on_one():
    """hidden 48: q/k/v, o and gate/up read 48 inputs (not a multiple of 32), down reads 64. Each
    weight keeps one path for its life, and a layer whose linears disagree is not one call (its
    LayerWeights carries a single flag)."""
    layout = _tiny_layout(hidden=48, intermediate=64)
    layer = layout.layers[0]
    assert [l.amx for l in layer.linears] == [False, False, False, True]
    assert layer.one_call is None
    out = layout(torch.tensor([[1, 2, 3]]), torch.arange(3), layout.new_cache(8))
    assert torch.isfinite(out.logits).all()


@needs_amx
def test_amx_logits_stay_as_close_to_fp32_as_the_vector_paths(monkeypatch):
    from eagle3.runtime.target import build_target
    from spec_helpers import tiny_target
    model = tiny_target(layers=2)
    ids = torch.randint(0, 32, (1, 12), generator=torch.Generator().manual_seed(3))
    ref = model(ids, torch.arange(12), model.new_cache(12)).logits.double()
    amx = build_target(model, torch.bfloat16, row_stable=True)
    monkeypatch.setattr(kernels, "_STATE", kernels.state()._replace(amx=False))
    vec = build_target(model, torch.bfloat16, row_stable=True)
    assert not any(l.amx for l in vec.linears) and all(l.amx for l in amx.linears)
    err = {}
    for name, layout in (("amx", amx), ("vector", vec)):
        err[name] = (layout(ids, torch.arange(12), layout.new_cache(12)).logits.double() - ref).abs().max().item()
    assert err["amx"] <= 2 * err["vector"] + 1e-6, err


def test_the_switch_and_the_cpu_flags_gate_amx(monkeypatch):
    monkeypatch.setenv("EAGLE3_AMX", "0")
    monkeypatch.setattr(kernels, "_STATE", None)
    assert not kernels.amx() and "amx" not in kernels.why()
    monkeypatch.delenv("EAGLE3_AMX")
    flags = kernels.cpu_flags() - {"amx_bf16"}
    monkeypatch.setattr(kernels, "cpu_flags", lambda: flags)
    monkeypatch.setattr(kernels, "_STATE", None)
    assert not kernels.amx()
    if kernels.small_linear(torch.bfloat16) is not None:
        layout = _tiny_layout()
        assert not any(l.amx for l in layout.linears) and layout.weights_name == "torch.bfloat16"
        with pytest.raises(ValueError, match="AMX tiles are not in use here.*pass amx=False"):
            kernels.small_linear(torch.bfloat16, amx=True)


@needs_amx
def test_amx_refuses_a_width_it_cannot_tile_naming_the_fix():
    w, x = torch.randn(32, 48), torch.randn(2, 48).bfloat16()
    kernel = kernels.small_linear(torch.bfloat16, amx=True)
    with pytest.raises(RuntimeError, match="multiple of 32, got 48; pass amx=False"):
        kernel(x, kernels.pack_weight(w, torch.bfloat16), None, 32)


@built
@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump (binutils) not installed")
def test_amx_instructions_sit_only_in_the_attributed_functions():
    """No -mamx-* for the build: a CPU without AMX runs every other kernel. The library holds the
    tile code wherever it is built, so this reads it on any CPU, AMX or not."""
    from test_kernel_build import _functions_with
    holders = _functions_with(Path(kernels.state().module.__file__), AMX_OPS)
    assert holders, "linear_bf16's tile multiplies are gone"
    assert all(re.search(r"\bamx_(block|configure|int8_configure|nibble_tile)\(", f) for f in holders), sorted(holders)
    assert not any("amx" in flag for flag in kernels.CFLAGS)
