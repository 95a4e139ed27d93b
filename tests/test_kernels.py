"""The small-M CPU linear kernels: values, row stability, and their use in PackedLinear."""
import pytest
import torch

from eagle3 import kernels
from eagle3.models.packed import STABLE_ROWS, PackedLinear
from eagle3.spec.tree import MAX_DRAFT_TOKENS

needs = pytest.mark.skipif(kernels.small_linear(torch.float32) is None,
                           reason=f"small-M kernels not available here: {kernels.why()}")
needs_bf16 = pytest.mark.skipif(kernels.small_linear(torch.bfloat16) is None,
                                reason=f"bf16 small-M kernel not available here: {kernels.why()}")


def _case(out_features, in_features, rows, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g) * 0.05
    x = torch.randn(rows, in_features, generator=g)
    b = torch.randn(out_features, generator=g)
    return w, x, b


@needs
@pytest.mark.parametrize("shape", [(70, 33), (64, 96), (960, 576)])
@pytest.mark.parametrize("rows", [1, 3, 8, 13, 20])
def test_fp32_kernel_matches_matmul(shape, rows):
    w, x, b = _case(*shape, rows)
    kernel, packed = kernels.small_linear(torch.float32), kernels.pack_weight(w, torch.float32)
    ref = x.double() @ w.double().T
    assert torch.allclose(kernel(x, packed, None, shape[0]).double(), ref, atol=1e-4, rtol=1e-5)
    assert torch.allclose(kernel(x, packed, b, shape[0]).double(), ref + b.double(), atol=1e-4, rtol=1e-5)


@needs_bf16
@pytest.mark.parametrize("shape", [(70, 34), (960, 576)])
@pytest.mark.parametrize("rows", [1, 5, 8, 17])
def test_bf16_kernel_matches_rounded_matmul(shape, rows):
    w, x, b = _case(*shape, rows)
    kernel, packed = kernels.small_linear(torch.bfloat16), kernels.pack_weight(w, torch.bfloat16)
    xb = x.bfloat16()
    ref = xb.double() @ w.bfloat16().double().T + b.double()     # exact products, fp32 sums
    got = kernel(xb, packed, b, shape[0]).double()
    assert torch.allclose(got, ref, atol=1e-3 * shape[1] ** 0.5, rtol=1e-4)


@needs
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_result_independent_of_the_block_and_threads(dtype):
    if kernels.small_linear(dtype) is None:
        pytest.skip(kernels.why())
    w, x, b = _case(200, 576, 19)
    x = x.to(dtype)
    kernel, packed = kernels.small_linear(dtype), kernels.pack_weight(w, dtype)
    block = kernel(x, packed, b, 200)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for r in range(19):
                assert torch.equal(kernel(x[r:r + 1].contiguous(), packed, b, 200), block[r:r + 1])
            assert torch.equal(kernel(x[3:11].contiguous(), packed, b, 200), block[3:11])
    finally:
        torch.set_num_threads(threads)


@needs
def test_packed_linear_uses_the_kernel_for_small_blocks_only():
    lin = torch.nn.Linear(576, 100, bias=True)
    packed = PackedLinear(lin.weight, lin.bias)
    assert packed.small is not None
    for rows in (1, 4, 8, 9, 40):
        x = torch.randn(1, rows, 576)
        assert torch.allclose(packed(x), lin(x), atol=1e-4)
    stable = PackedLinear(lin.weight, lin.bias, small_rows=STABLE_ROWS)
    x = torch.randn(1, 40, 576)
    assert torch.equal(stable(x)[:, 7:8], stable(x[:, 7:8]))


def test_stable_rows_cover_every_verify_block():
    assert STABLE_ROWS == MAX_DRAFT_TOKENS


def test_kernels_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("EAGLE3_KERNELS", "0")
    st = kernels._build()
    assert st.module is None and "EAGLE3_KERNELS=0" in st.reason


def test_bf16_pack_refuses_odd_width():
    with pytest.raises(ValueError, match="even input width"):
        kernels.pack_weight(torch.zeros(4, 5), torch.bfloat16)
