"""A draft's weights as 4-bit codes with one-byte inputs (`--draft-weights q4`): the quantizer, the
kernel's one-digit path, and the choice's checks. The output identity with a q4 draft is in
test_spec_engine (test_q4_draft_weights_keep_greedy_identity)."""
from __future__ import annotations

import pytest
import torch

from eagle3 import kernels
from eagle3.layouts import q4_draft_unavailable, resolve_draft_weights
from eagle3.errors import InputError
from eagle3.runtime.quant import quantize_q4

from spec_helpers import tiny_draft, tiny_target

needs_vnni = pytest.mark.skipif(not kernels.integer_dots(), reason="no AVX512-VNNI (or EAGLE3_VNNI=0)")


def test_quantize_q4_puts_each_weight_on_its_blocks_grid():
    torch.manual_seed(0)
    w = torch.randn(24, 128) * torch.logspace(-3, 1, 4).repeat_interleave(32)   # blocks of 4 scales
    w[5, 32:64] = 0.3                                                           # a constant block
    q = quantize_q4(w)
    assert q.codes.dtype == torch.uint8 and int(q.codes.max()) <= 15
    assert q.int8_inputs and q.kind == 4 and q.block == 32
    assert torch.equal(q.scales.half().float(), q.scales)                       # fp16 records
    err = (q.dequantize() - w).abs().view(24, 4, 32).amax(-1)
    # half a step, plus what rounding the least value to fp16 moves (2^-11 of it)
    assert (err <= q.scales / 2 + q.offsets.abs() * 2 ** -11 + 1e-12).all()
    assert err[5, 1] <= 0.3 * 2 ** -11
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_q4(torch.randn(4, 48))


def one_byte_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x with each block of 32 rounded to a byte under its largest (as the kernel rounds), times w."""
    blocks = x.view(x.shape[0], -1, 32)
    top = blocks.abs().amax(-1, keepdim=True)
    rounded = torch.round(blocks * (127.0 / top)) * (top / 127.0)
    return rounded.view_as(x).double() @ w.double().T


@needs_vnni
def test_one_digit_is_the_product_with_inputs_rounded_to_a_byte_and_rows_stand_alone():
    out_features, in_features = 72, 512
    torch.manual_seed(1)
    q = quantize_q4(torch.randn(out_features, in_features))
    packed = kernels.pack_quant([q.kernel_part()], True, one_digit=True)
    x = torch.randn(19, in_features)
    x[3, 40:72] *= 1e4
    y = kernels.quant_linear()(x, packed, None, out_features)
    ref = one_byte_product(x, q.dequantize())
    assert (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    exact = x.double() @ q.dequantize().double().T
    assert (y.double() - exact).abs().max() > 1e-4 * exact.abs().max()         # it does round
    alone = torch.cat([kernels.quant_linear()(x[i:i + 1].contiguous(), packed, None, out_features)
                       for i in range(len(x))])
    assert torch.equal(alone, y)


@pytest.mark.skipif(kernels.quant_linear() is None, reason=f"no kernels: {kernels.why()}")
def test_one_digit_needs_integer_dots():
    q = quantize_q4(torch.randn(16, 64))
    with pytest.raises(ValueError, match="one_digit"):
        kernels.pack_quant([q.kernel_part()], False, one_digit=True)


def test_auto_takes_q4_where_it_runs_and_an_explicit_q4_elsewhere_names_the_fix(monkeypatch):
    draft = tiny_draft(tiny_target(0))
    if q4_draft_unavailable(draft) is None:
        assert resolve_draft_weights("auto", draft) == "q4"
    monkeypatch.setattr(kernels, "integer_dots", lambda: False)
    assert "AVX512-VNNI" in q4_draft_unavailable(draft) or kernels.quant_linear() is None
    assert resolve_draft_weights("auto", draft) in ("bf16", "fp32")
    with pytest.raises(InputError, match="draft_weights=q4: .*use draft_weights=bf16 or fp32"):
        resolve_draft_weights("q4", draft)
    from eagle3.draft.inference import build_draft_layout
    with pytest.raises(InputError, match="draft_weights=q4"):      # never codes on another path unsaid
        build_draft_layout(draft, quantize=True)


@needs_vnni
def test_a_draft_of_odd_widths_is_not_q4():
    draft = tiny_draft(tiny_target(0, hidden=48, intermediate=96))
    assert "input width 48" in q4_draft_unavailable(draft)
    assert resolve_draft_weights("auto", draft) != "q4"
    with pytest.raises(InputError, match="not a multiple of the 32-input blocks"):
        resolve_draft_weights("q4", draft)


@needs_vnni
@pytest.mark.skipif(not kernels.state().bf16, reason="no AVX512-BF16 small-M kernel here")
def test_a_q4_drafts_blocks_past_its_rows_take_the_bf16_kernel():
    """Blocks of up to Q4_ROWS rows run the codes; larger ones up to SMALL_ROWS the bf16 small-M
    kernel (the codes' per-block float steps cost more there), past it oneDNN."""
    import copy

    from eagle3.draft.inference import Q4_ROWS, build_draft_layout
    from eagle3.runtime.backend import SMALL_ROWS
    draft = tiny_draft(tiny_target(0))
    q4 = build_draft_layout(copy.deepcopy(draft), torch.bfloat16, quantize=True)
    bf16 = build_draft_layout(copy.deepcopy(draft), torch.bfloat16)
    a, b = q4.lm_head, bf16.lm_head
    assert a.one_digit and a.small_rows == Q4_ROWS < SMALL_ROWS
    few, more = torch.randn(Q4_ROWS, a.in_features), torch.randn(Q4_ROWS + 1, a.in_features)
    assert torch.equal(a(few), kernels.quant_linear()(few, a.small_weight, None, a.out_features))
    assert torch.equal(a(more), b(more))
    assert not torch.equal(a(few), b(few))


@pytest.mark.real
def test_info_says_what_auto_draft_weights_run(capsys):
    from eagle3.cli import main
    assert main(["info"]) == 0
    (line,) = [l for l in capsys.readouterr().out.splitlines() if l.startswith("--draft-weights auto")]
    assert line.split()[2] == resolve_draft_weights("auto")


@pytest.mark.lossless
@pytest.mark.parametrize("algorithm,layers", [("eagle3", 1), ("eagle3", 2), ("eagle", 1)])
def test_a_q4_draft_of_any_layout_keeps_speculation_identical_to_plain(algorithm, layers):
    """build_layouts with draft_weights=q4 (auto's choice where it runs) over EAGLE-3 drafts with
    extra layers and EAGLE-1 drafts (fc with a bias): the output is plain decoding's."""
    from eagle3.layouts import build_layouts
    from eagle3.generate import Engine
    from eagle3.sampling import SamplingParams
    from eagle3.speculative.tree import SpecParams
    from spec_helpers import StubTokenizer
    model = tiny_target(0)
    draft = tiny_draft(model, algorithm=algorithm, layers=layers)
    choice = "q4" if q4_draft_unavailable(draft) is None else "auto"
    target, drafter = build_layouts(model, draft, "fp32", choice)
    if choice == "q4":
        assert drafter.weights_name == "q4" and all(l.one_digit for l in drafter.linears)
    plain = Engine(target, StubTokenizer(), max_model_len=128)
    spec = Engine(target, StubTokenizer(), draft=drafter, spec=SpecParams(3, 3, 6, 0.0), max_model_len=128)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    for prompt in ([1, 2, 3, 4], [9, 8, 7, 9, 8, 7, 9, 8]):
        assert spec.generate(prompt_ids=prompt, params=params).token_ids == \
            plain.generate(prompt_ids=prompt, params=params).token_ids
