"""The adaptive step in the decoder: every choice (tree shapes, suffix nodes, plain steps with the
draft catching up later) keeps greedy output identical to plain decoding, the caches equal one
pass over the sequence, and sampled output keeps the target's distribution."""
from __future__ import annotations

import time

import copy

import pytest
import torch

from eagle3.generate import Engine, SamplingParams
from eagle3.runtime.costs import CostTable
from eagle3.speculative import decoder as decoder_module
from eagle3.speculative.decoder import SUFFIX_MAX_FACTOR, SpecDecoder
from eagle3.speculative.policy import PLAIN, SUFFIX_ONLY, AdaptivePolicy, name_of
from eagle3.speculative.tree import SpecParams
from spec_helpers import (assert_caches_equal_one_pass, StubTokenizer, chi_square_p, oracle_draft, plain_greedy,
                          tiny_draft, tiny_target)
from test_spec_engine import exact_joint

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [1, 2, 3, 4, 5, 1, 2, 3]
MAX_NEW = 40
GREEDY = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
SHAPES = (SpecParams(2, 3, 6, 0.0, suffix_tokens=4), SpecParams(3, 4, 10, 0.0), SpecParams.chain(2))
CHEAP_PLAIN = CostTable((1, 2, 4, 8, 16), (1.0, 50.0, 60.0, 80.0, 100.0), (5.0,) * 5)
CHEAP_TREES = CostTable((1, 2, 4, 8, 16), (10.0, 10.1, 10.2, 10.4, 10.8), (0.01,) * 5)


class Scripted:
    """A policy that takes the arms of `script` in turn (plain steps between trees, shape changes);
    SUFFIX_ONLY at a step where the suffix index has no match is a plain step."""
    suffix_only_tokens = 6
    suffix_only_min_match = 2
    probe_due = False
    capture = (True,)            # draft_within at the i-th choice: capture the plain step's features
    probing = False
    stretch = (0,)               # plain_run after the i-th choice: plain steps run without asking

    def plain_run(self, window):
        return self.stretch[(self.i - 1) % len(self.stretch)]

    def __init__(self, script):
        self.script, self.i, self.taken = script, 0, []
        self.shapes = tuple(a for a in script if isinstance(a, SpecParams))

    def choose(self, suffix_ready=False, suffix_match=0):
        self.i += 1
        arm = self.script[(self.i - 1) % len(self.script)]
        self.taken.append(PLAIN if arm == SUFFIX_ONLY and not suffix_ready else arm)
        return self.taken[-1]

    def draft_within(self, steps):
        return self.capture[self.i % len(self.capture)]

    def observe(self, arm, step, levels, wall_ms, timed=True):
        self.observed = getattr(self, "observed", []) + [(arm, levels, wall_ms)]

    def observe_stretch(self, wall_ms, timed=True):
        self.observe(PLAIN, None, 0, wall_ms, timed)

    def observe_shadow(self, match, tokens, rows):
        self.shadows = getattr(self, "shadows", []) + [(match, tokens, rows)]

    def observe_catch_up(self, rows, ms):
        self.catch_ups = getattr(self, "catch_ups", []) + [(rows, ms)]

    def step_cost_ms(self, arm, rows, levels, caught_up_rows=0):
        return 1.0


SCRIPTS = [(PLAIN, SHAPES[0]), (SHAPES[1], PLAIN, PLAIN, SHAPES[0], SHAPES[2]),
           (PLAIN, PLAIN, PLAIN, SHAPES[2]), (SHAPES[0], SHAPES[1])]


@pytest.fixture(scope="module")
def target():
    return tiny_target(3, vocab=8, std=0.5)


@pytest.fixture(scope="module")
def reference(target):
    return plain_greedy(target, PROMPT, MAX_NEW)


def decode(dec: SpecDecoder, n: int) -> tuple[list[int], list]:
    steps = [dec.prefill(PROMPT, MAX_NEW)]
    while sum(len(s.tokens) for s in steps) < n:
        steps.append(dec.step())
    return [t for s in steps for t in s.tokens], steps


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: "-".join(map(name_of, s)))
def test_any_sequence_of_choices_keeps_greedy_identity_and_the_caches(target, reference, script):
    draft = oracle_draft(target, PROMPT + reference)
    dec = SpecDecoder(target, draft, target.new_cache(128), draft.new_cache(128), GREEDY,
                      SHAPES[0], policy=Scripted(script))
    emitted, steps = decode(dec, 30)
    assert emitted == reference[:len(emitted)]
    assert [s.arm for s in steps[1:len(script) + 1]] == [name_of(a) for a in script]
    assert sum(s.accepted for s in steps if s.arm != PLAIN) > 0
    assert all(s.accepted == 0 and len(s.tokens) == 1 for s in steps if s.arm == PLAIN)
    dec._catch_up()                                   # rows a trailing plain step left waiting
    assert_caches_equal_one_pass(dec, target, draft, PROMPT, emitted)


def test_the_catch_up_after_plain_steps_is_not_charged_to_the_shape(target, reference, monkeypatch):
    """The prompt's rows (prefill leaves them waiting) and three plain steps' rows wait for the draft;
    the next tree step runs them first. That forward (made slow here) is reported apart and left out
    of the tree step's wall time and levels."""
    draft = oracle_draft(target, PROMPT + reference)
    policy = Scripted((PLAIN, PLAIN, PLAIN, SHAPES[2]))
    dec = SpecDecoder(target, draft, target.new_cache(128), draft.new_cache(128), GREEDY,
                      SHAPES[0], policy=policy)
    real, calls = dec._extend, []

    def slow_extend(ids, feats, start):
        calls.append(ids.numel())
        if len(calls) == 1:                           # the catch-up over the prompt and three plain rows
            time.sleep(0.2)
        real(ids, feats, start)
    dec.prefill(PROMPT, MAX_NEW)
    monkeypatch.setattr(dec, "_extend", slow_extend)
    for _ in range(4):
        dec.step()
    rows = len(PROMPT) + 3
    assert calls[0] == rows and [r for r, _ in policy.catch_ups] == [rows] and policy.catch_ups[0][1] >= 200
    arm, levels, wall_ms = policy.observed[-1]
    assert arm == SHAPES[2] and wall_ms < 150
    assert levels == SHAPES[2].depth                 # depth - 1 draft levels and the extend, no catch-up


def test_a_request_decoded_plainly_runs_no_draft_forward(target, reference, monkeypatch):
    """Prefill leaves the prompt's draft rows waiting like a plain step's, so a request the policy
    decodes plainly throughout never runs the draft (on the GGUF codes ~11 ms of a 100-token
    prompt); the first drafted tree catches up over all of them."""
    draft = oracle_draft(target, PROMPT + reference)
    policy = Scripted((PLAIN,) * 4 + (SHAPES[2],))
    dec = SpecDecoder(target, draft, target.new_cache(128), draft.new_cache(128), GREEDY,
                      SHAPES[0], policy=policy)
    real, calls = dec._extend, []
    monkeypatch.setattr(dec, "_extend", lambda ids, feats, start: (calls.append(ids.numel()),
                                                                   real(ids, feats, start)))
    emitted = dec.prefill(PROMPT, MAX_NEW).tokens
    for _ in range(4):
        emitted += dec.step().tokens
    assert calls == [] and dec.draft_cache.length == 0
    emitted += dec.step().tokens
    assert calls[0] == len(PROMPT) + 4 and emitted == reference[:len(emitted)]


def test_a_long_stretch_restarts_the_draft_from_its_latest_rows(target, reference, monkeypatch):
    """More rows waiting than CATCH_UP_WINDOW (the prompt and a plain stretch): the draft restarts
    from the latest window alone, at their true positions, so the way back costs one bounded
    forward; greedy output stays plain decoding's. The draft cache then holds the window's rows as
    one pass over those tokens alone writes them."""
    monkeypatch.setattr(decoder_module, "CATCH_UP_WINDOW", 6)
    draft = oracle_draft(target, PROMPT + reference)
    policy = Scripted((PLAIN,) * 10 + (SHAPES[2],) * 3)
    dec = SpecDecoder(target, draft, target.new_cache(128), draft.new_cache(128), GREEDY,
                      SHAPES[0], policy=policy)
    steps = [dec.prefill(PROMPT, MAX_NEW)]
    for _ in range(11):
        steps.append(dec.step())
        waiting = sum(ids.numel() for ids, _ in dec.pending)
        assert dec.draft_offset + dec.draft_cache.length + waiting == dec.cache.length
    emitted = [t for s in steps for t in s.tokens]
    assert emitted == reference[:len(emitted)]
    assert policy.catch_ups[0][0] == 6 and dec.draft_offset == len(PROMPT) + 10 - 6
    # the window's rows as one pass over its tokens alone at their positions writes them
    off, seq = dec.draft_offset, PROMPT + emitted
    full_cache = target.new_cache(128)
    out = target(torch.tensor([seq[:off + 6]]), torch.arange(off + 6), full_cache,
                 capture_ids=draft.config.aux_layer_ids)
    alone = draft.new_cache(128)
    with torch.inference_mode():
        draft(torch.tensor([seq[off + 1:off + 7]]), torch.arange(off, off + 6), alone,
              features=out.aux[:, off:off + 6])
    assert torch.allclose(dec.draft_cache.k[..., :6, :], alone.k[..., :6, :], atol=1e-4)
    while sum(len(s.tokens) for s in steps) < 30:
        steps.append(dec.step())
    emitted = [t for s in steps for t in s.tokens]
    assert emitted == reference[:len(emitted)]


SUFFIX_SCRIPTS = [(SUFFIX_ONLY,), (SUFFIX_ONLY, SHAPES[1]), (PLAIN, SUFFIX_ONLY, SUFFIX_ONLY, SHAPES[2])]


@pytest.mark.parametrize("script", SUFFIX_SCRIPTS, ids=lambda s: "-".join(map(name_of, s)))
def test_suffix_only_steps_run_no_draft_and_keep_greedy_identity_and_the_caches(target, reference, script):
    draft = tiny_draft(target)                        # a random draft: the suffix index does the work
    dec = SpecDecoder(target, draft, target.new_cache(128), draft.new_cache(128), GREEDY,
                      SHAPES[0], policy=Scripted(script))
    forwards: list[int] = []
    draft.register_forward_pre_hook(lambda *_: forwards.append(1))
    steps, draft_forwards = [dec.prefill(PROMPT, MAX_NEW)], []
    while sum(len(s.tokens) for s in steps) < 30:
        forwards.clear()
        steps.append(dec.step())
        draft_forwards.append(len(forwards))
    emitted = [t for s in steps for t in s.tokens]
    assert emitted == reference[:len(emitted)]
    only = [i for i, s in enumerate(steps[1:]) if s.arm == name_of(SUFFIX_ONLY)]
    assert only and sum(steps[i + 1].accepted for i in only) > 0
    assert all(draft_forwards[i] == 0 for i in only)
    assert all(0 < steps[i + 1].proposed <= SUFFIX_MAX_FACTOR * Scripted.suffix_only_tokens for i in only)
    assert all(steps[i + 1].accepted_suffix == steps[i + 1].accepted for i in only)
    dec._catch_up()                                   # rows the suffix-only and plain steps left
    assert_caches_equal_one_pass(dec, target, draft, PROMPT, emitted)


DEAR_DRAFT = CostTable((1, 2, 4, 8, 16), (10.0, 10.1, 10.2, 10.4, 10.8), (40.0,) * 5)


def test_the_engine_takes_suffix_only_steps_when_they_pay(target, reference):
    engine = Engine(target, StubTokenizer(), draft=tiny_draft(target), max_model_len=len(PROMPT) + MAX_NEW,
                    policy=lambda greedy: AdaptivePolicy(SHAPES, DEAR_DRAFT, correct_costs=False))
    result = engine.generate(prompt_ids=PROMPT, params=GREEDY)
    assert result.token_ids == reference
    arms = result.arms                                # plain where the index has no match
    assert max(arms, key=arms.get) == name_of(SUFFIX_ONLY), arms
    assert sum(s.accepted_suffix for s in result.decode_steps if s.arm == name_of(SUFFIX_ONLY)) > 0
    assert engine.policies[True].summary()["chosen"] == arms
    assert set(engine.policies) == {True, False}       # both made at once: their shapes size the caches


@pytest.mark.parametrize("oracle,costs,plain_share", [(False, CHEAP_PLAIN, (0.8, 1.0)),
                                                       (True, CHEAP_TREES, (0.0, 0.2))],
                         ids=["random-draft-plain-pays", "oracle-draft-trees-pay"])
def test_the_engine_follows_its_policy_and_stays_lossless(target, reference, oracle, costs, plain_share):
    # the fake tables stand as they are: the wall-clock correction would replace them with this
    # machine's timings of the tiny model
    draft = oracle_draft(target, PROMPT + reference) if oracle else tiny_draft(target)
    engine = Engine(target, StubTokenizer(), draft=draft, max_model_len=len(PROMPT) + MAX_NEW,
                    policy=lambda greedy: AdaptivePolicy(SHAPES, costs, probe_every=8, correct_costs=False))
    result = engine.generate(prompt_ids=PROMPT, params=GREEDY)
    assert result.token_ids == reference
    arms = [s.arm for s in result.decode_steps]
    share = arms.count(PLAIN) / len(arms)
    assert plain_share[0] <= share <= plain_share[1], arms
    assert engine.policies[True].summary()["chosen"].get(PLAIN, 0) == arms.count(PLAIN)


def sample_two_after_first(dec: SpecDecoder, prompt: list[int], num: int):
    t1 = dec.prefill(prompt, 8).tokens[0]
    dec._catch_up()          # the draft over the prompt now: prefill leaves its rows pending
    saved = (dec.cache.length, dec.root, dec.head, copy.deepcopy(dec.suffix))
    vocab = dec.target.config.vocab_size
    counts = torch.zeros(vocab, vocab)
    for _ in range(num):
        dec.cache.truncate(saved[0])
        dec.draft_cache.truncate(saved[0])
        dec.root, dec.head, dec.suffix, dec.pending = saved[1], saved[2], copy.deepcopy(saved[3]), []
        tokens = []
        while len(tokens) < 2:
            tokens += dec.step().tokens
        counts[tokens[0], tokens[1]] += 1
    return t1, counts


@pytest.mark.parametrize("script", [(PLAIN, SHAPES[0]), (SHAPES[2], PLAIN), (PLAIN, PLAIN),
                                    (SUFFIX_ONLY, SHAPES[0])],
                         ids=["plain-then-tree", "chain-then-plain", "plain", "suffix-then-tree"])
def test_sampling_across_choices_is_lossless(target, reference, script):
    params = SamplingParams(temperature=1.0, seed=3)
    prompt = PROMPT + reference[:7]
    draft = tiny_draft(target, 6)
    policy = Scripted(script)
    dec = SpecDecoder(target, draft, target.new_cache(64), draft.new_cache(64), params, SHAPES[0],
                      policy=policy)
    t1, counts = sample_two_after_first(dec, prompt, 600)
    assert all(arm in policy.taken for arm in script)    # a suffix-only arm found its matches
    assert chi_square_p(counts, exact_joint(target, prompt + [t1], params, 2)) > 0.01


class OracleIndex:
    """A suffix index that proposes the given text's continuation, as a copy under way would."""

    def __init__(self, text: list[int], n: int):
        self.text, self.n = text, n

    def extend(self, tokens) -> None:
        self.n += len(tokens)

    def propose(self, max_tokens: int, min_match: int = 0) -> list:
        from eagle3.speculative.suffix import SuffixCandidate
        rest = self.text[self.n:self.n + max_tokens]
        return [SuffixCandidate(rest, 16, 1)] if rest else []

    def has_match(self, min_match: int = 0) -> bool:
        return self.n < len(self.text)


def _suffix_only_run(target, reference, text: list[int], cache_len: int = 128, base: int = 6):
    """Suffix-only steps (base budget `base`) proposing `text`'s continuation; greedy identity checked."""
    draft = tiny_draft(target)
    policy = Scripted((SUFFIX_ONLY,))
    policy.suffix_only_tokens = base
    dec = SpecDecoder(target, draft, target.new_cache(cache_len), draft.new_cache(cache_len), GREEDY,
                      SHAPES[0], policy=policy)
    steps, budgets = [dec.prefill(PROMPT, MAX_NEW)], []
    dec.suffix = OracleIndex(text, len(PROMPT) + 1)
    while sum(len(s.tokens) for s in steps) < MAX_NEW:
        budgets.append(dec.suffix_only_budget(16))      # the oracle's match: a copy under way
        steps.append(dec.step())
    emitted = [t for s in steps for t in s.tokens]
    assert emitted[:MAX_NEW] == reference
    return dec, steps, budgets, emitted


def _follows_the_rule(steps, budgets, base):
    """The first budget is half the base; each next one twice the last block's accepted nodes + 1,
    within [base // 2, 4 x base] (the room is ample here)."""
    assert budgets[0] == base // 2
    for i in range(1, len(budgets)):
        want = min(max(2 * (steps[i].accepted + 1), base // 2), 4 * base)
        assert budgets[i] == want, (i, budgets, steps[i])


def test_a_suffix_only_block_grows_with_the_last_ones_acceptance(target, reference):
    """The proposed text is the real continuation: each block is accepted whole and the next is
    twice as long, up to SUFFIX_MAX_FACTOR x the base; the output and the caches are as always."""
    from eagle3.speculative.decoder import SUFFIX_GROWTH, SUFFIX_MAX_FACTOR
    base = Scripted.suffix_only_tokens
    dec, steps, budgets, emitted = _suffix_only_run(target, reference, PROMPT + reference)
    _follows_the_rule(steps, budgets, base)
    assert (SUFFIX_GROWTH, SUFFIX_MAX_FACTOR) == (2, 4) and budgets[:3] == [3, 8, 18]
    assert max(s.accepted for s in steps[1:]) > base
    dec._catch_up()
    assert_caches_equal_one_pass(dec, target, dec.draft, PROMPT, emitted)


def test_a_suffix_only_block_cut_short_shrinks_the_next_one(target, reference):
    wrong = reference[:]
    wrong[20] = (wrong[20] + 1) % 8                    # the proposed text parts from the real one
    _, steps, budgets, _ = _suffix_only_run(target, reference, PROMPT + wrong)
    _follows_the_rule(steps, budgets, Scripted.suffix_only_tokens)
    assert any(budgets[i] > budgets[i + 1] for i in range(len(budgets) - 1))


def test_a_grown_suffix_only_budget_stays_within_the_caches_room(target, reference):
    """Caches sized as tight as prefill allows (the context plus the slack): past the base, a block
    only takes the room left beyond the slack, so no verify block overflows (the third here would
    be 30 nodes at 30 cached tokens; it gets 29)."""
    base = 12
    slack = max(SHAPES[0].cache_slack, base + 2)
    cache_len = len(PROMPT) + MAX_NEW + slack - 1
    dec, steps, budgets, _ = _suffix_only_run(target, reference, PROMPT + reference, cache_len, base)
    lengths = [len(PROMPT) + sum(len(s.tokens) for s in steps[:i + 1]) - 1 for i in range(len(budgets))]
    wants = [base // 2] + [min(2 * (s.accepted + 1), 4 * base) for s in steps[1:len(budgets)]]
    assert all(b <= max(base, base + cache_len - n - slack) for b, n in zip(budgets, lengths)), (budgets, lengths)
    assert all(n + b + 1 <= cache_len for b, n in zip(budgets, lengths))
    assert max(budgets) > base and any(b < w for b, w in zip(budgets, wants)), (budgets, wants)   # held by the room


def test_a_block_not_taken_is_judged_by_the_greedy_tokens(target, reference):
    """Plain steps throughout, with the index proposing the real continuation: each untaken block
    is reported once its tokens are emitted, as accepted whole (tokens = its nodes + 1); a block
    after a match shorter than 8 tokens has its class's fixed size."""
    from eagle3.speculative.policy import SHORT_MATCH_NODES
    draft = tiny_draft(target)
    policy = Scripted((PLAIN,))
    dec = SpecDecoder(target, draft, target.new_cache(128), draft.new_cache(128), GREEDY,
                      SHAPES[0], policy=policy)
    steps = [dec.prefill(PROMPT, MAX_NEW)]
    dec.suffix = OracleIndex(PROMPT + reference, len(PROMPT) + 1)
    while sum(len(s.tokens) for s in steps) < 20:
        steps.append(dec.step())
    assert [t for s in steps for t in s.tokens][:20] == reference[:20]
    grown = dec.suffix_only_budget(16)
    assert policy.shadows and all(s == (16, grown + 1, grown + 1) for s in policy.shadows)
    assert [dec.suffix_only_budget(m) for m in (2, 5)] == list(SHORT_MATCH_NODES)


def test_plain_steps_far_from_a_drafted_step_capture_nothing(target, reference, monkeypatch):
    """A plain step where the policy drafts in none of the next CATCH_UP_WINDOW steps runs the
    target without capture and drops the draft's waiting rows; the draft restarts from the rows
    captured after it, at their true positions. Greedy output stays plain decoding's."""
    draft = oracle_draft(target, PROMPT + reference)
    policy = Scripted((PLAIN,) * 4 + (SHAPES[2],) * 2)
    policy.capture = (True, False, False, True, True, True)        # by choice: 1 and 2 far, 3 and 4 near
    dec = SpecDecoder(target, draft, target.new_cache(128), draft.new_cache(128), GREEDY,
                      SHAPES[0], policy=policy)
    real, captured = dec.target, []
    monkeypatch.setattr(dec, "target", lambda *a, **k: (captured.append(tuple(k.get("capture_ids", ()))),
                                                        real(*a, **k))[1])
    steps = [dec.prefill(PROMPT, MAX_NEW)]
    while sum(len(s.tokens) for s in steps) < 30:
        steps.append(dec.step())
        waiting = sum(ids.numel() for ids, _ in dec.pending)
        assert dec.draft_offset + dec.draft_cache.length + waiting == dec.cache.length
    emitted = [t for s in steps for t in s.tokens]
    assert emitted == reference[:len(emitted)]
    aux = tuple(draft.config.aux_layer_ids)
    assert captured[1:5] == [(), (), aux, aux]                     # the four plain steps
    assert policy.catch_ups[0][0] == 2                             # the rows of steps 3 and 4 alone
    assert sum(s.accepted for s in steps if s.arm != PLAIN) > 0


def test_a_shape_chosen_with_nothing_captured_runs_a_capturing_plain_step(target, reference):
    """Nothing captured since the last restart (a leader changed where none was foreseen): the
    step is a plain step that captures, and the next drafts from its row."""
    draft = oracle_draft(target, PROMPT + reference)
    policy = Scripted((PLAIN, SHAPES[2], SHAPES[2]))
    policy.capture = (False,)
    dec = SpecDecoder(target, draft, target.new_cache(128), draft.new_cache(128), GREEDY,
                      SHAPES[0], policy=policy)
    steps = [dec.prefill(PROMPT, MAX_NEW)] + [dec.step() for _ in range(3)]
    assert [s.arm for s in steps[1:]] == [PLAIN, PLAIN, name_of(SHAPES[2])]
    assert policy.catch_ups == [(1, policy.catch_ups[0][1])]
    emitted = [t for s in steps for t in s.tokens]
    assert emitted == reference[:len(emitted)]


def test_a_plain_stretch_runs_without_asking_until_the_suffix_index_offers(target, reference, monkeypatch):
    """After a plain step the policy may promise a stretch of plain steps (plain_run): the decoder
    runs them without asking it and without capturing, reports each, and leaves the stretch at the
    first step where the suffix index offers a block. Greedy output stays plain decoding's."""
    draft = oracle_draft(target, PROMPT + reference)
    policy = Scripted((PLAIN, PLAIN, SHAPES[2]))
    policy.stretch = (3, 0, 0)
    dec = SpecDecoder(target, draft, target.new_cache(128), draft.new_cache(128), GREEDY,
                      SHAPES[0], policy=policy)
    real, captured = dec.target, []
    monkeypatch.setattr(dec, "target", lambda *a, **k: (captured.append(bool(k.get("capture_ids"))),
                                                        real(*a, **k))[1])
    steps = [dec.prefill(PROMPT, MAX_NEW)]
    monkeypatch.setattr(dec, "_suffix_offers", lambda: False)
    steps += [dec.step() for _ in range(7)]
    assert policy.i == 4 and [s.arm for s in steps[1:]] == [PLAIN] * 5 + [name_of(SHAPES[2]), PLAIN]
    assert [a for a, _, _ in policy.observed] == [PLAIN] * 5 + [SHAPES[2], PLAIN]
    assert captured[2:5] == [False] * 3                 # the stretch captures nothing
    assert dec.plain_left == 3                          # the last plain step promised a new stretch
    monkeypatch.setattr(dec, "_suffix_offers", lambda: True)
    steps.append(dec.step())                            # an offer ends it: the policy is asked
    assert policy.i == 5 and dec.plain_left == 0
    while sum(len(s.tokens) for s in steps) < 30:
        steps.append(dec.step())
    emitted = [t for s in steps for t in s.tokens]
    assert emitted == reference[:len(emitted)]
