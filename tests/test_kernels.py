"""The small-M CPU linear kernels: values, row stability, and their use in PackedLinear."""
import contextlib

import pytest
import torch

from eagle3 import kernels
from eagle3.runtime.backend import choose_backend
from eagle3.runtime.linear import PackedLinear
from eagle3.speculative.tree import MAX_DRAFT_TOKENS

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


# the bf16 paths this machine runs: the vector one always, AMX tiles where kernels.amx()
BF16_PATHS = [pytest.param(False, id="vector"),
              pytest.param(True, id="amx", marks=pytest.mark.skipif(not kernels.amx(), reason="no AMX here"))]


@needs_bf16
@pytest.mark.parametrize("amx", BF16_PATHS)
@pytest.mark.parametrize("shape", [(70, 34), (960, 576), (70, 96)])
@pytest.mark.parametrize("rows", [1, 5, 8, 17, 40])
def test_bf16_kernel_matches_rounded_matmul(shape, rows, amx):
    if amx and shape[1] % kernels.AMX_WIDTH:
        pytest.skip("AMX takes input widths that are multiples of 32")
    w, x, b = _case(*shape, rows)
    kernel, packed = kernels.small_linear(torch.bfloat16, amx), kernels.pack_weight(w, torch.bfloat16)
    xb = x.bfloat16()
    ref = xb.double() @ w.bfloat16().double().T + b.double()     # exact products, fp32 sums
    got = kernel(xb, packed, b, shape[0]).double()
    assert torch.allclose(got, ref, atol=1e-3 * shape[1] ** 0.5, rtol=1e-4)


@needs
@pytest.mark.parametrize("dtype,amx", [(torch.float32, False), (torch.bfloat16, False),
                                       pytest.param(torch.bfloat16, True, id="bfloat16-amx", marks=pytest.mark.skipif(
                                           not kernels.amx(), reason="no AMX here"))])
def test_row_result_independent_of_the_block_and_threads(dtype, amx):
    if kernels.small_linear(dtype) is None:
        pytest.skip(kernels.why())
    w, x, b = _case(200, 576, 37)
    x = x.to(dtype)
    kernel, packed = kernels.small_linear(dtype, amx), kernels.pack_weight(w, dtype)
    block = kernel(x, packed, b, 200)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for r in range(37):
                assert torch.equal(kernel(x[r:r + 1].contiguous(), packed, b, 200), block[r:r + 1])
            assert torch.equal(kernel(x[3:11].contiguous(), packed, b, 200), block[3:11])
            assert torch.equal(kernel(x[5:22].contiguous(), packed, b, 200), block[5:22])   # 16 + 1 rows
    finally:
        torch.set_num_threads(threads)


@needs
def test_packed_linear_uses_the_kernel_for_small_blocks_only():
    lin = torch.nn.Linear(576, 100, bias=True)
    packed = PackedLinear(lin.weight, lin.bias, choose_backend("cpu"))
    assert packed.small is not None
    for rows in (1, 4, 8, 9, 40):
        x = torch.randn(1, rows, 576)
        assert torch.allclose(packed(x), lin(x), atol=1e-4)
    stable = PackedLinear(lin.weight, lin.bias, choose_backend("cpu", row_stable=True))
    x = torch.randn(1, 40, 576)
    assert torch.equal(stable(x)[:, 7:8], stable(x[:, 7:8]))


@needs_bf16
def test_a_row_stable_target_verifies_the_largest_admitted_block_like_decoding(one_thread):
    """Every verify block SpecParams admits stays on the row-stable path: a chain of the largest
    admitted size verified in one forward by a bf16 row-stable target (as load_engine packs it)
    gives each row's logits bit for bit as decoding it. (An fp32 target matched here even past
    the kernels' rows, so it could not show a verify block leaving them.)"""
    from spec_helpers import tiny_target
    from eagle3.errors import InputError
    from eagle3.models.layers import tree_block_mask
    from eagle3.models.llama import LlamaModel
    from eagle3.runtime.target import build_target
    from eagle3.speculative.tree import SpecParams
    block = MAX_DRAFT_TOKENS
    SpecParams(top_k=32, depth=2, num_draft_tokens=block)          # admitted (1056 candidates)...
    with pytest.raises(InputError, match="num_draft_tokens"):
        SpecParams(top_k=32, depth=2, num_draft_tokens=block + 1)  # ...and the largest admitted
    prefix = 5
    base = tiny_target(layers=2)
    model = LlamaModel(base.config, max_position=prefix + block)
    model.load_state_dict(base.state_dict())
    model = build_target(model.eval(), torch.bfloat16, row_stable=True)
    ids = torch.randint(0, base.config.vocab_size, (1, prefix + block),
                        generator=torch.Generator().manual_seed(4))
    cache = model.new_cache(prefix + block)
    model(ids[:, :prefix], torch.arange(prefix), cache)
    chain = torch.ones(block, block, dtype=torch.bool).tril()
    verify = model(ids[:, prefix:], torch.arange(prefix, prefix + block), cache,
                   attn_mask=tree_block_mask(prefix, chain)).logits[0]
    cache.truncate(prefix)
    for t in range(block):
        one = model(ids[:, prefix + t:prefix + t + 1], torch.tensor([prefix + t]), cache).logits[0, 0]
        assert torch.equal(one, verify[t]), t


def test_kernels_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("EAGLE3_KERNELS", "0")
    st = kernels._build()
    assert st.module is None and "EAGLE3_KERNELS=0" in st.reason


def test_bf16_pack_refuses_odd_width():
    with pytest.raises(ValueError, match="even input width"):
        kernels.pack_weight(torch.zeros(4, 5), torch.bfloat16)


@needs
def test_fused_rms_norm_matches_and_is_row_stable():
    rms, _ = kernels.fused_ops()
    x, w = torch.randn(7, 576) * 40, torch.rand(576)
    y = rms(x, w, 1e-5)
    assert torch.allclose(y, torch.nn.functional.rms_norm(x, (576,), w, 1e-5), atol=1e-5, rtol=1e-5)
    assert torch.equal(rms(x[4:5].contiguous(), w, 1e-5), y[4:5])


@needs
@pytest.mark.parametrize("inter", [1536, 40])          # 40: a masked tail of 8 lanes
def test_silu_mul_matches_torch_and_is_row_stable(inter):
    """silu(gate) * up from the fused block, within a few ulp of torch's silu for any sign and
    size (no lane overflows at -200 or +200), and a row's bits whatever the block."""
    silu_mul = kernels.state().module.silu_mul
    g = torch.Generator().manual_seed(inter)
    gu = torch.randn(9, 2 * inter, generator=g) * 6
    gu[0, :8] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 88.0, -88.0, 200.0, -200.0])
    gate, up = gu[:, :inter], gu[:, inter:]
    want = torch.nn.functional.silu(gate.double()) * up.double()
    got = silu_mul(gu)
    assert got.shape == (9, inter)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-30)
    assert torch.equal(silu_mul(gu[5:6].contiguous()), got[5:6])
    assert torch.equal(silu_mul(gu.view(3, 3, -1)), got.view(3, 3, -1))
    with pytest.raises(RuntimeError, match="gate_up"):
        silu_mul(torch.zeros(2, 7))


@needs
@pytest.mark.parametrize("head_dim", [64, 128, 24])
def test_fused_attention_matches_fp64_and_rows_are_independent(head_dim):
    from eagle3.runtime.backend import row_stable_attention
    _, attn = kernels.fused_ops()
    g = torch.Generator().manual_seed(head_dim)
    k_buf = torch.randn(2, 2, 90, head_dim, generator=g)       # a cache buffer; the prefix is read
    v_buf = torch.randn(2, 2, 90, head_dim, generator=g)
    q = torch.randn(2, 6, 5, head_dim, generator=g) * 2        # GQA: 3 query heads per KV head
    mask = torch.rand(2, 1, 5, 61, generator=g) > 0.4
    mask[..., 0] = True
    k, v = k_buf[:, :, :61], v_buf[:, :, :61]
    out = attn(q, k, v, mask)
    assert torch.allclose(out, row_stable_attention(q, k, v, mask), atol=2e-6)
    for t in range(5):
        assert torch.equal(attn(q[:, :, t:t + 1].contiguous(), k, v, mask[:, :, t:t + 1].contiguous()),
                           out[:, :, t:t + 1])
    causal = attn(q[:, :, :1].contiguous(), k, v, None)
    assert torch.allclose(causal, row_stable_attention(q[:, :, :1], k, v, None), atol=2e-6)


@needs
@pytest.mark.parametrize("heads,kv_heads,head_dim,rows", [
    (9, 3, 64, 16),       # SmolLM2's group of 3: five rows (15 lanes) a pass
    (14, 2, 64, 13),      # Qwen2.5-0.5B's group of 7: two rows a pass
    (4, 4, 128, 37),      # no GQA, head_dim 128: sixteen rows a pass, and a ragged last pass
    (8, 2, 128, 3),
])
def test_a_block_of_query_rows_in_one_pass_gives_each_row_its_bits_alone(heads, kv_heads, head_dim, rows):
    """A verify block's rows share each key's loads (a zmm lane per row and head). Each lane must add
    exactly as one row alone does (dots16's tree, the sums in key order), whatever the mask, the
    rows around it and the thread count: a verify token then equals one-token decode bit for bit."""
    _, attn = kernels.fused_ops()
    g = torch.Generator().manual_seed(rows)
    S = 150
    k_buf = torch.randn(1, kv_heads, S + 9, head_dim, generator=g)
    v_buf = torch.randn(1, kv_heads, S + 9, head_dim, generator=g)
    k, v = k_buf[:, :, :S], v_buf[:, :, :S]
    q = torch.randn(1, heads, rows, head_dim, generator=g) * 3
    tree = torch.ones(1, 1, rows, S, dtype=torch.bool)       # the context, then a random tree block
    tree[..., S - rows:] = torch.rand(rows, rows, generator=g) > 0.5
    tree[..., S - rows:] &= torch.tril(torch.ones(rows, rows, dtype=torch.bool))
    tree[..., S - rows:] |= torch.eye(rows, dtype=torch.bool)
    scattered = torch.rand(1, 1, rows, S, generator=g) > 0.3   # no context every row shares
    scattered[..., 0] = True
    for mask in (tree, scattered, None):
        for threads in (1, 2):
            with one_thread_count(threads):
                out = attn(q, k, v, mask)
            for t in range(rows):
                alone = attn(q[:, :, t:t + 1].contiguous(), k, v,
                             None if mask is None else mask[:, :, t:t + 1].contiguous())
                assert torch.equal(alone, out[:, :, t:t + 1]), (threads, t)
    from eagle3.runtime.backend import row_stable_attention
    assert torch.allclose(out, row_stable_attention(q, k, v, None), atol=2e-6)


@needs
def test_rows_of_several_sequences_in_one_pass_give_each_row_its_bits_alone():
    """Continuous batching: a pass holds rows of one slot only, and a row sees its own key count."""
    _, attn = kernels.fused_ops()
    g = torch.Generator().manual_seed(5)
    k_buf, v_buf = torch.randn(3, 3, 120, 64, generator=g), torch.randn(3, 3, 120, 64, generator=g)
    slot = torch.tensor([0] * 7 + [2] + [1] * 12 + [0] * 3)
    keys = torch.tensor(list(range(40, 47)) + [9] + list(range(80, 92)) + [5, 6, 7])
    q = torch.randn(1, 9, len(slot), 64, generator=g)
    out = attn(q, k_buf, v_buf, None, slot, keys)
    for t in range(len(slot)):
        s, n = int(slot[t]), int(keys[t])
        alone = attn(q[:, :, t:t + 1].contiguous(), k_buf[s:s + 1, :, :n], v_buf[s:s + 1, :, :n], None)
        assert torch.equal(alone, out[:, :, t:t + 1]), t


@needs
@pytest.mark.parametrize("head_dim", [64, 128, 24])
def test_an_fp16_cache_reads_as_its_fp32_widening_bit_for_bit(head_dim):
    """Attention over fp16 keys and values equals attention over the same values widened to fp32
    (the widening is exact): lone rows, a block's rows sharing a pass, rows of several slots."""
    _, attn = kernels.fused_ops()
    g = torch.Generator().manual_seed(head_dim)
    k16 = (torch.randn(3, 3, 70, head_dim, generator=g) * 4).half()
    v16 = torch.randn(3, 3, 70, head_dim, generator=g).half()
    k32, v32 = k16.float(), v16.float()
    q = torch.randn(3, 9, 6, head_dim, generator=g) * 2
    mask = torch.rand(3, 1, 6, 61, generator=g) > 0.3
    mask[..., 0] = True
    for m in (mask, None):
        for t in (slice(0, 1), slice(0, 6)):
            qt = q[:, :, t].contiguous()
            mt = None if m is None else m[:, :, t].contiguous()
            assert torch.equal(attn(qt, k16[:, :, :61], v16[:, :, :61], mt),
                               attn(qt, k32[:, :, :61], v32[:, :, :61], mt))
    built = kernels.state().module
    slot, keys = torch.tensor([2, 2, 2, 0, 1, 1]), torch.tensor([30, 31, 32, 9, 60, 61])
    rows_q = torch.randn(1, 9, 6, head_dim, generator=g)
    assert torch.equal(built.attention(rows_q, k16, v16, None, slot, keys),
                       built.attention(rows_q, k32, v32, None, slot, keys))
    with pytest.raises(RuntimeError, match="fp32 or fp16"):
        attn(q, k16[:, :, :61], v32[:, :, :61], mask)


@needs
def test_rope_qkv_rounds_into_an_fp16_cache_as_torch_does():
    """The cache write of rope_qkv into fp16 buffers: torch's fp32 -> fp16 rounding of the fp32
    path's values, one sequence's rows and rows of several slots alike; q stays fp32."""
    built = kernels.state().module
    g = torch.Generator().manual_seed(3)
    Hq, Hkv, D, T = 9, 3, 64, 5
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, generator=g) * 30    # some values past fp16's fine steps
    cos, sin = torch.randn(1, 1, T, D, generator=g), torch.randn(1, 1, T, D, generator=g)
    k16, v16 = torch.zeros(2, Hkv, 12, D, dtype=torch.float16), torch.zeros(2, Hkv, 12, D, dtype=torch.float16)
    k32, v32 = torch.zeros(2, Hkv, 12, D), torch.zeros(2, Hkv, 12, D)
    q16 = built.rope_qkv(qkv, cos, sin, k16[:1], v16[:1], 3, Hq, Hkv, None, None)
    q32 = built.rope_qkv(qkv, cos, sin, k32[:1], v32[:1], 3, Hq, Hkv, None, None)
    slot, index = torch.tensor([1, 1, 0, 1, 0]), torch.tensor([7, 8, 0, 9, 1])
    built.rope_qkv(qkv, cos, sin, k16, v16, 0, Hq, Hkv, slot, index)
    built.rope_qkv(qkv, cos, sin, k32, v32, 0, Hq, Hkv, slot, index)
    assert torch.equal(q16, q32) and q16.dtype == torch.float32
    assert torch.equal(k16, k32.half()) and torch.equal(v16, v32.half()) and k16.abs().sum() > 0


@needs
def test_rows_of_several_sequences_with_a_tree_mask_give_each_row_its_bits_alone():
    """A tree block among slot rows: each row sees its slot's keys below its key count where the
    mask lets it, in the lanes of a shared pass and alone alike."""
    _, attn = kernels.fused_ops()
    g = torch.Generator().manual_seed(8)
    k_buf, v_buf = torch.randn(2, 3, 60, 64, generator=g), torch.randn(2, 3, 60, 64, generator=g)
    slot = torch.tensor([1] * 6 + [0])
    keys = torch.tensor([46] * 6 + [20])
    mask = torch.arange(60)[None, :] < keys[:, None]
    tree = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0], [1, 0, 0, 1, 0, 0],
                         [1, 0, 0, 1, 1, 0], [1, 0, 0, 1, 1, 1]], dtype=torch.bool)
    mask[:6, 40:46] = tree
    q = torch.randn(1, 9, 7, 64, generator=g)
    out = attn(q, k_buf, v_buf, mask[None, None].contiguous(), slot, keys)
    for t in range(7):
        s, n = int(slot[t]), int(keys[t])
        alone = attn(q[:, :, t:t + 1].contiguous(), k_buf[s:s + 1, :, :n], v_buf[s:s + 1, :, :n],
                     mask[t:t + 1, :n][None, None].contiguous())
        assert torch.equal(alone, out[:, :, t:t + 1]), t
    assert not torch.equal(out, attn(q, k_buf, v_buf, None, slot, keys))     # the mask was read


@contextlib.contextmanager
def one_thread_count(n):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@needs
def test_row_stable_packing_uses_fused_ops_and_an_fp32_cache(tmp_path):
    from eagle3.runtime.target import build_target
    from eagle3.testing import FAMILIES, hf_model_from_dict, native_from_hf
    model = native_from_hf(hf_model_from_dict(FAMILIES["qwen2"]), tmp_path)
    model = build_target(model, torch.bfloat16, row_stable=True)
    assert model.new_cache(8).k.dtype == torch.float32 and model.backend.name == "avx512"
    assert model.backend.kernels is not None and model.backend.row_stable


@needs
def test_fused_attention_ignores_where_masked_keys_sit():
    """A tree node in a verify block sees its ancestors between masked siblings; decoded alone it
    sees them contiguous. Row-stable means the same bits either way (an fp32 sum split by key
    position into vector lanes would differ in the last bit, and bf16 weights amplify that)."""
    _, attn = kernels.fused_ops()
    g = torch.Generator().manual_seed(3)
    for trial in range(20):
        k, v = torch.randn(1, 1, 80, 64, generator=g), torch.randn(1, 1, 80, 64, generator=g)
        q = torch.randn(1, 3, 1, 64, generator=g) * 3
        keep = torch.rand(80, generator=g) > 0.5
        keep[0] = True
        sparse = attn(q, k, v, keep.view(1, 1, 1, 80).contiguous())
        dense = attn(q, k[:, :, keep].contiguous(), v[:, :, keep].contiguous(), None)
        assert torch.equal(sparse, dense), trial


@needs
def test_packed_linear_without_onednn_serves_large_blocks(monkeypatch):
    from eagle3.runtime import linear
    monkeypatch.setattr(linear, "onednn_available", lambda: False)
    lin = torch.nn.Linear(64, 40, bias=False)
    packed = linear.PackedLinear(lin.weight, None, choose_backend("cpu"))
    for rows in (1, 20):
        x = torch.randn(rows, 64)
        assert torch.allclose(packed(x), lin(x), atol=1e-5)


@needs
def test_fused_attention_names_a_shape_mismatch():
    _, attn = kernels.fused_ops()
    q, k = torch.randn(1, 4, 1, 64), torch.randn(1, 2, 10, 64)
    with pytest.raises(RuntimeError, match="head_dim"):
        attn(q, k, torch.randn(1, 2, 10, 32), None)
    with pytest.raises(RuntimeError, match="heads/keys"):
        attn(q, k, torch.randn(1, 2, 9, 64), None)


def _packed_family(tmp_path, family, weights, **switches):
    """A tiny model of `family` in the inference layout load_engine builds (bf16: row-stable);
    `switches` turn backend paths off (Backend.one_call_layers, fused_rope)."""
    from dataclasses import replace

    from eagle3.runtime.target import build_target
    from eagle3.testing import FAMILIES, hf_model_from_dict, native_from_hf
    if weights.startswith("bf16") and kernels.small_linear(torch.bfloat16) is None:
        pytest.skip(f"bf16 kernel not available here: {kernels.why()}")
    model = native_from_hf(hf_model_from_dict(FAMILIES[family]), tmp_path)
    dtype = torch.bfloat16 if weights.startswith("bf16") else torch.float32
    backend = replace(choose_backend("cpu", dtype, row_stable=weights.startswith("bf16")), **switches)
    return build_target(model, backend=backend, kv_cache_dtype="fp16" if weights.endswith("kv16") else "auto")


def _prefill_decode_verify(model, prompt, block, tree, capture_ids, seed):
    """Prefill `prompt`, decode block[0], then verify `block` as `tree` from the same prefix."""
    from eagle3.models.layers import tree_block_mask
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (1, prompt), generator=g)
    new = torch.randint(0, model.config.vocab_size, (1, block), generator=g)
    cache = model.new_cache(64)
    out = {"first": model(ids, torch.arange(prompt), cache, capture_ids=capture_ids["first"]),
           "one": model(new[:, :1], torch.tensor([prompt]), cache, capture_ids=capture_ids["one"])}
    cache.truncate(prompt)
    out["verify"] = model(new, prompt + tree.sum(dim=1) - 1, cache,
                          attn_mask=tree_block_mask(prompt, tree), capture_ids=capture_ids["verify"])
    out["k"], out["v"] = (t[:, :, :prompt + block] for t in cache.layer(1))
    return out


@needs
@pytest.mark.parametrize("family", ["llama3", "qwen2", "smollm_tied"])
@pytest.mark.parametrize("weights", ["fp32", "bf16", "bf16-kv16"])
def test_fused_rope_equals_the_composite_path_bit_for_bit(tmp_path, family, weights):
    """rope_qkv (split + rotary + cache write in one call) rounds exactly as the torch ops do."""
    model = _packed_family(tmp_path, family, weights)
    assert model.backend.fused_rope and model.backend.kernels is not None
    tree = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0],
                         [1, 1, 0, 1, 0, 0], [1, 0, 1, 0, 1, 0], [1, 1, 0, 1, 0, 1]], dtype=torch.bool)
    capture = {"first": [0, 1], "one": (), "verify": ()}

    def run():   # a 40-token prompt: past SMALL_ROWS, so a plain target's prefill takes SDPA
        o = _prefill_decode_verify(model, 40, 6, tree, capture, seed=1)
        return [o["first"].logits, o["first"].aux, o["one"].logits, o["verify"].logits, o["k"], o["v"]]

    fused = run()
    model = _packed_family(tmp_path, family, weights, fused_rope=False)   # same weights (seeded)
    composite = run()
    for x, y in zip(fused, composite):
        assert torch.equal(x, y)


@needs
def test_kernels_run_on_every_torch_thread():
    """The parallel regions are OpenMP pragmas: a build without -fopenmp ran on one thread."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert kernels.parallel_threads() == 2
        assert "2 of 2 threads" in kernels.why()
        torch.set_num_threads(1)
        assert kernels.parallel_threads() == 1
    finally:
        torch.set_num_threads(before)


@needs
@pytest.mark.parametrize("family", ["llama3", "qwen2", "smollm_tied", "qwen3"])
@pytest.mark.parametrize("weights", ["fp32", "bf16", "bf16-kv16"])
def test_one_call_layer_equals_the_modules_bit_for_bit(tmp_path, family, weights, monkeypatch):
    """FastLayer's one call (csrc/layer.cpp decoder_layer) runs the composite path's ops in their
    order."""
    model = _packed_family(tmp_path, family, weights)
    if family == "qwen3":  # q/k norms: the kernel does not cover them, the composite path serves
        assert all(layer.one_call is None for layer in model.layers)
        return
    assert all(layer.one_call is not None for layer in model.layers) and model.backend.kernel_rows >= 8
    tree = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0],
                         [1, 0, 1, 0, 1]], dtype=torch.bool)
    capture = {"first": [1, 2], "one": [1, 2], "verify": [1, 2]}
    calls = []

    def run():
        o = _prefill_decode_verify(model, 11, 5, tree, capture, seed=2)
        return [o["first"].logits, o["first"].aux, o["one"].logits, o["one"].aux,
                o["verify"].logits, o["verify"].aux, o["k"], o["v"]]

    kernel = kernels.state().module.decoder_layer
    monkeypatch.setattr(kernels.state().module, "decoder_layer",
                        lambda *a: calls.append(1) or kernel(*a))
    fused = run()
    assert calls                          # the one-call path really ran
    model = _packed_family(tmp_path, family, weights, one_call_layers=False)   # same weights
    modules = run()
    for x, y in zip(fused, modules):
        assert torch.equal(x, y)


@needs
@pytest.mark.parametrize("weights", ["fp32", "bf16"])
def test_one_call_midlayer_equals_the_modules_bit_for_bit(weights, monkeypatch):
    """An EAGLE-3 draft's midlayer on the one-call kernel: features, tree levels and extends."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent))
    from spec_helpers import AUX_IDS, tiny_draft, tiny_target
    from dataclasses import replace

    from eagle3.draft.inference import build_draft_layout
    if weights == "bf16" and kernels.small_linear(torch.bfloat16) is None:
        pytest.skip(f"bf16 kernel not available here: {kernels.why()}")
    target = tiny_target()
    reference = tiny_draft(target, draft_vocab=20)
    backend = choose_backend("cpu", torch.bfloat16 if weights == "bf16" else torch.float32)
    draft = build_draft_layout(reference, backend=backend)
    assert draft.layer.one_call is not None
    g = torch.Generator().manual_seed(3)
    feats = torch.randn(1, 7, len(AUX_IDS) * target.config.hidden_size, generator=g)
    ids = torch.randint(0, target.config.vocab_size, (1, 7), generator=g)
    calls = []

    def run():
        cache = draft.new_cache(32)
        first = draft(ids, torch.arange(7), cache, features=feats)
        hidden = first.hidden[:, -1:].expand(1, 3, -1)
        mask = torch.cat([torch.ones(3, 7, dtype=torch.bool), torch.eye(3, dtype=torch.bool)], 1)
        level = draft(ids[:, :3], torch.full((3,), 7), cache, hidden=hidden, attn_mask=mask[None, None])
        return [first.logits, first.hidden, level.logits, level.hidden]

    kernel = kernels.state().module.decoder_layer
    monkeypatch.setattr(kernels.state().module, "decoder_layer",
                        lambda *a: calls.append(1) or kernel(*a))
    fused = run()
    assert calls
    draft = build_draft_layout(reference, backend=replace(backend, one_call_layers=False))
    for x, y in zip(fused, run()):
        assert torch.equal(x, y)


@needs
def test_kernels_handle_a_batch_of_two_like_two_single_calls():
    """B > 1: rows of the attention, rope_qkv and the one-call layer follow their batch entry."""
    from eagle3.runtime.target import build_target
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent))
    from spec_helpers import tiny_target
    model = build_target(tiny_target(layers=2), torch.float32)
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=g)
    pos = torch.arange(9)
    both = model(ids, pos, model.new_cache(16, batch=2))
    for b in range(2):
        alone = model(ids[b:b + 1], pos, model.new_cache(16))
        assert torch.equal(both.logits[b], alone.logits[0])
    assert all(layer.one_call is not None for layer in model.layers)


@needs
def test_fused_attention_gives_zeros_for_a_row_that_may_attend_to_nothing():
    _, attn = kernels.fused_ops()
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 4, 3, 16, generator=g), torch.randn(1, 2, 5, 16, generator=g),
               torch.randn(1, 2, 5, 16, generator=g))
    mask = torch.ones(1, 1, 3, 5, dtype=torch.bool)
    mask[0, 0, 1] = False                                      # a padding row
    out = attn(q, k, v, mask)
    assert torch.equal(out[:, :, 1], torch.zeros(1, 4, 16)) and torch.isfinite(out).all()


@needs
def test_kernels_name_a_wrong_device_or_dtype():
    _, attn = kernels.fused_ops()
    q, k = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 4, 16)
    with pytest.raises(RuntimeError,
                       match="the kv cache must be fp32 or fp16 .keys and values alike., got keys Double"):
        attn(q, k.double(), k, None)
    with pytest.raises(RuntimeError, match="not a multiple of kv heads 0"):
        attn(q, k[:, :0], k[:, :0], None)


@needs
def test_a_prefill_longer_than_the_kernels_serve_runs_in_pieces_with_each_rows_bits(tmp_path, monkeypatch):
    """A row-stable layout prefills a long prompt in pieces of prefill_rows, so every row takes the
    kernels' path: the block's logits, hidden states, captured features and cache equal the same
    prompt decoded one token at a time, bit for bit."""
    from eagle3.runtime import backend as backend_module
    monkeypatch.setattr(backend_module, "STABLE_ROWS", 8)      # pieces of 8 rows on a tiny model
    model = _packed_family(tmp_path, "llama3", "bf16")
    assert model.prefill_rows == 8
    ids = torch.randint(0, model.config.vocab_size, (1, 21), generator=torch.Generator().manual_seed(4))
    capture = (0, 1)
    cache = model.new_cache(32)
    block = model(ids, torch.arange(21), cache, capture_ids=capture)
    one = model.new_cache(32)
    rows = [model(ids[:, i:i + 1], torch.tensor([i]), one, capture_ids=capture) for i in range(21)]
    assert torch.equal(block.logits, torch.cat([r.logits for r in rows], dim=1))
    assert torch.equal(block.hidden, torch.cat([r.hidden for r in rows], dim=1))
    assert torch.equal(block.aux, torch.cat([r.aux for r in rows], dim=1))
    assert cache.length == one.length == 21
    k, k_one = cache.layer(1)[0], one.layer(1)[0]
    assert torch.equal(k[..., :21, :], k_one[..., :21, :])
    last = model(ids, torch.arange(21), model.new_cache(32), logits_rows=slice(-1, None))
    assert torch.equal(last.logits, block.logits[:, -1:])
