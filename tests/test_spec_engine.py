"""SpecDecoder end to end on tiny random models: cache commit, greedy identity, lossless sampling."""
from __future__ import annotations

import logging

import pytest
import torch

from eagle3.errors import ContractError
from eagle3.generate import Engine, PlainDecoder, SamplingParams
from eagle3.sampling import target_probs
from eagle3.speculative.step import Step
from eagle3.models.layers import tree_block_mask
from eagle3.speculative.decoder import SpecDecoder
from eagle3.speculative.monitor import AcceptanceMonitor
from eagle3.speculative.tree import SpecParams, build_tree
from spec_helpers import (OracleLayout, StubTokenizer, chi_square_p, oracle_draft, plain_greedy, spec_engine,
                          tiny_draft, tiny_target)

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [5, 9, 12, 7, 30, 2]
SHAPES = [SpecParams.chain(1), SpecParams.chain(4), SpecParams(3, 1, 4, 0.0), SpecParams(2, 3, 6, 0.0),
          SpecParams(3, 4, 10, 0.0), SpecParams(4, 5, 16, 0.0)]
DYNAMIC = [SpecParams(4, 5, 8, min_prob=0.05), SpecParams(3, 4, 10, min_prob=0.3),
           SpecParams.chain(4, min_prob=0.2)]
GREEDY = SamplingParams(max_new_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def target():
    return tiny_target(0)


@pytest.fixture(scope="module")
def reference(target):
    return plain_greedy(target, PROMPT, 40)


# ---------------------------------------------------------------------------- cache commit
def test_keep_leaves_the_cache_of_the_accepted_path(target):
    n = len(PROMPT)
    cache = target.new_cache(32)
    target(torch.tensor([PROMPT]), torch.arange(n), cache)
    tree = build_tree(torch.tensor([4, 8, 1, 17, 3, 22]), torch.tensor([-1, 0, 0, 1, 3, 2]), n, 3)
    out = target(tree.tokens[None], tree.positions, cache, attn_mask=tree_block_mask(n, tree.mask))
    path = [0, 1, 3, 4]
    cache.keep(n, torch.tensor(path))
    ref_cache = target.new_cache(32)
    seq = PROMPT + tree.tokens[path].tolist()
    ref = target(torch.tensor([seq]), torch.arange(len(seq)), ref_cache)
    assert cache.length == ref_cache.length == n + len(path)
    for mine, want in ((cache.k, ref_cache.k), (cache.v, ref_cache.v)):
        assert torch.allclose(mine[..., :cache.length, :], want[..., :cache.length, :], atol=1e-5)
    assert torch.allclose(out.logits[0, path], ref.logits[0, n:], atol=1e-4)  # tree rows = causal


def run_decoder(target, draft, spec: SpecParams, steps: int):
    cache, draft_cache = target.new_cache(128), draft.new_cache(128)
    dec = SpecDecoder(target, draft, cache, draft_cache, SamplingParams(), spec)
    emitted = dec.prefill(PROMPT, 64).tokens
    for _ in range(steps):
        emitted += dec.step().tokens
    return dec, emitted


@pytest.mark.parametrize("spec", [SpecParams.chain(3), SpecParams(3, 3, 8, 0.0)])
def test_caches_after_steps_equal_one_pass_over_the_sequence(target, reference, spec):
    draft = oracle_draft(target, PROMPT + reference)
    dec, emitted = run_decoder(target, draft, spec, steps=5)
    assert emitted == reference[:len(emitted)] and len(emitted) > 5 + 3   # drafts were accepted
    seq = torch.tensor([PROMPT + emitted[:-1]])           # the last token is the pending root
    length = seq.shape[1]
    assert dec.cache.length == dec.draft_cache.length == length
    full_cache, full_draft = target.new_cache(128), draft.new_cache(128)
    out = target(seq, torch.arange(length), full_cache, capture_ids=draft.config.aux_layer_ids)
    nxt = torch.tensor([PROMPT[1:] + emitted])
    with torch.inference_mode():
        draft(nxt, torch.arange(length), full_draft, features=out.aux)
    for mine, want in ((dec.cache, full_cache), (dec.draft_cache, full_draft)):
        assert torch.allclose(mine.k[..., :length, :], want.k[..., :length, :], atol=1e-4)
        assert torch.allclose(mine.v[..., :length, :], want.v[..., :length, :], atol=1e-4)


# ---------------------------------------------------------------------------- greedy identity
@pytest.mark.parametrize("spec", SHAPES, ids=str)
def test_greedy_identical_with_random_draft(target, reference, spec):
    for draft in (tiny_draft(target), tiny_draft(target, seed=2, draft_vocab=12)):
        result = spec_engine(target, draft, spec).generate(prompt_ids=PROMPT, params=GREEDY)
        assert result.token_ids == reference


@pytest.mark.parametrize("spec", SHAPES, ids=str)
def test_greedy_identical_with_oracle_draft(target, reference, spec):
    result = spec_engine(target, oracle_draft(target, PROMPT + reference), spec).generate(
        prompt_ids=PROMPT, params=GREEDY)
    assert result.token_ids == reference
    assert result.tau >= 1.0 + 0.5 * min(spec.depth, 2)   # most proposals are accepted
    assert all(s.proposed == spec.num_draft_tokens - 1 for s in result.decode_steps)


@pytest.mark.parametrize("spec", DYNAMIC, ids=str)
def test_greedy_identical_with_dynamic_tree_size(target, reference, spec):
    sizes = set()
    for draft in (tiny_draft(target), oracle_draft(target, PROMPT + reference)):
        result = spec_engine(target, draft, spec).generate(prompt_ids=PROMPT, params=GREEDY)
        assert result.token_ids == reference
        sizes |= {s.proposed for s in result.decode_steps}
    assert min(sizes) >= 1 and len(sizes) > 1          # the verified tree really varies in size
    assert max(sizes) <= spec.num_draft_tokens - 1


def test_greedy_identical_with_eagle1_draft(target, reference):
    draft = tiny_draft(target, algorithm="eagle")
    draft.set_lm_head(target.lm_head.weight)
    for spec in (SpecParams.chain(3), SpecParams(3, 3, 8, 0.0)):
        result = spec_engine(target, draft, spec).generate(prompt_ids=PROMPT, params=GREEDY)
        assert result.token_ids == reference


def test_two_layer_draft_greedy_identical_and_its_caches_equal_one_pass(target, reference):
    """num_layers = 2 (the recipe study's (j)): both draft layers' caches stay those of one pass."""
    draft = tiny_draft(target, layers=2)
    for spec in (SpecParams.chain(3), SpecParams(3, 3, 8, 0.0)):
        assert spec_engine(target, draft, spec).generate(prompt_ids=PROMPT, params=GREEDY).token_ids == reference
    dec, emitted = run_decoder(target, draft, SpecParams(3, 3, 8, 0.0), steps=5)
    seq = torch.tensor([PROMPT + emitted[:-1]])
    length = seq.shape[1]
    out = target(seq, torch.arange(length), target.new_cache(128), capture_ids=draft.config.aux_layer_ids)
    full = draft.new_cache(128)
    with torch.inference_mode():
        draft(torch.tensor([PROMPT[1:] + emitted]), torch.arange(length), full, features=out.aux)
    assert dec.draft_cache.k.shape[0] == 2 and dec.draft_cache.length == length
    assert torch.allclose(dec.draft_cache.k[..., :length, :], full.k[..., :length, :], atol=1e-4)
    assert torch.allclose(dec.draft_cache.v[..., :length, :], full.v[..., :length, :], atol=1e-4)


def test_stop_token_inside_accepted_draft_tokens(target, reference):
    stop = reference[11]
    plain = Engine(target, StubTokenizer(), max_model_len=100)
    params = SamplingParams(max_new_tokens=40, stop_token_ids=(stop,))
    want = plain.generate(prompt_ids=PROMPT, params=params)
    got = spec_engine(target, oracle_draft(target, PROMPT + reference), SpecParams(2, 4, 8, 0.0)) \
        .generate(prompt_ids=PROMPT, params=params)
    assert got.token_ids == want.token_ids and got.finish_reason == "stop"
    assert stop not in got.token_ids


@pytest.mark.parametrize("temperature", [1e-300, 1e-38, 1e-6])
def test_tiny_temperature_decodes_greedily(target, reference, temperature):
    """`logits / T` overflows below T ~ 1e-38: such temperatures take the greedy path in plain
    decoding, in the speculative decoder's root draw and in its verifier."""
    params = SamplingParams(temperature=temperature, max_new_tokens=40, ignore_eos=True, seed=0)
    assert params.greedy and not SamplingParams(temperature=1e-4).greedy
    plain = Engine(target, StubTokenizer(), max_model_len=100)
    assert plain.generate(prompt_ids=PROMPT, params=params).token_ids == reference
    spec = spec_engine(target, oracle_draft(target, PROMPT + reference), SpecParams(2, 4, 8, 0.0))
    result = spec.generate(prompt_ids=PROMPT, params=params)
    assert result.token_ids == reference and result.tau > 1.5


# ---------------------------------------------------------------------------- lossless sampling
def exact_joint(target, prompt: list[int], params: SamplingParams, num_tokens: int) -> torch.Tensor:
    """P(t1..tn | prompt) under target_probs, by enumerating every prefix: [V] * n."""
    vocab = target.config.vocab_size
    joint, prefixes = torch.ones(1), [[]]
    for _ in range(num_tokens):
        ids = torch.tensor([prompt + p for p in prefixes])
        out = target(ids, torch.arange(ids.shape[1]), target.new_cache(ids.shape[1], len(prefixes)),
                     logits_rows=slice(-1, None))
        joint = (joint[:, None] * target_probs(out.logits[:, -1], params).double()).flatten()
        prefixes = [p + [v] for p in prefixes for v in range(vocab)]
    return joint.view([vocab] * num_tokens)


def sample_after_first(dec: SpecDecoder, prompt: list[int], num: int):
    """Prefill once (first token t1 fixed), then `num` times: rewind to just after the prefill and
    take the next two tokens from spec steps. Returns t1, counts [V, V] of (t2, t3), tau."""
    t1 = dec.prefill(prompt, 8).tokens[0]
    dec._catch_up()          # the draft over the prompt now: prefill leaves its rows pending
    saved = (dec.cache.length, dec.root, dec.head)
    vocab = dec.target.config.vocab_size
    counts, steps = torch.zeros(vocab, vocab), 0
    for _ in range(num):
        dec.cache.truncate(saved[0])
        dec.draft_cache.truncate(saved[0])
        dec.root, dec.head = saved[1:]
        tokens = []
        while len(tokens) < 2:
            tokens += dec.step().tokens
            steps += 1
        counts[tokens[0], tokens[1]] += 1
    return t1, counts, (2 * num) / steps


def test_exact_reference_matches_single_sequence_forwards():
    target = tiny_target(3, vocab=8, std=0.5)
    params = SamplingParams(temperature=0.9, top_p=0.8)
    exact = exact_joint(target, [1, 2, 3], params, 2)
    first = int(exact.sum(1).argmax())
    for seq in ([1, 2, 3], [1, 2, 3, first]):
        logits = target(torch.tensor([seq]), torch.arange(len(seq)), target.new_cache(8)).logits
        want = target_probs(logits[0, -1], params).double()
        got = exact.sum(1) if len(seq) == 3 else exact[first] / exact[first].sum()
        assert torch.allclose(got, want, atol=1e-6)


def greedy_oracle(target, prompt: list[int], params: SamplingParams):
    """The first sampled token (same seed as the decoder's) and a draft proposing the target's
    greedy continuation after it, so the first spec step usually accepts something."""
    t1 = PlainDecoder(target, target.new_cache(16), params).prefill(prompt, 1).tokens[0]
    seq = prompt + [t1] + plain_greedy(target, prompt + [t1], 6)
    return t1, oracle_draft(target, seq)


@pytest.mark.parametrize("params,spec,oracle", [
    (SamplingParams(temperature=1.0, seed=0), SpecParams(3, 2, 6, 0.0), False),
    (SamplingParams(temperature=0.8, top_p=0.7, seed=1), SpecParams(2, 3, 5, 0.0), True),
    (SamplingParams(temperature=1.2, top_k=3, seed=2), SpecParams.chain(2), True),
    (SamplingParams(temperature=1.0, seed=3), SpecParams(3, 3, 8, min_prob=0.2), True),
], ids=["t1-tree-random", "top_p-tree-oracle", "top_k-chain-oracle", "t1-dynamic-oracle"])
def test_sampling_is_lossless(params, spec, oracle):
    """Tokens from spec steps follow exactly the distribution plain sampling draws from."""
    target = tiny_target(3, vocab=8, std=0.5)
    prompt = [1, 2, 3]
    want_t1, draft = greedy_oracle(target, prompt, params) if oracle else (None, tiny_draft(target, 6))
    dec = SpecDecoder(target, draft, target.new_cache(32), draft.new_cache(32), params, spec)
    t1, counts, tau = sample_after_first(dec, prompt, 600)
    assert want_t1 in (None, t1)
    assert tau > 1.2                                         # speculation really took part
    exact = exact_joint(target, prompt + [t1], params, 2)
    assert chi_square_p(counts, exact) > 0.01


# ---------------------------------------------------------------------------- contracts
def test_feature_width_checked_every_step(target, reference):
    draft = tiny_draft(target)
    dec, _ = run_decoder(target, draft, SpecParams.chain(2), steps=1)
    dec.capture_ids = dec.capture_ids[:1]       # one captured state reaches fc: the incident
    with pytest.raises(ContractError, match="draft features width"):
        dec.step()


def test_draft_for_another_target_is_rejected(target):
    other = tiny_target(0, vocab=40)
    with pytest.raises(ContractError, match="vocab"):
        SpecDecoder(target, tiny_draft(other), target.new_cache(8), target.new_cache(8),
                    SamplingParams(), SpecParams())


# ---------------------------------------------------------------------------- monitor
def test_monitor_warns_once_when_nothing_is_accepted(caplog):
    mon = AcceptanceMonitor(window=8)
    with caplog.at_level(logging.WARNING, logger="eagle3.speculative"):
        for _ in range(7):
            mon.observe(Step([1], 0, proposed=4))
        assert not mon.degraded and not caplog.records
        for _ in range(10):
            mon.observe(Step([1], 0, proposed=4))
        assert mon.degraded and len(caplog.records) == 1
        assert "layer ids" in caplog.text and "EAGLE" in caplog.text
        mon.observe(Step([1, 2, 3], 2, proposed=4))
    assert not mon.degraded
    snap = mon.snapshot()
    assert snap["steps"] == 18 and snap["proposed_tokens"] == 72 and snap["accepted_tokens"] == 2
    assert snap["accept_len_histogram"] == {0: 17, 2: 1}
    assert snap["acceptance_per_position"] == [1 / 18, 1 / 18]
    assert mon.tau == pytest.approx(1 + 2 / 18)


def test_monitor_stays_quiet_when_a_working_draft_hits_a_bad_stretch(caplog):
    """Sampled text can turn unpredictable for a while (a zero streak); a draft that has been
    accepting is not mis-paired, so no warning. From the start, the same streak warns."""
    mon = AcceptanceMonitor(window=8)
    with caplog.at_level(logging.WARNING, logger="eagle3.speculative"):
        for _ in range(20):
            mon.observe(Step([1, 2], 1, proposed=4))
        for _ in range(30):
            mon.observe(Step([1], 0, proposed=4))
        assert not mon.degraded and not caplog.records      # lifetime: 20 accepted in 50 steps
        for _ in range(400):
            mon.observe(Step([1], 0, proposed=4))
        assert mon.degraded and len(caplog.records) == 1    # 20 in 450: below 0.05 per step


def test_monitor_ignores_plain_steps_on_an_engine_with_a_draft(caplog):
    mon = AcceptanceMonitor(window=8)
    with caplog.at_level(logging.WARNING, logger="eagle3.speculative"):
        for _ in range(20):
            mon.observe(Step([1], 0, proposed=0))     # speculative=False: nothing was proposed
    assert mon.steps == 0 and not mon.degraded and not caplog.records


def test_engine_monitor_sees_acceptance(target, reference):
    engine = spec_engine(target, oracle_draft(target, PROMPT + reference), SpecParams(2, 3, 6, 0.0))
    result = engine.generate(prompt_ids=PROMPT, params=GREEDY)
    snap = engine.monitor.snapshot()
    assert snap["steps"] == len(result.decode_steps) and not snap["degraded"]
    assert snap["tau"] == pytest.approx(result.tau, rel=0.1)


# ---------------------------------------------------------------------------- real model
@pytest.mark.real
def test_real_smollm2_random_draft_greedy_identical(real_model):
    from eagle3.draft.model import DraftConfig, Eagle3Draft
    target, tok, _ = real_model
    torch.manual_seed(0)
    draft = Eagle3Draft(DraftConfig.for_target(target.config)).eval()
    draft.set_embedding(target.embed_tokens.weight)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain = Engine(target, tok, max_model_len=256)
    ids = plain.encode("List three uses of copper.")
    want = plain.generate(prompt_ids=ids, params=params).token_ids
    for spec in (SpecParams.chain(3), SpecParams(3, 3, 8, 0.0)):
        got = Engine(target, tok, draft=draft, spec=spec, max_model_len=256).generate(
            prompt_ids=ids, params=params)
        assert got.token_ids == want
        assert all(s.proposed == spec.num_draft_tokens - 1 for s in got.decode_steps)


@pytest.mark.lossless
def test_bf16_weights_stay_close_to_fp32():
    """bf16 GEMM weights: close to fp32 (not equal: the weights and GEMM inputs are rounded)."""
    import copy
    import tempfile
    from pathlib import Path

    from eagle3.runtime.target import build_target
    from eagle3.testing import FAMILIES, hf_model_from_dict, native_from_hf
    with tempfile.TemporaryDirectory() as tmp:
        target = native_from_hf(hf_model_from_dict(FAMILIES["llama3"]), Path(tmp))
    fp32 = build_target(copy.deepcopy(target))
    bf16 = build_target(copy.deepcopy(target), torch.bfloat16)
    ids = torch.randint(0, 96, (1, 16), generator=torch.Generator().manual_seed(0))
    ref = fp32(ids, torch.arange(16), fp32.new_cache(32)).logits
    low = bf16(ids, torch.arange(16), bf16.new_cache(32)).logits
    assert 0 < (ref - low).abs().max() < 0.05 * ref.abs().max()


needs_bf16 = pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                                reason="no oneDNN bf16 here")


def path_logits_one_by_one(model, prefix: torch.Tensor, tree, node: int) -> torch.Tensor:
    """The logits of a tree node computed the plain way: its path decoded one token at a time."""
    path = [node]
    while int(tree.parents[path[-1]]) >= 0:
        path.append(int(tree.parents[path[-1]]))
    n = prefix.numel()
    cache = model.new_cache(64)
    model(prefix[None], torch.arange(n), cache)
    for depth, j in enumerate(reversed(path)):
        logits = model(tree.tokens[j:j + 1][None], torch.tensor([n + depth]), cache).logits[0, 0]
    return logits


@pytest.mark.lossless
@needs_bf16
def test_bf16_target_verify_equals_decode_bit_for_bit():
    """bf16 GEMM weights round every input, so a last-bit difference between a verify block and
    one-token decode grows layer by layer and can flip a greedy choice. Packed with row_stable
    (what load_engine does for weights="bf16"), every tree node's logits equal its path decoded
    one token at a time, exactly. Seed 2 differs on 2 of 9 nodes without row_stable (SDPA and
    oneDNN's one-row kernel), so this catches a regression."""
    import copy

    from eagle3.runtime.target import build_target
    base = tiny_target(2, vocab=64, std=0.15, hidden=64, intermediate=1536)
    model = build_target(copy.deepcopy(base), torch.bfloat16, row_stable=True)
    prefix = torch.randint(0, 64, (12,), generator=torch.Generator().manual_seed(1))
    parents = torch.tensor([-1, 0, 0, 1, 3, 2, 4, 6, 1])
    tree = build_tree(torch.tensor([4, 8, 1, 17, 3, 22, 5, 9, 40]), parents, 12, 5)
    cache = model.new_cache(64)
    model(prefix[None], torch.arange(12), cache)
    block = model(tree.tokens[None], tree.positions, cache, attn_mask=tree_block_mask(12, tree.mask))
    for j in range(9):
        assert torch.equal(block.logits[0, j], path_logits_one_by_one(model, prefix, tree, j)), j


@pytest.mark.lossless
@needs_bf16
@pytest.mark.parametrize("weights", ["bf16", "gguf"])
def test_real_smollm2_speculation_is_token_identical(real_model, weights):
    """The packaged model with bf16 weights or the GGUF's own codes: greedy speculation with the
    shipped draft equals plain decoding on the same weights token for token (before row_stable, a
    bf16 8-token block's logits were up to 0.31 apart from one-token decode and outputs diverged).
    A fixed tree: the adaptive policy may choose plain steps on a busy machine."""
    from eagle3.api import load_engine
    from eagle3.config import RunConfig
    import gc
    engine = load_engine(spec=SpecParams(4, 5, 8, 0.05), config=RunConfig(weights=weights))
    assert gc.get_freeze_count() > 100_000     # the loaded engine is out of the collector's passes
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    for prompt in ("Explain how a bicycle gear works.", "Write a haiku about rain."):
        ids = engine.encode(prompt)
        want = engine.generate(prompt_ids=ids, params=params, speculative=False).token_ids
        got = engine.generate(prompt_ids=ids, params=params)
        assert got.token_ids == want
        assert got.tau > 1.2           # the draft proposed and some proposals were accepted


@pytest.mark.lossless
@needs_bf16
def test_bf16_draft_weights_keep_greedy_identity(target, reference):
    """The draft only proposes: packing it with bf16 weights changes proposals, never the output."""
    import copy

    from eagle3.draft.inference import build_draft_layout
    draft = oracle_draft(target, PROMPT + reference)
    low = OracleLayout(build_draft_layout(copy.deepcopy(draft), torch.bfloat16), draft)
    for spec in (SpecParams.chain(4), SpecParams(3, 4, 10, 0.0)):
        result = spec_engine(target, low, spec).generate(prompt_ids=PROMPT, params=GREEDY)
        assert result.token_ids == reference
        assert result.tau >= 2.0      # a bf16 oracle still proposes mostly the right tokens


needs_q4 = pytest.mark.skipif(__import__("eagle3.layouts").layouts.q4_draft_unavailable() is not None,
                              reason="no q4 drafts here (eagle3.layouts.q4_draft_unavailable)")


@pytest.mark.lossless
@needs_q4
def test_q4_draft_weights_keep_greedy_identity(target, reference):
    """A q4 draft (4-bit codes, inputs rounded to a byte) changes proposals, never the output."""
    import copy

    from eagle3.draft.inference import build_draft_layout
    draft = oracle_draft(target, PROMPT + reference)
    layout = build_draft_layout(copy.deepcopy(draft), quantize=True)
    assert layout.weights_name == "q4" and all(l.one_digit for l in layout.linears)
    low = OracleLayout(layout, draft)
    for spec in (SpecParams.chain(4), SpecParams(3, 4, 10, 0.0)):
        result = spec_engine(target, low, spec).generate(prompt_ids=PROMPT, params=GREEDY)
        assert result.token_ids == reference
        assert result.tau >= 2.0      # a q4 oracle still proposes mostly the right tokens


def test_draft_weights_choice_is_checked():
    from eagle3.errors import InputError
    from eagle3.layouts import draft_weight_dtype, resolve_draft_weights
    assert draft_weight_dtype("fp32") == torch.float32 and resolve_draft_weights("fp32") == "fp32"
    with pytest.raises(InputError, match="draft_weights='int4'"):
        resolve_draft_weights("int4")


# ---------------------------------------------------------------------------- early stop
@pytest.mark.parametrize("spec", [SpecParams(3, 4, 6, 0.0), SpecParams(4, 5, 8, 0.0), SpecParams(2, 6, 4, 0.0),
                                  SpecParams(4, 5, 8, min_prob=0.05)], ids=str)
def test_drafting_stops_early_only_when_the_tree_cannot_change(target, spec):
    """`_settled` ends drafting once no deeper node can be kept: the tree equals the full expansion's."""
    draft = tiny_draft(target, seed=3)
    dec, _ = run_decoder(target, draft, spec, steps=0)
    dec._catch_up()                        # the draft over the prompt (prefill leaves it pending)
    calls = {"early": 0, "full": 0}
    for _ in range(12):
        level = dec._draft_level
        trees = {}
        for mode in ("early", "full"):
            dec._settled = (lambda *a: False) if mode == "full" else SpecDecoder._settled.__get__(dec)

            def counted(*a, _mode=mode, **kw):
                calls[_mode] += 1
                return level(*a, **kw)
            dec._draft_level = counted
            with torch.inference_mode():
                trees[mode] = dec.draft_tree()
        for a, b in zip(trees["early"], trees["full"]):
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
        del dec._settled, dec._draft_level                  # the step drafts with the class's own
        dec.step()
    assert calls["full"] == 12 * (spec.depth - 1)
    assert calls["early"] < calls["full"]      # a random draft is unsure: the stop does happen


@pytest.mark.lossless
@pytest.mark.parametrize("weights", ["fp32", "bf16"])
@pytest.mark.parametrize("spec", [SpecParams.chain(4), SpecParams(3, 4, 10, 0.0), SpecParams(4, 5, 8, 0.05)])
def test_greedy_identical_through_the_inference_layouts(target, reference, weights, spec):
    """Speculation on the inference layouts load_engine builds (whatever backend this machine and
    EAGLE3_KERNELS give: avx512, or onednn with fp64 row-stable attention) equals plain decoding
    on the same target layout, token for token."""
    from eagle3.layouts import build_layouts
    if weights == "bf16" and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("no oneDNN bf16 here")
    laid_target, _ = build_layouts(target, None, weights)
    want = Engine(laid_target, StubTokenizer(), max_model_len=200).generate(
        prompt_ids=PROMPT, params=GREEDY).token_ids
    draft = oracle_draft(target, PROMPT + want)       # steered to this layout's own output
    _, laid_draft = build_layouts(target, draft, weights, "bf16" if weights == "bf16" else "fp32")
    steered = OracleLayout(laid_draft, draft)
    result = spec_engine(laid_target, steered, spec).generate(prompt_ids=PROMPT, params=GREEDY)
    assert result.token_ids == want
    assert result.tau > 1.5            # the oracle's proposals were verified and accepted
