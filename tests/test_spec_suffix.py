"""SpecDecoder with suffix candidates merged into its trees, on tiny random models: greedy
identity, cache contents, lossless sampling, the option's checks."""
from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from eagle3.errors import InputError
from eagle3.generate import SamplingParams
from eagle3.speculative.decoder import SpecDecoder
from eagle3.speculative.tree import SpecParams
from spec_helpers import (assert_caches_equal_one_pass, chi_square_p, oracle_draft, plain_greedy, spec_engine,
                          tiny_draft, tiny_target)
from test_spec_engine import exact_joint

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [1, 2, 3, 4, 5, 1, 2, 3]        # the target (vocab 8) falls into repeats after it
MAX_NEW = 40
GREEDY = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
SHAPES = [SpecParams(1, 1, 2, 0.0, suffix_tokens=8), SpecParams(1, 3, 4, 0.0, suffix_tokens=4),
          SpecParams(2, 3, 6, 0.0, suffix_tokens=6), SpecParams(3, 4, 10, 0.3, suffix_tokens=12)]


@pytest.fixture(scope="module")
def target():
    return tiny_target(3, vocab=8, std=0.5)


@pytest.fixture(scope="module")
def reference(target):
    return plain_greedy(target, PROMPT, MAX_NEW)


def generate(target, draft, spec: SpecParams):
    # the context is exactly prompt + max_new_tokens: the cache slack must hold the merged block
    return spec_engine(target, draft, spec, max_len=len(PROMPT) + MAX_NEW).generate(
        prompt_ids=PROMPT, params=GREEDY)


# ---------------------------------------------------------------------------- greedy identity
@pytest.mark.parametrize("spec", SHAPES, ids=str)
def test_greedy_identical_with_suffix_candidates(target, reference, spec):
    for draft in (tiny_draft(target), oracle_draft(target, PROMPT + reference)):
        result = generate(target, draft, spec)
        assert result.token_ids == reference
        steps = result.decode_steps
        assert all(0 <= s.accepted_suffix <= s.accepted for s in steps)
        assert all(s.proposed <= spec.max_tree_size - 1 for s in steps)
    random_draft = generate(target, tiny_draft(target), spec).decode_steps
    assert sum(s.accepted_suffix for s in random_draft) > 0     # suffix nodes were accepted
    draft_only = generate(target, tiny_draft(target), replace(spec, suffix_tokens=0)).decode_steps
    assert sum(s.accepted for s in random_draft) > sum(s.accepted for s in draft_only)


def test_a_suffix_chain_reaches_below_the_draft_depth(target, reference):
    spec = SHAPES[0]                                            # draft depth 1, 8 suffix nodes
    steps = generate(target, tiny_draft(target), spec).decode_steps
    assert max(s.accepted for s in steps) > spec.depth          # more than the draft could give
    draft = tiny_draft(target)
    dec = SpecDecoder(target, draft, target.new_cache(64), draft.new_cache(64), SamplingParams(), spec)
    dec.prefill(PROMPT + reference[:20], 8)                     # its root reference[20] ends a
    assert dec.suffix.propose()                                 # repeated pair: a continuation
    dec._catch_up()                                             # the draft over the prompt
    tree = dec.draft_tree()
    assert int(tree.depth.max()) >= spec.suffix_tokens == tree.paths.shape[1] - 1
    assert tree.size == spec.num_draft_tokens + spec.suffix_tokens


def test_suffix_is_off_by_default(target, reference):
    assert SpecParams().suffix_tokens == 0
    draft = tiny_draft(target)
    dec = SpecDecoder(target, draft, target.new_cache(64), draft.new_cache(64), SamplingParams())
    dec.prefill(PROMPT, 8)
    with torch.inference_mode():
        dec._catch_up()                                         # the draft over the prompt
        assert dec.suffix is None and dec.draft_tree().sources is None


def test_caches_after_suffix_steps_equal_one_pass_over_the_sequence(target, reference):
    """Suffix nodes take their target features from the verify forward: the draft cache after
    accepting them equals one pass over the sequence."""
    draft = tiny_draft(target)
    dec = SpecDecoder(target, draft, target.new_cache(128), draft.new_cache(128), SamplingParams(),
                      SHAPES[2])
    emitted, suffix_accepted = dec.prefill(PROMPT, 64).tokens, 0
    while len(emitted) < 30:
        step = dec.step()
        emitted += step.tokens
        suffix_accepted += step.accepted_suffix
    assert emitted == reference[:len(emitted)] and suffix_accepted > 0
    assert_caches_equal_one_pass(dec, target, draft, PROMPT, emitted)


# ---------------------------------------------------------------------------- lossless sampling
def sample_two_after_first(dec: SpecDecoder, prompt: list[int], num: int):
    """Like test_spec_engine.sample_after_first, rewinding the suffix index too. Returns t1,
    counts [V, V] of (t2, t3), and the suffix-only tokens accepted."""
    t1 = dec.prefill(prompt, 8).tokens[0]
    dec._catch_up()          # the draft over the prompt now: prefill leaves its rows pending
    saved = (dec.cache.length, dec.root, dec.head, copy.deepcopy(dec.suffix))
    vocab = dec.target.config.vocab_size
    counts, via_suffix = torch.zeros(vocab, vocab), 0
    for _ in range(num):
        for cache in dec.caches:
            cache.truncate(saved[0])
        dec.root, dec.head, dec.suffix = saved[1], saved[2], copy.deepcopy(saved[3])
        dec.suffix_last = None
        tokens = []
        while len(tokens) < 2:
            step = dec.step()
            tokens += step.tokens
            via_suffix += step.accepted_suffix
        counts[tokens[0], tokens[1]] += 1
    return t1, counts, via_suffix


@pytest.mark.parametrize("params,spec,cut", [
    (SamplingParams(temperature=1.0, seed=0), SpecParams(2, 2, 4, 0.0, suffix_tokens=4), 23),
    (SamplingParams(temperature=0.8, top_p=0.8, seed=1), SpecParams(1, 1, 2, 0.0, suffix_tokens=6), 7),
], ids=["t1-tree", "top_p-chain"])
def test_sampling_with_suffix_candidates_is_lossless(target, reference, params, spec, cut):
    """The prompts (greedy output cut where it repeats) make the target's next tokens the suffix
    continuation about half the time (measured from the exact joint: 0.52 and 0.55)."""
    prompt = PROMPT + reference[:cut]
    draft = tiny_draft(target, 6)
    dec = SpecDecoder(target, draft, target.new_cache(64), draft.new_cache(64), params, spec)
    t1, counts, via_suffix = sample_two_after_first(dec, prompt, 600)
    assert via_suffix > 150                                    # suffix tokens took part
    assert chi_square_p(counts, exact_joint(target, prompt + [t1], params, 2)) > 0.01


# ---------------------------------------------------------------------------- checks
def test_suffix_tokens_is_checked_and_sized():
    with pytest.raises(InputError, match="suffix_tokens"):
        SpecParams(suffix_tokens=-1)
    with pytest.raises(InputError, match="suffix_tokens"):
        SpecParams(4, 5, 8, suffix_tokens=249)
    assert SpecParams(4, 5, 8, suffix_tokens=248).max_tree_size == 256
    assert SpecParams(4, 5, 8, 0.0, suffix_tokens=12).cache_slack == 8 + 12 + 1
    assert SpecParams(4, 6, 8, 0.0, suffix_tokens=4).cache_slack == 5 * 4 + 1   # tree rows win


def test_accepted_suffix_counts_suffix_only_nodes():
    from eagle3.speculative.decoder import suffix_only
    from eagle3.speculative.merge import BOTH, DRAFT, SUFFIX
    from eagle3.speculative.tree import build_tree
    tree = build_tree(torch.tensor([0, 1, 2, 3, 4]), torch.tensor([-1, 0, 1, 2, 0]), 3, 3,
                      [0, BOTH, SUFFIX, SUFFIX, DRAFT])
    assert suffix_only(tree, [0, 1, 2, 3]) == 2 and suffix_only(tree, [0, 4]) == 0
    assert suffix_only(tree._replace(sources=None), [0, 1, 2, 3]) == 0


# ---------------------------------------------------------------------------- no draft at all
def draftless_policy(greedy: bool = True):
    """What api.adaptive_policy(target, None) makes (no tree shapes: suffix-only blocks or plain),
    probing every other step: a 40-token run sees the repeats early. probe_share=0: the probes'
    intervals then do not depend on the machine's timing of this run's steps (the costs are
    corrected by wall time, and a slow moment in a busy suite made a probe look dear enough to
    wait past the repeats)."""
    from eagle3.runtime.costs import CostTable
    from eagle3.speculative.policy import DRAFTLESS_SUFFIX_TOKENS, AdaptivePolicy
    table = CostTable((1, 2, 4, 8, 16, 32, 64), (1.0, 1.05, 1.1, 1.2, 1.4, 1.8, 2.6), ())
    return AdaptivePolicy((), table, suffix_only_tokens=DRAFTLESS_SUFFIX_TOKENS, probe_every=2,
                          max_probe_every=4, probe_share=0)


def test_a_target_without_a_draft_speculates_with_suffix_blocks(target, reference):
    """No draft model: suffix-only blocks where the index matches, plain steps elsewhere; the
    output is plain decoding's, token for token, and no draft cache or pending rows exist."""
    from eagle3.generate import Engine
    from spec_helpers import StubTokenizer
    engine = Engine(target, StubTokenizer(), max_model_len=len(PROMPT) + MAX_NEW, policy=draftless_policy)
    assert engine.speculative and engine.draft_cache is None
    result = engine.generate(prompt_ids=PROMPT, params=GREEDY)
    assert result.token_ids == reference
    arms = {s.arm for s in result.decode_steps}
    assert arms <= {"suffix", "plain"} and "suffix" in arms
    assert sum(s.accepted for s in result.decode_steps) >= 3          # copied tokens were accepted


def test_a_draftless_decoder_keeps_nothing_for_a_draft(target):
    from eagle3.speculative.policy import AdaptivePolicy
    dec = SpecDecoder(target, None, target.new_cache(96), None, SamplingParams(), policy=draftless_policy())
    dec.prefill(PROMPT, 40)
    for _ in range(12):
        dec.step()
    assert dec.pending == [] and dec.caches == (dec.cache,)
    with pytest.raises(InputError, match="without a draft needs a policy of suffix-only blocks"):
        SpecDecoder(target, None, target.new_cache(96), None, SamplingParams())
    with pytest.raises(InputError, match="a tree shape or suffix-only blocks"):
        AdaptivePolicy((), draftless_policy().costs)


def test_sampling_without_a_draft_is_lossless(target, reference):
    """Suffix-only blocks under sampling: the joint of the next two tokens is the target's."""
    params = SamplingParams(temperature=1.0, seed=0)
    prompt = PROMPT + reference[:23]
    dec = SpecDecoder(target, None, target.new_cache(64), None, params, policy=draftless_policy(False))
    t1, counts, via_suffix = sample_two_after_first(dec, prompt, 600)
    assert via_suffix > 150
    assert chi_square_p(counts, exact_joint(target, prompt + [t1], params, 2)) > 0.01


def test_load_engine_speculates_without_a_draft_where_none_is_shipped(monkeypatch):
    """draft="default" for a model without a shipped draft, or draft="suffix": a suffix-only
    policy; draft="none": plain decoding."""
    import eagle3.api as api
    from eagle3.config import REFERENCE, RunConfig
    from spec_helpers import StubTokenizer
    REF = RunConfig(weights=REFERENCE, draft_weights=REFERENCE)    # no layout to build
    tiny = tiny_target(2, vocab=8)
    monkeypatch.setattr(api, "load_target", lambda model, dev, dtype: (tiny, StubTokenizer()))
    monkeypatch.setattr(api, "adaptive_policy",
                        lambda target, draft, **kw: (lambda greedy=True: draftless_policy(greedy)))
    assert api.load_engine("some-model", config=REF).speculative
    assert api.load_engine("some-model", draft="suffix", config=REF).speculative
    assert not api.load_engine("some-model", draft="none", config=REF).speculative
    assert not api.load_engine("some-model", config=REF, adaptive=False).speculative


def test_suffix_only_blocks_need_a_match_of_the_policys_length(target, reference):
    """A match shorter than suffix_only_min_match offers no suffix-only block (the draftless
    default asks for 4 tokens: short matches were mostly rejected on the copy workload)."""
    from dataclasses import replace as with_
    from eagle3.generate import Engine
    from spec_helpers import StubTokenizer
    for shortest, some in ((2, True), (17, False)):      # 17: past SuffixIndex's longest match
        policy = lambda greedy=True: with_(draftless_policy(greedy), suffix_only_min_match=shortest)
        engine = Engine(target, StubTokenizer(), max_model_len=len(PROMPT) + MAX_NEW, policy=policy)
        result = engine.generate(prompt_ids=PROMPT, params=GREEDY)
        assert result.token_ids == reference
        assert any(s.arm == "suffix" for s in result.decode_steps) == some


def test_a_server_starts_on_a_draftless_speculative_engine():
    """`eagle3 serve --draft suffix` (and a model with no shipped draft) speculates with suffix-only
    blocks and no tree settings: the server came up with an AttributeError on the missing tree
    depth, and /health answered 500 for the same reason. Its metrics count acceptance up to a
    suffix-only block's tokens; /health names that size instead of a tree."""
    from eagle3.generate import Engine
    from eagle3.serve import create_app
    from serve_fixtures import tiny_target as served, tokenizer
    engine = Engine(served(), tokenizer(), max_model_len=256, policy=draftless_policy)
    assert engine.speculative and engine.spec is None
    for batch in (1, 4):
        server = create_app(engine, model_name="tiny", max_batch=batch).state.server
        assert server.depth == draftless_policy(True).suffix_only_tokens > 0
        health = server.health()                     # /health: no tree to name, the blocks' size
        assert health["speculative"] and "spec" not in health
        assert health["suffix_only_tokens"] == server.depth
