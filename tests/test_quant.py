"""GGUF integer codes on the kernels (`--weights gguf` / `gguf-exact`, runtime.quant + kernels/csrc
linear_quant): unpacking equals the gguf package's dequantisation, the kernel equals the dequantised
weight's product (with exact inputs, or with inputs rounded to one byte per block of 32), rows are
independent of their block, and a target running the codes gives the fp32 model's logits (exact) or
the rounded-input model's (one byte), with lossless speculation on both."""
from __future__ import annotations

import contextlib
import copy

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize, quantize  # noqa: E402

from eagle3 import kernels  # noqa: E402
from eagle3.errors import InputError, LoadError  # noqa: E402
from eagle3.runtime.quant import (GgufWeights, QuantCodes, check_codes, llama_row_order,  # noqa: E402
                                  read_gguf_codes, unpack)
from eagle3.models.layers import tree_block_mask  # noqa: E402
from eagle3.models.llama import LlamaModel  # noqa: E402
from eagle3.runtime.target import build_target  # noqa: E402

from spec_helpers import StubTokenizer, tiny_draft, tiny_target  # noqa: E402

TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q4_K", "Q6_K")
FOUR_BIT = ("Q4_0", "Q4_1", "Q4_K")           # kernel kind 4: integer dot products where the CPU has VNNI
needs_kernels = pytest.mark.skipif(kernels.quant_linear() is None, reason=f"no kernels: {kernels.why()}")
needs_vnni = pytest.mark.skipif(not kernels.integer_dots(), reason="no AVX512-VNNI (or EAGLE3_VNNI=0)")


def raw_blocks(type_name: str, out_features: int, in_features: int, seed: int = 0,
               weight: np.ndarray | None = None) -> np.ndarray:
    """A tensor's bytes as a GGUF holds them: gguf's own quantizer where it has one (Q4_0, Q4_1,
    Q8_0, Q5_0), else random blocks with sane fp16 super-block scales (K-quants)."""
    rng = np.random.default_rng(seed)
    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name in ("Q4_0", "Q4_1", "Q8_0", "Q5_0"):
        w = weight if weight is not None else rng.standard_normal((out_features, in_features))
        return quantize(np.asarray(w, dtype=np.float32), qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(out_features * in_features // block, size), dtype=np.uint8)
    put = lambda col, value: raw.__setitem__(
        (slice(None), slice(col, col + 2)),
        np.frombuffer(np.full(len(raw), value, np.float16).tobytes(), np.uint8).reshape(-1, 2))
    if type_name == "Q4_K":
        put(0, 0.004), put(2, 0.01)                      # d, dmin
    else:
        put(208, 0.0015)                                 # Q6_K d
    return raw.reshape(out_features, -1)


def gguf_dequantized(type_name: str, raw: np.ndarray, out_features: int, in_features: int) -> torch.Tensor:
    w = dequantize(raw, gguf.GGMLQuantizationType[type_name]).reshape(out_features, in_features)
    return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))


@pytest.mark.parametrize("type_name", TYPES)
def test_codes_reproduce_ggufs_dequantisation_bit_for_bit(type_name):
    raw = raw_blocks(type_name, 48, 512)
    codes = unpack(type_name, raw, 48, 512)
    assert torch.equal(codes.dequantize(), gguf_dequantized(type_name, raw, 48, 512))


@needs_kernels
@pytest.mark.parametrize("type_name,integer_dots",
                         [(t, False) for t in TYPES] + [pytest.param(t, True, marks=needs_vnni) for t in FOUR_BIT])
def test_the_kernel_equals_the_dequantised_product_and_rows_stand_alone(type_name, integer_dots):
    out_features, in_features = 72, 512           # 72: a last group of 8 valid lanes
    raw = raw_blocks(type_name, out_features, in_features, seed=1)
    codes = unpack(type_name, raw, out_features, in_features)
    packed = kernels.pack_quant([codes.kernel_part()], integer_dots)
    x = torch.randn(19, in_features)
    x[3, 40:72] *= 1e4                            # blocks of very different size in one row
    x[4, 100:132] *= 1e-4
    bias = torch.randn(out_features)
    y = kernels.quant_linear()(x, packed, bias, out_features)
    ref = (x.double() @ gguf_dequantized(type_name, raw, out_features, in_features).double().T
           + bias.double())
    assert (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    alone = torch.cat([kernels.quant_linear()(x[i:i + 1].contiguous(), packed, bias, out_features)
                       for i in range(len(x))])
    assert torch.equal(alone, y)                  # bit for bit: the row-stable property


def byte_rounded(x: torch.Tensor) -> torch.Tensor:
    """x with each block of 32 inputs rounded to one signed byte under its largest (fp64), what
    the one-digit kernel (csrc/linear_quant_vnni.cpp byte_tile) multiplies the codes by."""
    blocks = x.double().view(x.shape[0], -1, 32)
    s = blocks.abs().amax(-1, keepdim=True) / 127
    s = torch.where(s > 0, s, torch.ones_like(s))
    return (torch.round(blocks / s) * s).view(x.shape)


@needs_vnni
@pytest.mark.parametrize("type_name", TYPES)
def test_one_byte_inputs_give_the_rounded_inputs_product_and_rows_stand_alone(type_name):
    """Every code kind on one-byte inputs (`--weights gguf`): the file's exact weights times the
    inputs rounded per block of 32, to fp32 accuracy; each row's bits independent of its block; and
    not the exact product (the rounding is real: ~0.5% of a block's largest input)."""
    out_features, in_features = 72, 512
    raw = raw_blocks(type_name, out_features, in_features, seed=1)
    codes = unpack(type_name, raw, out_features, in_features)
    packed = kernels.pack_quant([codes.kernel_part()], True, one_digit=True)
    x = torch.randn(19, in_features)
    x[3, 40:72] *= 1e4
    x[4, 100:132] *= 1e-4
    y = kernels.quant_linear()(x, packed, None, out_features)
    w = gguf_dequantized(type_name, raw, out_features, in_features).double()
    ref = byte_rounded(x) @ w.T
    assert (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    exact = x.double() @ w.T
    assert (y.double() - exact).abs().max() > 1e-4 * exact.abs().max()
    alone = torch.cat([kernels.quant_linear()(x[i:i + 1].contiguous(), packed, None, out_features)
                       for i in range(len(x))])
    assert torch.equal(alone, y)


@needs_vnni
def test_one_byte_inputs_mix_formats_segment_by_segment():
    parts = [unpack(t, raw_blocks(t, n, 512, seed=i), n, 512)
             for i, (t, n) in enumerate((("Q4_K", 64), ("Q6_K", 32), ("Q8_0", 40), ("Q5_0", 24)))]
    x = torch.randn(11, 512)
    pack = lambda ps: kernels.pack_quant([p.kernel_part() for p in ps], True, one_digit=True)
    fused = kernels.quant_linear()(x, pack(parts), None, 160)
    apart = [kernels.quant_linear()(x, pack([p]), None, p.codes.shape[0]) for p in parts]
    assert torch.equal(fused, torch.cat(apart, dim=1))


needs_amx_int8 = pytest.mark.skipif(not kernels.state().amx_int8, reason="no AMX-INT8 tiles here")


@contextlib.contextmanager
def amx_int8(on: bool):
    module = kernels.state().module
    module.set_amx_int8(on)
    try:
        yield
    finally:
        module.set_amx_int8(kernels.state().amx_int8)


@needs_amx_int8
@pytest.mark.parametrize("type_name", FOUR_BIT)
def test_4bit_codes_on_amx_int8_tiles_give_the_vnni_paths_bits(type_name):
    """Blocks of 8+ rows run the integer dot products as tile multiplies: the same integer sums
    and the same float steps after them, so every row has the VNNI path's bits (and a row alone,
    on VNNI, equals it in any block)."""
    out_features, in_features = 40, 1024          # 40: a last group of 8 valid lanes
    raw = raw_blocks(type_name, out_features, in_features, seed=3)
    codes = unpack(type_name, raw, out_features, in_features)
    fused = kernels.pack_quant([codes.kernel_part(), unpack("Q8_0", raw_blocks("Q8_0", 16, in_features, seed=4),
                                                             16, in_features).kernel_part()], True)
    x = torch.randn(40, in_features)
    x[9, 64:96] *= 1e5
    for rows in (8, 9, 16, 17, 40):
        with amx_int8(False):
            vnni = kernels.quant_linear()(x[:rows].contiguous(), fused, None, out_features + 16)
        with amx_int8(True):
            tiles = kernels.quant_linear()(x[:rows].contiguous(), fused, None, out_features + 16)
        assert torch.equal(tiles, vnni), rows


@needs_vnni
@pytest.mark.parametrize("type_name", FOUR_BIT)
def test_integer_dots_are_as_close_to_the_exact_product_as_fp32(type_name):
    """The byte digits keep 23 bits under each block's largest input: no further from the fp64
    product than the fp32 FMA path (whose error is fp32 rounding) by more than 2x, on inputs whose
    sizes span six orders of magnitude."""
    out_features, in_features = 64, 1536
    raw = raw_blocks(type_name, out_features, in_features, seed=5)
    codes = unpack(type_name, raw, out_features, in_features)
    torch.manual_seed(0)
    x = torch.randn(8, in_features) * torch.logspace(-3, 3, in_features)[torch.randperm(in_features)]
    ref = x.double() @ codes.dequantize().double().T
    err = {dots: (kernels.quant_linear()(x, kernels.pack_quant([codes.kernel_part()], dots), None, out_features)
                  .double() - ref).abs().max().item() for dots in (False, True)}
    assert err[True] <= 2 * err[False]


@needs_kernels
@pytest.mark.parametrize("integer_dots", [False, pytest.param(True, marks=needs_vnni)])
def test_a_block_with_inf_or_nan_gives_nan_and_zeros_give_zero(integer_dots):
    codes = unpack("Q4_1", raw_blocks("Q4_1", 32, 128, seed=2), 32, 128)
    packed = kernels.pack_quant([codes.kernel_part()], integer_dots)
    x = torch.randn(4, 128)
    x[0, 5] = float("nan")
    x[1, 70] = float("inf")
    x[2] = 0.0
    y = kernels.quant_linear()(x, packed, None, 32)
    assert y[0].isnan().all() and not y[1].isfinite().any()
    assert torch.equal(y[2], torch.zeros(32))
    assert y[3].isfinite().all()


@needs_kernels
def test_a_fused_weight_mixes_formats_segment_by_segment():
    parts = [unpack(t, raw_blocks(t, n, 512, seed=i), n, 512)
             for i, (t, n) in enumerate((("Q4_K", 64), ("Q6_K", 32), ("Q8_0", 40)))]
    x = torch.randn(5, 512)
    fused = kernels.quant_linear()(x, kernels.pack_quant([p.kernel_part() for p in parts]), None, 136)
    apart = [kernels.quant_linear()(x, kernels.pack_quant([p.kernel_part()]), None, p.codes.shape[0])
             for p in parts]
    assert torch.equal(fused, torch.cat(apart, dim=1))


@needs_kernels
def test_the_kernel_refuses_a_weight_of_another_shape():
    codes = unpack("Q8_0", raw_blocks("Q8_0", 16, 64), 16, 64)
    packed = kernels.pack_quant([codes.kernel_part()])
    with pytest.raises(RuntimeError, match="x width 32 != the packed weight's input width 64"):
        kernels.quant_linear()(torch.randn(1, 32), packed, None, 16)
    with pytest.raises(RuntimeError, match="out_features 8 != the packed weight's 16"):
        kernels.quant_linear()(torch.randn(1, 64), packed, None, 8)
    unknown = packed.clone()
    unknown[32:40] = torch.tensor([6], dtype=torch.int64).view(torch.uint8)     # header word 4: flags
    with pytest.raises(RuntimeError, match="flags 6 .*pack it again"):
        kernels.quant_linear()(torch.randn(1, 64), unknown, None, 16)


def test_llama_row_order_undoes_the_ggufs_rotary_interleave():
    # llama.cpp stores q/k rows of each head as (pair, half) interleaved; HF keeps halves apart
    hf = torch.arange(2 * 8).view(2, 8)                 # 2 heads, head_dim 8: rows 0..15
    halves = hf.view(2, 2, 4)                           # head, half, i
    gguf_rows = halves.transpose(1, 2).reshape(-1)      # what the GGUF stores, row by row
    assert torch.equal(gguf_rows[llama_row_order(16, 2)], torch.arange(16))


# ---------------------------------------------------------------------------- tiny targets
def gguf_tiny_target(type_name: str, seed: int = 0, model=None):
    """A tiny target whose linear weights are a GGUF type's codes (the model holds their exact
    dequantisation, as the loader's conversion does), and those codes. model: the target to put
    the codes in (default: a tiny Llama as wide as the type's blocks need)."""
    if model is None:
        width = 256 if type_name in ("Q4_K", "Q6_K") else 64
        model = tiny_target(seed=seed, vocab=64, hidden=width, intermediate=2 * width, layers=4, std=0.1)
    codes = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.dim() != 2 or name == "embed_tokens.weight":
            continue
        out_features, in_features = p.shape
        raw = raw_blocks(type_name, out_features, in_features, seed=len(codes),
                         weight=p.detach().numpy() * 3)
        qc = unpack(type_name, raw, out_features, in_features)
        if type_name in ("Q4_K", "Q6_K"):     # random codes: scale them to the layer's size
            qc = QuantCodes(qc.ggml_type, qc.kind, qc.block, qc.codes, qc.scales * 0.2,
                            None if qc.offsets is None else qc.offsets * 0.2)
        with torch.no_grad():
            p.copy_(qc.dequantize())
        codes[name] = qc
    return model, GgufWeights(codes, None, {})


@needs_kernels
@pytest.mark.parametrize("type_name", TYPES)
def test_a_target_on_the_codes_gives_the_fp32_models_logits(type_name):
    model, codes = gguf_tiny_target(type_name)
    layout = build_target(copy.deepcopy(model), torch.float32, row_stable=True, gguf=codes)
    assert all(l.quant_types for l in layout.linears)
    ids = torch.randint(0, 64, (1, 12))
    pos = torch.arange(12)[None]
    want = exact_logits(model, ids, pos)
    got = layout(ids, pos, layout.new_cache(32)).logits
    assert (got.double() - want).abs().max() <= 1e-4
    # and no further from the exact model than the fp32 reference is, within 2x (integer dot
    # products whose offsets met the unrounded inputs were 3-5x further on Q4_0 / Q4_1)
    fp32_error = (model(ids, pos, model.new_cache(32)).logits.double() - want).abs().max()
    assert (got.double() - want).abs().max() <= 2 * fp32_error


# a verify block's tree: 0 the root; 1, 2 its children; 3 under 1; 4 under 3 (row sees col)
TREE_MASK = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 1, 0, 1, 1]],
                         dtype=torch.bool)


def head_dim_64_target(arch: str) -> LlamaModel:
    """A tiny target with the one-row layer's head_dim (64; 4 heads over 2 kv heads), a Llama or a
    Qwen2 (q/k/v biases)."""
    return tiny_target(seed=5, vocab=64, std=0.1, layers=3, hidden=256, intermediate=512, arch=arch)


@needs_vnni
@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
def test_a_decode_step_in_one_parallel_region_gives_the_composite_calls_bits(type_name, arch):
    """A block of one sequence on one-byte inputs (a prompt, decode steps, tree verify blocks) runs
    every layer in one parallel region (the kernels' LayerStack) or each layer in one
    (decoder_layer's case of one sequence): the same row parts as the composite call, so the same
    logits, captured features and cache, bit for bit, on either cache type."""
    model, codes = gguf_tiny_target(type_name, model=head_dim_64_target(arch))
    for kv in ("fp16", "fp32"):
        layout = build_target(copy.deepcopy(model), torch.float32, row_stable=True, gguf=codes.with_int8_inputs(),
                              kv_cache_dtype=kv)
        k = layout.backend.kernels
        assert layout.stack is not None
        assert all(k.LayerStack([layer.one_call], 256, 64).applies for layer in layout.layers)
        stack, runs = layout.stack, {}
        for mode in ("stack", "layer", "composite"):
            layout.stack = stack if mode == "stack" else None
            k.set_one_region(mode != "composite")
            try:
                cache = layout.new_cache(48)
                out = layout(torch.arange(3, 13)[None], torch.arange(10)[None], cache, capture_ids=(1,))
                steps = [(out.logits, out.aux, out.hidden)]
                for i in range(12):
                    token = out.logits[0, -1].argmax().view(1, 1)
                    out = layout(token, torch.tensor([[cache.length]]), cache, capture_ids=(0, 2))
                    steps.append((out.logits, out.aux, out.hidden))
                    if i % 4 == 3:       # a verify block: a tree of 5 nodes (root, two children, ...)
                        start = cache.length
                        mask = tree_block_mask(start, TREE_MASK)
                        ids = (torch.arange(5) * 7 + i)[None] % 64
                        out = layout(ids, torch.tensor([[start, start + 1, start + 1, start + 2, start + 3]]),
                                     cache, attn_mask=mask, capture_ids=(0, 1, 2))
                        steps.append((out.logits, out.aux, out.hidden))
                        cache.truncate(start + 1)
            finally:
                layout.stack = stack
                k.set_one_region(True)
            runs[mode] = (steps, cache.k.clone(), cache.v.clone())
        want_steps, want_k, want_v = runs["composite"]
        for mode in ("stack", "layer"):
            got_steps, got_k, got_v = runs[mode]
            assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v), (mode, kv)
            for got, want in zip(got_steps, want_steps):
                assert all(torch.equal(g, w) for g, w in zip(got, want)), (mode, kv)


@needs_vnni
def test_a_region_of_one_thread_gives_the_same_bits(one_thread):
    """The thread governor may leave one thread: the region's team is then one, every share its
    own, and the bits are still the composite call's."""
    model, codes = gguf_tiny_target("Q4_1", model=head_dim_64_target("LlamaForCausalLM"))
    layout = build_target(copy.deepcopy(model), torch.float32, row_stable=True, gguf=codes.with_int8_inputs())
    assert torch.get_num_threads() == 1 and layout.stack is not None
    k, stack, outs = layout.backend.kernels, layout.stack, []
    for use in (stack, None):                # the region, then the composite call
        layout.stack = use
        k.set_one_region(use is not None)
        try:
            cache = layout.new_cache(24)
            out = layout(torch.arange(3, 11)[None], torch.arange(8)[None], cache)
            outs.append([out.logits])
            for _ in range(4):
                out = layout(out.logits[0, -1].argmax().view(1, 1), torch.tensor([[cache.length]]), cache)
                outs[-1].append(out.logits)
        finally:
            layout.stack = stack
            k.set_one_region(True)
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def exact_logits(model, ids, pos, byte_inputs: bool = False) -> torch.Tensor:
    """The dequantised model evaluated in fp64: the file's exact model (an fp32 evaluation of it
    is itself up to ~1e-4 away on the real targets, so that is the wrong yardstick). byte_inputs:
    every linear's input rounded to one byte per block of 32 first (`--weights gguf`'s model)."""
    exact = copy.deepcopy(model).double()
    exact.rotary.cos, exact.rotary.sin = exact.rotary.cos.double(), exact.rotary.sin.double()
    if byte_inputs:
        for m in exact.modules():
            if isinstance(m, torch.nn.Linear):
                m.register_forward_pre_hook(lambda _, args: (byte_rounded(args[0].reshape(-1, args[0].shape[-1]))
                                                             .view(args[0].shape),))
    return exact(ids, pos, exact.new_cache(ids.shape[1] + 4)).logits


@needs_vnni
@pytest.mark.parametrize("type_name", TYPES)
def test_a_target_on_one_byte_inputs_gives_the_rounded_input_models_logits(type_name):
    """`--weights gguf`: every linear of the layout meets its inputs rounded to one byte per block;
    its logits are the fp64 model with those roundings, far closer to it than to the exact one."""
    model, codes = gguf_tiny_target(type_name)
    # an fp32 cache: the linears' numerics alone (the default fp16 cache rounds k and v besides)
    layout = build_target(copy.deepcopy(model), torch.float32, row_stable=True, gguf=codes.with_int8_inputs(),
                          kv_cache_dtype="fp32")
    assert all(l.one_digit for l in layout.linears) and layout.weights_name.endswith(", int8 inputs")
    assert build_target(copy.deepcopy(model), torch.float32, row_stable=True,
                        gguf=codes.with_int8_inputs()).kv_dtype == torch.float16
    ids, pos = torch.randint(0, 64, (1, 12)), torch.arange(12)[None]
    got = layout(ids, pos, layout.new_cache(32)).logits.double()
    rounded = (got - exact_logits(model, ids, pos, byte_inputs=True)).abs()
    exact = (got - exact_logits(model, ids, pos)).abs()
    # the median: an input that sits on a rounding boundary may round the other way in fp64 (one
    # such flip moved a few of the tiny Q4_K model's logits by 7e-3)
    assert rounded.median() <= 1e-2 * exact.median(), (rounded.median(), exact.median())


def test_codes_that_do_not_reproduce_the_model_are_a_load_error():
    model, codes = gguf_tiny_target("Q8_0")
    with torch.no_grad():
        model.layers[1].mlp.up_proj.weight[3, 5] += 0.5
    with pytest.raises(LoadError, match="layers.1.mlp.up_proj.weight: the Q8_0 codes do not reproduce"):
        check_codes(codes, dict(model.named_parameters(remove_duplicate=False)))


def codes_for(codes, real):
    """layouts.gguf_codes for a test's tiny target: its codes (one-byte inputs where asked), or the
    real function's answer where there are no kernels."""
    def pick(target, src, one_byte_inputs=True):
        if kernels.quant_linear() is None:
            return real(target, src, one_byte_inputs)
        return codes.with_int8_inputs() if one_byte_inputs else codes
    return pick


@pytest.mark.lossless
@pytest.mark.parametrize("weights", ["gguf", "gguf-exact"])
@pytest.mark.parametrize("type_name", TYPES)
def test_greedy_speculation_on_the_codes_equals_plain_decoding(type_name, weights):
    from eagle3.layouts import build_layouts
    from eagle3.generate import Engine
    from eagle3.sampling import SamplingParams
    from eagle3.speculative.tree import SpecParams
    model, codes = gguf_tiny_target(type_name, seed=3)
    draft = tiny_draft(model)
    source = type("Source", (), {"gguf": "tiny.gguf", "name": "tiny"})()
    import eagle3.layouts as layouts
    real = layouts.gguf_codes
    layouts.gguf_codes = codes_for(codes, real)
    try:
        target, drafter = build_layouts(model, draft, weights, "fp32", source)
    finally:
        layouts.gguf_codes = real
    assert ("int8 inputs" in target.weights_name) == (weights == "gguf" and kernels.integer_dots())
    plain = Engine(target, StubTokenizer(), max_model_len=128)
    spec = Engine(target, StubTokenizer(), draft=drafter, spec=SpecParams(4, 3, 8, 0.0), max_model_len=128)
    for prompt in ([1, 2, 3, 4], [9, 8, 7, 9, 8, 7, 9, 8]):
        params = SamplingParams(max_new_tokens=40, ignore_eos=True)
        assert spec.generate(prompt_ids=prompt, params=params).token_ids == \
            plain.generate(prompt_ids=prompt, params=params).token_ids


def test_gguf_weights_need_a_gguf_target():
    from eagle3.layouts import resolve_weights
    source = type("Source", (), {"gguf": None, "name": "some/hf-dir"})()
    with pytest.raises(InputError, match="weights=gguf runs a GGUF file's own quantized weights"):
        resolve_weights("gguf", source)
    with pytest.raises(InputError, match="weights=gguf-exact runs a GGUF file's own quantized weights"):
        resolve_weights("gguf-exact", source)
    assert resolve_weights("auto", source) == "fp32"
    assert resolve_weights("auto", type("S", (), {"gguf": "m.gguf", "name": "m"})()) == "gguf"
    with pytest.raises(InputError, match="choose one of auto, gguf, gguf-exact, fp32, bf16"):
        resolve_weights("int4", source)


def test_a_type_without_a_kernel_is_dequantised_and_said(tmp_path):
    path = tmp_path / "mixed.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    w = np.random.default_rng(0).standard_normal((32, 64)).astype(np.float32)
    writer.add_tensor("blk.0.attn_q.weight", quantize(w, gguf.GGMLQuantizationType.Q4_1),
                      raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    writer.add_tensor("blk.0.attn_v.weight", w.astype(np.float16), raw_dtype=gguf.GGMLQuantizationType.F16)
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(64, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    weights = read_gguf_codes(path, num_heads=4, num_kv_heads=4, tie_word_embeddings=True)
    assert list(weights.codes) == ["layers.0.self_attn.q_proj.weight"]
    assert weights.dequantized == {"layers.0.self_attn.v_proj.weight": "F16"}
    assert "no kernel for F16: 1 tensor(s) dequantised to fp32" in weights.describe()
    # a model linear that no GGUF tensor name maps to is said too (a naming this reader lacks)
    params = {"layers.0.self_attn.q_proj.weight": torch.zeros(32, 64), "layers.0.self_attn.v_proj.weight":
              torch.zeros(32, 64), "layers.0.mlp.gate_proj.weight": torch.zeros(8, 64),
              "layers.0.input_layernorm.weight": torch.zeros(64), "lm_head.weight": torch.zeros(96, 64)}
    weights.match(params)
    assert weights.unmatched == ["layers.0.mlp.gate_proj.weight", "lm_head.weight"]
    assert ("2 linear weight(s) matched no GGUF tensor name and run dequantised in fp32 "
            "(layers.0.mlp.gate_proj.weight, lm_head.weight)") in weights.describe()


# ---------------------------------------------------------------------------- the packaged GGUF
@needs_kernels
@pytest.mark.real
def test_the_packaged_ggufs_codes_give_the_exact_models_logits(real_model):
    """Within 1e-4 of the dequantised model evaluated in fp64 (the file's exact model). The fp32
    reference itself sits ~9e-5 from it on this prompt and the fp32 layout ~1e-4 from the fp32
    reference: 1e-4 against an fp32 evaluation would test fp32 rounding, not the kernels."""
    from eagle3.runtime.quant import load_gguf_codes
    model, _, src = real_model
    codes = load_gguf_codes(src.gguf, src.hf_dir, model)       # read once, then from beside the conversion
    assert {qc.ggml_type for qc in codes.codes.values()} == {"Q4_1", "Q8_0"}
    assert codes.unmatched == []                                # every linear runs on the kernels
    # the cached codes sit beside the model directory: vLLM loads every *.safetensors in it
    assert sorted(p.name for p in src.hf_dir.glob("*.safetensors")) == ["model.safetensors"]
    layout = build_target(model, torch.float32, row_stable=True, gguf=codes)
    assert all(l.quant_types for l in layout.linears)
    ids = torch.tensor([[1, 504, 3458, 314, 260, 1345, 30, 2056, 17, 28, 29, 1064, 90, 27, 3]])
    pos = torch.arange(ids.shape[1])[None]
    want = exact_logits(model, ids, pos)
    got = layout(ids, pos, layout.new_cache(64)).logits          # 15 rows: the kernels' block path
    assert (got.double() - want).abs().max() <= 1e-4
    cache = layout.new_cache(64)
    layout(ids[:, :-1], pos[:, :-1], cache)
    one = layout(ids[:, -1:], pos[:, -1:], cache).logits        # a decode row: the same bits
    assert torch.equal(one[0, -1], got[0, -1])


@needs_kernels
def test_the_cost_table_of_the_codes_is_not_the_fp32_layouts():
    """The adaptive step's cost table is cached per layout: the codes' verify costs grow faster with
    rows than fp32's (compute-bound dequantisation), so sharing a table would mislead the policy."""
    from eagle3.runtime.costs import cost_key
    model, codes = gguf_tiny_target("Q4_1")
    on_codes = build_target(model, torch.float32, row_stable=True, gguf=codes)
    fp32 = build_target(model, torch.float32, row_stable=True)
    assert on_codes.weights_name.startswith("gguf:Q4_1") and fp32.weights_name == "torch.float32"
    assert cost_key(on_codes, None) != cost_key(fp32, None)


@needs_vnni
def test_integer_dots_are_named_and_switched_off_by_the_environment(monkeypatch):
    """The arithmetic is part of what the linears run (the cost table's key, `eagle3 info`), and
    EAGLE3_VNNI=0 keeps the 4-bit codes on the fp32 FMA path."""
    model, codes = gguf_tiny_target("Q4_1")
    on = build_target(copy.deepcopy(model), torch.float32, row_stable=True, gguf=codes)
    assert on.weights_name == "gguf:Q4_1, int8 dot"
    monkeypatch.setattr(kernels, "_STATE", None)
    monkeypatch.setenv("EAGLE3_VNNI", "0")
    assert not kernels.integer_dots() and "vnni" not in kernels.why()
    off = build_target(copy.deepcopy(model), torch.float32, row_stable=True, gguf=codes)
    assert off.weights_name == "gguf:Q4_1"
    ids, pos = torch.randint(0, 64, (1, 12)), torch.arange(12)[None]
    a = on(ids, pos, on.new_cache(32)).logits
    b = off(ids, pos, off.new_cache(32)).logits
    assert not torch.equal(a, b) and (a - b).abs().max() <= 1e-4


@pytest.mark.lossless
def test_gguf_exact_weights_decode_what_the_dequantised_model_decodes():
    """weights=gguf-exact gives the reference (dequantised fp32) model's greedy tokens: on the kernels
    through the codes, and where there are none (EAGLE3_KERNELS=0: scripts/test.sh reruns this) through
    the fp32 layout it falls back to."""
    from eagle3.layouts import build_layouts
    from eagle3.generate import Engine
    from eagle3.sampling import SamplingParams
    import eagle3.layouts as layouts
    model, codes = gguf_tiny_target("Q4_1", seed=5)
    source = type("Source", (), {"gguf": "tiny.gguf", "name": "tiny"})()
    real = layouts.gguf_codes
    layouts.gguf_codes = codes_for(codes, real)
    try:
        target, _ = build_layouts(copy.deepcopy(model), None, "gguf-exact", "fp32", source)
    finally:
        layouts.gguf_codes = real
    assert bool(target.gguf) == (kernels.quant_linear() is not None)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    for prompt in ([1, 2, 3], [7, 7, 8, 9, 10]):
        want = Engine(model, StubTokenizer(), max_model_len=64).generate(prompt_ids=prompt, params=params)
        got = Engine(target, StubTokenizer(), max_model_len=64).generate(prompt_ids=prompt, params=params)
        assert got.token_ids == want.token_ids
