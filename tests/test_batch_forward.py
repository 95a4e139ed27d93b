"""Continuous batching, the bottom half: the slotted KV cache and the batched forward over the
rows of several sequences, each equal to its sequence run alone (test_batch.py: the scheduler and
the server above them)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from eagle3.errors import InputError
from eagle3.models.kv_cache import SlotCache
from eagle3.runtime.backend import choose_backend
from eagle3.runtime.target import build_target

from spec_helpers import tiny_target


# ---------------------------------------------------------------------------- the slotted cache
def test_slot_cache_plans_each_block_at_its_own_length():
    cache = SlotCache(num_layers=1, num_kv_heads=1, head_dim=2, max_len=8, slots=3)
    a, b = cache.allocate(), cache.allocate()
    cache.lengths[a] = 5
    rows = cache.plan([(b, 3), (a, 1)])
    assert rows.slot.tolist() == [b, b, b, a]
    assert rows.index.tolist() == [0, 1, 2, 5] and rows.positions.tolist() == [0, 1, 2, 5]
    assert rows.keys.tolist() == [1, 2, 3, 6]           # causal: each row sees its prefix
    assert rows.last.tolist() == [2, 3]
    cache.commit(rows)
    assert cache.lengths[a] == 6 and cache.lengths[b] == 3


def test_slot_cache_frees_a_slot_at_once_and_names_misuse():
    cache = SlotCache(num_layers=1, num_kv_heads=1, head_dim=2, max_len=4, slots=2)
    a, b = cache.allocate(), cache.allocate()
    with pytest.raises(InputError, match="no free KV cache slot"):
        cache.allocate()
    cache.lengths[a] = 3
    cache.release(a)
    assert cache.allocate() == a and cache.lengths[a] == 0
    with pytest.raises(InputError, match="overflow"):
        cache.plan([(b, 5)])
    with pytest.raises(InputError, match="twice"):
        cache.plan([(b, 1), (b, 1)])
    cache.release(b)
    with pytest.raises(InputError, match="slot 1 is not in use"):
        cache.plan([(b, 1)])


def test_a_slot_loads_a_one_sequence_cache_and_names_misuse():
    from eagle3.models.kv_cache import KVCache
    one = KVCache(num_layers=2, num_kv_heads=1, head_dim=2, max_len=6)
    one.k.normal_(), one.v.normal_()
    one.length = 5
    cache = SlotCache(num_layers=2, num_kv_heads=1, head_dim=2, max_len=8, slots=2)
    a, b = cache.allocate(), cache.allocate()
    cache.load(b, one, 4)
    assert cache.lengths == [0, 4] and torch.equal(cache.k[:, b, :, :4], one.k[:, 0, :, :4])
    assert torch.equal(cache.v[:, b, :, :4], one.v[:, 0, :, :4]) and not cache.k[:, a].any()
    with pytest.raises(InputError, match="holds 4 tokens; write"):
        cache.load(b, one, 4)
    with pytest.raises(InputError, match="up to the 5 cached tokens"):
        cache.load(a, one, 6)
    with pytest.raises(InputError, match="do not match the slots. layout"):
        cache.load(a, KVCache(num_layers=2, num_kv_heads=2, head_dim=2, max_len=6), 0)


# ---------------------------------------------------------------------------- the batched forward
LAYOUTS = {  # name -> (weight dtype, row-stable, backend switches, bit for bit)
    "fp32": (torch.float32, False, {}, False),
    "bf16-row-stable": (torch.bfloat16, True, {}, True),
    "bf16-row-stable-torch-rope": (torch.bfloat16, True, {"fused_rope": False}, True),
    "bf16-row-stable-op-by-op": (torch.bfloat16, True, {"one_call_layers": False}, True),
    "bf16-row-stable-fp16-cache": (torch.bfloat16, True, {"kv_cache_dtype": "fp16"}, True),
    "bf16-row-stable-fp16-cache-op-by-op": (torch.bfloat16, True, {"kv_cache_dtype": "fp16",
                                                                    "one_call_layers": False}, True),
}


def layout(model, name):
    dtype, stable, switches, _ = LAYOUTS[name]
    switches = dict(switches)
    kv = switches.pop("kv_cache_dtype", "auto")
    target = build_target(model, backend=replace(choose_backend("cpu", dtype, stable), **switches),
                          kv_cache_dtype=kv)
    assert kv == "auto" or target.new_cache(1).k.dtype == {"fp16": torch.float16}[kv]
    return target


def alone_logits(target, tokens: list[int], prompt: int) -> dict[int, torch.Tensor]:
    """Logits at every position of `tokens` run alone: a prefill of `prompt` tokens (all rows'
    logits), then one-token decode steps. {position: [V]}"""
    cache = target.new_cache(len(tokens))
    ids = torch.tensor([tokens])
    out = target(ids[:, :prompt], torch.arange(prompt), cache).logits[0]
    got = {p: out[p] for p in range(prompt)}
    for p in range(prompt, len(tokens)):
        got[p] = target(ids[:, p:p + 1], torch.tensor([p]), cache).logits[0, 0]
    return got


def run_batched(target, seqs: list[list[int]], schedule: list[list[tuple[int, int]]]):
    """Feed `seqs` through forward_rows as `schedule` says: per forward, (sequence, rows) blocks.
    Returns {(sequence, position): logits of that block's last row}."""
    cache = target.new_slot_cache(max(map(len, seqs)), slots=len(seqs) + 1)
    cache.allocate()                           # slot 0 stays empty: slots need not be 0..n-1
    slots = [cache.allocate() for _ in seqs]
    fed = [0] * len(seqs)
    got = {}
    for blocks in schedule:
        rows = cache.plan([(slots[i], n) for i, n in blocks])
        ids = torch.tensor([t for i, n in blocks for t in seqs[i][fed[i]:fed[i] + n]])
        logits = target.forward_rows(ids, rows, cache)
        for (i, n), row in zip(blocks, logits):
            fed[i] += n
            got[(i, fed[i] - 1)] = row
    return got


# three sequences of different lengths: chunked prefills interleaved with decode rows, one
# sequence joining late and one leaving early
SEQS_LEN = [9, 15, 6]
SCHEDULE = [[(0, 5), (1, 7)], [(0, 1), (1, 4)], [(0, 1), (1, 1), (2, 4)], [(1, 1), (0, 1), (2, 1)],
            [(2, 1), (1, 1), (0, 1)], [(1, 1)]]
PROMPTS = [5, 11, 4]


def check_batched_equals_alone(target, bit_for_bit: bool, seed: int = 0) -> int:
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, target.config.vocab_size, (n,), generator=g).tolist() for n in SEQS_LEN]
    batched = run_batched(target, seqs, SCHEDULE)
    for i, (seq, prompt) in enumerate(zip(seqs, PROMPTS)):
        alone = alone_logits(target, seq, prompt)
        for (j, pos), logits in batched.items():
            if j != i:
                continue
            if bit_for_bit:
                assert torch.equal(logits, alone[pos]), (i, pos)
            else:
                assert torch.allclose(logits, alone[pos], atol=1e-5), (i, pos)
    return len(batched)


@pytest.mark.lossless
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_batched_rows_equal_each_sequence_alone(name, one_thread):
    """Every block's last-row logits in a batched forward equal its sequence's own forward at
    that position: bit for bit on the row-stable bf16 layout, within 1e-5 on fp32."""
    target = layout(tiny_target(layers=3), name)
    assert check_batched_equals_alone(target, LAYOUTS[name][3]) == sum(len(s) for s in SCHEDULE)


@pytest.mark.lossless
def test_batched_rows_equal_alone_with_qk_norm(tmp_path, one_thread):
    """Qwen3 (q/k norm, head_dim 24): rotary and the cache write run as torch ops per row."""
    from eagle3.testing import FAMILIES, hf_model_from_dict, native_from_hf
    model = native_from_hf(hf_model_from_dict(FAMILIES["qwen3"]), tmp_path)
    check_batched_equals_alone(layout(model, "bf16-row-stable"), bit_for_bit=True)


@pytest.mark.lossless
def test_batched_rows_equal_alone_on_the_real_model(real_model):
    """The packaged SmolLM2 in the layout load_engine builds (bf16, row-stable), a few steps."""
    model, _, _ = real_model
    target = build_target(model, torch.bfloat16, row_stable=True)
    check_batched_equals_alone(target, bit_for_bit=True, seed=3)


def test_forward_rows_names_a_token_count_mismatch():
    target = layout(tiny_target(layers=1), "fp32")
    cache = target.new_slot_cache(8, slots=1)
    rows = cache.plan([(cache.allocate(), 2)])
    with pytest.raises(ValueError, match="3 tokens, rows plan 2"):
        target.forward_rows(torch.tensor([1, 2, 3]), rows, cache)


def test_row_kernels_name_an_index_outside_the_cache():
    from eagle3 import kernels
    built = kernels.state().module
    if built is None:
        pytest.skip(f"kernels not built here: {kernels.why()}")
    q, k = torch.randn(1, 4, 2, 64), torch.zeros(3, 2, 8, 64)
    with pytest.raises(RuntimeError, match=r"keys_of_row\[1\] = 9 outside \[1, 8\]"):
        built.attention(q, k, k, None, torch.tensor([0, 2]), torch.tensor([1, 9]))
    with pytest.raises(RuntimeError, match=r"slot_of_row\[0\] = 3 outside \[0, 2\]"):
        built.rope_qkv(torch.randn(2, 8 * 64), torch.ones(1, 1, 2, 64), torch.zeros(1, 1, 2, 64),
                       k, k.clone(), 0, 4, 2, torch.tensor([3, 0]), torch.tensor([0, 1]))


@pytest.mark.lossless
def test_batched_rows_equal_alone_on_gguf_codes(one_thread):
    """A target running GGUF integer codes (--weights gguf, row-stable) batches bit for bit too."""
    import copy

    from eagle3 import kernels
    if kernels.quant_linear() is None:
        pytest.skip(f"no quantized kernels: {kernels.why()}")
    from test_quant import gguf_tiny_target
    model, codes = gguf_tiny_target("Q4_1")
    target = build_target(copy.deepcopy(model), torch.float32, row_stable=True, gguf=codes)
    assert all(l.quant_types for l in target.linears)
    # one-byte inputs (on AVX512-VNNI) bring the fp16 cache; exact inputs keep fp32
    assert target.kv_dtype == (torch.float16 if any(l.one_digit for l in target.linears) else torch.float32)
    check_batched_equals_alone(target, bit_for_bit=True)


@pytest.mark.lossless
@pytest.mark.parametrize("type_name", ["Q4_1", "Q6_K"])
def test_batched_rows_in_one_parallel_region_equal_alone_and_the_composite_call(type_name):
    """One-byte inputs on head_dim 64 run a batch's rows (several slots, chunked prefills) through
    every layer in one parallel region: each block's logits equal its sequence alone and the
    composite call's (a parallel region per op), bit for bit."""
    import copy

    from eagle3 import kernels
    if not kernels.integer_dots():
        pytest.skip("no AVX512-VNNI (or EAGLE3_VNNI=0)")
    from test_quant import gguf_tiny_target, head_dim_64_target
    model, codes = gguf_tiny_target(type_name, model=head_dim_64_target("Qwen2ForCausalLM"))
    target = build_target(copy.deepcopy(model), torch.float32, row_stable=True, gguf=codes.with_int8_inputs())
    assert target.stack is not None
    check_batched_equals_alone(target, bit_for_bit=True, seed=1)
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, target.config.vocab_size, (n,), generator=g).tolist() for n in SEQS_LEN]
    in_region = run_batched(target, seqs, SCHEDULE)
    stack, target.stack = target.stack, None
    try:
        composite = run_batched(target, seqs, SCHEDULE)
    finally:
        target.stack = stack
    assert in_region.keys() == composite.keys()
    assert all(torch.equal(in_region[key], composite[key]) for key in composite)


def test_a_batch_of_one_takes_the_single_sequence_layers(monkeypatch):
    """One sequence in a step decodes through the layers' own call (the one-call C++ layer where
    there are kernels) on its slot's buffers, not the op-by-op batched path (which halved
    single-stream serving); two sequences take the batched path. Same logits either way."""
    from eagle3.runtime.layer import FastLayer
    target = layout(tiny_target(layers=2), "fp32")
    calls = {"layer": 0, "rows": 0}
    for name, key in (("__call__", "layer"), ("forward_rows", "rows")):
        real = getattr(FastLayer, name)
        monkeypatch.setattr(FastLayer, name, lambda self, *a, _r=real, _k=key, **k: (
            calls.__setitem__(_k, calls[_k] + 1), _r(self, *a, **k))[1])
    cache = target.new_slot_cache(16, slots=2)
    a, b = cache.allocate(), cache.allocate()
    one = target.forward_rows(torch.tensor([3, 4, 5]), cache.plan([(a, 3)]), cache)
    assert calls == {"layer": 2, "rows": 0}
    target.forward_rows(torch.tensor([3, 4, 5, 6]), cache.plan([(a, 1), (b, 3)]), cache)
    assert calls == {"layer": 2, "rows": 2}
    alone = target(torch.tensor([[3, 4, 5]]), torch.arange(3)[None], target.new_cache(16)).logits[0, -1]
    assert (one[0] - alone).abs().max() <= 1e-5


def test_a_batch_of_several_sequences_takes_the_one_call_layer():
    """Several sequences' rows go through csrc/layer.cpp decoder_layer with the rows' slots, cache
    indices and key counts (one C++ call a layer, as one sequence decodes), not op by op; the
    logits are the op-by-op path's bit for bit."""
    model = tiny_target(layers=2)
    backend = choose_backend("cpu", torch.bfloat16, True)
    if backend.kernels is None:
        pytest.skip("no eagle3 kernels on this CPU")
    seen = []

    class Spy:      # the kernels module, with decoder_layer's row arguments recorded
        def __getattr__(self, name):
            return getattr(backend.kernels, name)

        def decoder_layer(self, *args, **kw):
            seen.append(kw.get("slot_of_row") if "slot_of_row" in kw else (args[9:] or [None])[0])
            return backend.kernels.decoder_layer(*args, **kw)

    fast = build_target(model, backend=replace(backend, kernels=Spy()))
    ops = layout(model, "bf16-row-stable-op-by-op")
    outs = []
    for target in (fast, ops):
        cache = target.new_slot_cache(16, slots=3)
        a, b = cache.allocate(), cache.allocate()
        target.forward_rows(torch.tensor([3, 4, 5, 6]), cache.plan([(a, 1), (b, 3)]), cache)
        outs.append(target.forward_rows(torch.tensor([7, 8]), cache.plan([(a, 1), (b, 1)]), cache))
    assert len(seen) == 4 and all(s is not None for s in seen)
    assert torch.equal(outs[0], outs[1])


# ---------------------------------------------------------------------------- a tree block among the rows
@pytest.mark.lossless
@pytest.mark.parametrize("name", ["bf16-row-stable", "bf16-row-stable-op-by-op", "bf16-row-stable-fp16-cache"])
@pytest.mark.parametrize("alone_in_forward", [False, True])
def test_a_tree_block_gives_each_node_its_path_decoded_alone(name, alone_in_forward, one_thread):
    """A request's last token with a chain and an alternate branch under it, verified in a batched
    forward (beside another sequence's decode row and a prompt chunk, or alone): each node's logits
    are those of its path decoded alone, bit for bit; after the slot keeps the alternate's path,
    the next token decodes as alone."""
    from eagle3.generate.chains import Guess
    target = layout(tiny_target(layers=3), name)
    g = torch.Generator().manual_seed(2)
    V = target.config.vocab_size
    a, b, c = (torch.randint(0, V, (n,), generator=g).tolist() for n in (9, 7, 5))
    guess = Guess("suffix", [(a[-1] + 1) % V, 4], [(a[-1] + 2) % V, 6, 2])
    cache = target.new_slot_cache(40, slots=4)
    sa, sb, sc = cache.allocate(), cache.allocate(), cache.allocate()
    target.forward_rows(torch.tensor(a[:8] + b[:6]), cache.plan([(sa, 8), (sb, 6)]), cache)
    ids = [a[8]] + guess.tokens
    blocks = [(sa, len(ids))] if alone_in_forward else [(sb, 1), (sa, len(ids)), (sc, 3)]
    at = 0 if alone_in_forward else 1
    rows = cache.plan(blocks, {at: guess.ancestors()})
    first = rows.blocks[at].first_row
    feed = ids if alone_in_forward else [b[6]] + ids + c[:3]
    logits = target.forward_rows(torch.tensor(feed), rows, cache, torch.arange(first, first + len(ids)))
    paths = [a + guess.chain, a + guess.alternate]
    alone = [alone_logits(target, p, 8) for p in paths]
    want = [alone[0][8], alone[0][9], alone[0][10], alone[1][9], alone[1][10], alone[1][11]]
    for i, w in enumerate(want):
        assert torch.equal(logits[i], w), i
    cache.keep(sa, 8, [0, 3, 4, 5])                   # the alternate's path, all three accepted
    assert cache.lengths[sa] == 12
    nxt = target.forward_rows(torch.tensor([7]), cache.plan([(sa, 1)]), cache)
    assert torch.equal(nxt[0], alone_logits(target, paths[1] + [7], 8)[12])


def test_a_slot_keeps_a_path_and_names_rows_outside_its_block():
    cache = SlotCache(num_layers=1, num_kv_heads=1, head_dim=2, max_len=8, slots=1)
    s = cache.allocate()
    cache.k[0, s, 0, :, 0] = torch.arange(8.0)
    cache.lengths[s] = 7                              # a block of 5 rows at 2
    cache.keep(s, 2, [0, 2, 4])
    assert cache.lengths[s] == 5 and cache.k[0, s, 0, :5, 0].tolist() == [0, 1, 2, 4, 6]
    with pytest.raises(InputError, match="outside its block"):
        cache.keep(s, 2, [0, 3])
    rows = cache.plan([(s, 3)], {0: torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)})
    assert rows.positions.tolist() == [5, 6, 6] and rows.keys.tolist() == [8, 8, 8]
    assert rows.mask[0, 0, 2].tolist() == [True] * 5 + [True, False, True]
    with pytest.raises(InputError, match="ancestor matrix"):
        cache.plan([(s, 2)], {0: torch.ones(3, 3, dtype=torch.bool)})
