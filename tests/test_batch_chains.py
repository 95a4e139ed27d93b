"""Speculation inside the batch: suffix chains planned from the cost of rows, checked row by row as
plain decoding samples (eagle3/generate/chains.py, BatchScheduler with chain_costs)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from eagle3.generate import Engine, SamplingParams
from eagle3.generate.batch import BatchScheduler
from eagle3.generate.chains import ChainPlanner, ChainState, Option, check_chain, expected_tokens
from eagle3.runtime.target import build_target
from eagle3.runtime.costs import CostTable
from eagle3.speculative.gate import BatchGate
from eagle3.speculative.policy import AdaptivePolicy
from eagle3.speculative.monitor import AcceptanceMonitor

from spec_helpers import StubTokenizer, chi_square_p, tiny_target

CTX = 200
CHEAP_ROWS = lambda rows: 10.0 + 0.2 * rows        # noqa: E731  an extra row costs 2% of a forward
DEAR_ROWS = lambda rows: 10.0 * rows                # noqa: E731  every row costs a whole forward


@pytest.fixture(scope="module")
def target():
    """A tiny random target (32 tokens: its greedy output loops soon) in the row-stable layout."""
    return build_target(tiny_target(seed=3), torch.bfloat16, row_stable=True)


@pytest.fixture(scope="module")
def alone(target):
    return Engine(target, StubTokenizer(), max_model_len=CTX)


def drain(sched) -> dict:
    chunks: dict = {}
    while sched.has_work:
        for e in sched.step():
            chunks.setdefault(e.request.id, []).append(e.chunk)
    return chunks


PROMPTS = ([5, 9, 13, 17, 5, 9, 13, 17, 5, 9], [30, 31, 3, 4, 6, 8, 10, 12], [7, 7, 8, 7, 7, 8, 7],
           [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [20, 21, 22, 20, 21, 22, 20, 21])
PARAMS = (SamplingParams(max_new_tokens=40, ignore_eos=True),
          SamplingParams(temperature=1.0, seed=7, max_new_tokens=36, ignore_eos=True),
          SamplingParams(max_new_tokens=30, ignore_eos=True),
          SamplingParams(temperature=0.7, top_k=8, top_p=0.9, seed=3, max_new_tokens=33, ignore_eos=True),
          SamplingParams(temperature=0.5, seed=11, max_new_tokens=28, ignore_eos=True))


@pytest.mark.lossless
@pytest.mark.parametrize("max_batch", [1, 3, 5])
def test_each_request_speculating_in_a_batch_equals_its_plain_output_alone(target, alone, one_thread,
                                                                           max_batch):
    """Greedy and seeded sampling, joining as slots free up: every output is plain decoding's
    alone, token for token, while chains were checked and some of their tokens accepted."""
    sched = BatchScheduler(target, StubTokenizer(), set(), max_batch=max_batch, max_model_len=CTX,
                           prefill_chunk=8, chain_costs=CHEAP_ROWS)
    reqs = [sched.add(p, params) for p, params in zip(PROMPTS, PARAMS)]
    chunks = drain(sched)
    for req in reqs:
        want = alone.generate(prompt_ids=req.prompt_ids, params=req.params, speculative=False)
        assert [t for c in chunks[req.id] for t in c.token_ids] == want.token_ids, req.params
        assert chunks[req.id][-1].result.token_ids == want.token_ids
    steps = [s for r in reqs for s in r.output.steps]
    assert sum(s.proposed for s in steps) >= 10          # the greedy loop of PROMPTS[2]
    assert sum(s.accepted for s in steps) >= 5
    assert all(s.accepted_suffix == s.accepted and s.accepted <= s.proposed for s in steps)
    assert sched.cache.num_free == max_batch


def test_a_request_that_asks_for_no_speculation_gets_no_guesses(target, alone, one_thread):
    """"speculation": false (SamplingParams.speculative) in a batch that speculates: that request
    proposes nothing, the same prompt beside it still does, and both outputs are plain decoding's."""
    sched = BatchScheduler(target, StubTokenizer(), set(), max_batch=2, max_model_len=CTX,
                           prefill_chunk=8, chain_costs=CHEAP_ROWS)
    params = PARAMS[2]
    reqs = [sched.add(PROMPTS[2], params), sched.add(PROMPTS[2], replace(params, speculative=False))]
    chunks = drain(sched)
    want = alone.generate(prompt_ids=PROMPTS[2], params=params, speculative=False).token_ids
    assert all([t for c in chunks[r.id] for t in c.token_ids] == want for r in reqs)
    assert sum(s.proposed for s in reqs[0].output.steps) >= 5
    assert sum(s.proposed for s in reqs[1].output.steps) == 0
    engine = Engine(target, StubTokenizer(), max_model_len=CTX, policy=lambda greedy: AdaptivePolicy(
        (), CostTable((1, 2), (1.0, 1.1), ()), suffix_only_tokens=4))
    assert type(engine.make_decoder(replace(params, speculative=False))).__name__ == "PlainDecoder"
    assert type(engine.make_decoder(params)).__name__ == "SpecDecoder"


class OracleChain(ChainState):
    """Guesses the request's known plain output, one token in three of them wrong."""

    def __init__(self, req, truth: list[int]):
        super().__init__()
        self.req, self.truth = req, truth

    def guess(self, most: int) -> list[int]:
        n = len(self.req.out_ids)
        out = self.truth[n:n + min(most, 6)]
        if n % 3 == 0 and len(out) > 2:
            out[2] = (out[2] + 1) % 32
        return out


@pytest.mark.lossless
@pytest.mark.parametrize("max_batch", [1, 4])
def test_accepted_and_rejected_chains_leave_sampled_outputs_as_plain(target, alone, one_thread, max_batch):
    """Chains that are mostly right, wrong at known places, for seeded sampling and greedy
    requests: the rows past a rejected guess are dropped from the slot and every output is plain
    decoding's alone."""
    _, reqs = run_oracles(target, alone, OracleChain, max_batch, CHEAP_ROWS)
    for req in reqs:
        steps = req.output.steps
        assert sum(s.accepted for s in steps) >= len(req.chain.truth) // 4
        assert any(s.accepted < s.proposed for s in steps)      # some chains were cut
        assert req.chain.chains == sum(1 for s in steps if s.proposed)


def run_oracles(target, alone, oracle, max_batch: int, costs):
    """PROMPTS decoded in a batch, each request's guesses from `oracle` (a ChainState that knows
    its plain output alone): every output must be that output. -> (scheduler, requests)"""
    sched = BatchScheduler(target, StubTokenizer(), set(), max_batch=max_batch, max_model_len=CTX,
                           prefill_chunk=8, chain_costs=costs)
    reqs = []
    for p, params in zip(PROMPTS, PARAMS):
        req = sched.add(p, params)
        req.chain = oracle(req, alone.generate(prompt_ids=p, params=params, speculative=False).token_ids)
        reqs.append(req)
    chunks = drain(sched)
    for req in reqs:
        assert [t for c in chunks[req.id] for t in c.token_ids] == req.chain.truth
    return sched, reqs


def test_no_chain_runs_where_rows_cost_a_forward_each(target, alone, one_thread):
    sched = BatchScheduler(target, StubTokenizer(), set(), max_batch=3, max_model_len=CTX,
                           chain_costs=DEAR_ROWS)
    reqs = [sched.add(p, params) for p, params in zip(PROMPTS[:3], PARAMS[:3])]
    drain(sched)
    assert all(s.proposed == 0 for r in reqs for s in r.output.steps)
    assert all(r.chain is not None and r.chain.chains == 0 for r in reqs)


def test_chains_need_a_row_stable_layout(one_thread):
    """Where a row's bits depend on its block, a checked row would not be the row decoded alone."""
    loose = build_target(tiny_target(seed=3), torch.float32)
    sched = BatchScheduler(loose, StubTokenizer(), set(), max_batch=2, max_model_len=CTX,
                           chain_costs=CHEAP_ROWS)
    assert sched.chains is None


def test_the_planner_takes_the_chain_length_that_pays_most():
    free = lambda k: 0.0                            # noqa: E731
    planner = ChainPlanner(CHEAP_ROWS)
    chosen = planner.plan([Option("a", "suffix", 8, 0.9, free), Option("b", "suffix", 3, 0.05, free)],
                          rows=4, decoders=4)
    assert list(chosen) == ["a"] and chosen["a"][1] == 8                # b's guesses do not pay
    # one token per row costs 10 ms a row: a guess right 95% of the time still loses
    assert ChainPlanner(DEAR_ROWS).plan([Option("a", "suffix", 3, 0.95, free)], rows=1, decoders=1) == {}
    # every request's chain may fit in the step, not only the longest one's rows
    both = planner.plan([Option("a", "suffix", 4, 0.9, free), Option("b", "suffix", 4, 0.8, free)], 2, 2)
    assert sorted(both) == ["a", "b"] and both["a"][1] + both["b"][1] > 4
    # the forward's row limit caps the chain
    assert ChainPlanner(CHEAP_ROWS, max_rows=6).plan([Option("a", "suffix", 8, 0.9, free)], 4, 4)["a"][1] == 2
    # one option per request, the better acceptance first; a draft's own ms count against it
    two = planner.plan([Option("a", "suffix", 8, 0.3, free), Option("a", "draft", 6, 0.8, free)], 2, 2)
    assert two["a"][0].source == "draft"
    dear = planner.plan([Option("a", "draft", 6, 0.8, lambda k: 5.0 * k)], 2, 2)
    assert dear == {}                                # its forwards cost more than its tokens bring
    # a prompt chunk's rows in the same forward do not make a chain look cheaper
    assert ChainPlanner(DEAR_ROWS).plan([Option("a", "suffix", 3, 0.6, free)], rows=9, decoders=1) == {}
    assert expected_tokens(0.5, 3) == pytest.approx(0.875)
    with pytest.raises(Exception, match="positive"):
        ChainPlanner(lambda rows: 0.0)


def test_a_sources_first_chain_is_taken_where_it_pays_at_all():
    """Within PAY_MARGIN of break-even a chain is not taken, unless its source has had none
    checked: its prior alone then decides once (at a margin, a prior just short of it kept a
    copy's suffix guesses from ever being tried, so never found right)."""
    free = lambda k: 0.0                            # noqa: E731
    step = lambda rows: 10.0 + rows                 # noqa: E731  1 ms a row on a 10 ms forward
    # 3 decoders, one more row: 3 / 13 tokens a ms before, (3 + 0.25) / 14 after: +0.6%
    opt = Option("a", "suffix", 1, 0.25, free)
    assert ChainPlanner(step).plan([opt], rows=3, decoders=3) == {}
    assert ChainPlanner(step).plan([opt._replace(first=True)], rows=3, decoders=3)["a"][1] == 1
    # ... but not where it loses
    assert ChainPlanner(step).plan([opt._replace(rate=0.2, first=True)], rows=3, decoders=3) == {}


def test_a_chains_acceptance_and_length_follow_what_was_accepted():
    state = ChainState()
    state.index.extend([1, 2, 3, 4, 5, 1, 2, 3, 4])
    assert state.guess(32) == [5, 1, 2, 3]           # a first chain: at most 4 tokens
    state.observe(4, 4)
    assert state.last == 4 and state.rate > 0.5
    assert len(state.guess(32)) == 10                # 2 x (4 + 1)
    before = state.rate
    state.observe(10, 0)
    assert state.rate < before and state.guess(32) == [5, 1]
    assert state.guess(1) == [5] and state.guess(0) == []


def test_check_chain_stops_at_the_first_token_that_differs():
    logits = torch.full((4, 6), -5.0)
    for row, best in enumerate([3, 1, 4, 2]):
        logits[row, best] = 5.0
    greedy, gen = SamplingParams(), torch.Generator()
    assert check_chain(logits, [3, 1, 4], greedy, gen) == [3, 1, 4, 2]        # all right, and the next
    assert check_chain(logits, [3, 0, 4], greedy, gen) == [3, 1]              # wrong at the second
    assert check_chain(logits, [0, 1, 4], greedy, gen) == [3]
    with pytest.raises(ValueError, match="logit rows"):
        check_chain(logits, [3], greedy, gen)


def test_sampled_chains_draw_what_plain_sampling_draws():
    """A seeded chain check emits the tokens plain sampling draws row by row with the same seed,
    and the token after an accepted guess is distributed as the target says (chi-square)."""
    torch.manual_seed(0)
    logits = torch.randn(3, 12) * 2
    params = SamplingParams(temperature=0.9, top_k=10)
    from eagle3.sampling import sample_next, target_probs
    guess = int(logits[0].argmax())
    counts = torch.zeros(12)
    for seed in range(3000):
        got = check_chain(logits, [guess, 5], params, torch.Generator().manual_seed(seed))
        plain_gen = torch.Generator().manual_seed(seed)
        plain = [int(sample_next(logits[i], params, plain_gen)) for i in range(len(got))]
        assert got == plain
        if len(got) > 1:                      # the guess was accepted: the second token's draw
            counts[got[1]] += 1
    probs = target_probs(logits[1], params)
    assert counts.sum() > 500
    assert chi_square_p(counts, probs) > 1e-3


def test_the_packaged_model_speculates_inside_the_batch():
    """SmolLM2 as load_engine builds it by default, three requests that quote their prompt (two
    greedy, one seeded sampling) decoded together: outputs equal plain decoding alone, and guessed
    tokens were accepted. The planner prices rows as a quiet 2-core EPYC measured them (SmolLM2's
    codes, one parallel region: 4.1 ms a row, ~0.5 ms each more): the machine's own table is
    measured whenever the kernels change, inside the suite's run, and a table measured in a slow
    moment (5.1 ms a row, ~0.9 ms each more) left these copies' chains just short of paying."""
    from eagle3.api import load_engine
    engine = load_engine(max_model_len=512)
    sched = BatchScheduler.from_engine(engine, max_batch=4)
    assert sched.chains is not None
    sched.chains.cost_ms = lambda rows: 3.6 + 0.5 * rows          # noqa: E731
    sched.gate.margin = -1.0          # the planner's chains alone (the gate's judgement: test_gate.py)
    text = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
            "How vexingly quick daft zebras jump.")
    asks = [f"Repeat this text exactly, twice: {text}", f"Copy this sentence word for word: {text}",
            f"Say this back to me: {text}"]
    params = [SamplingParams(max_new_tokens=40), SamplingParams(max_new_tokens=40),
              SamplingParams(temperature=0.7, seed=5, max_new_tokens=40)]
    reqs = [sched.add(engine.encode(a), p) for a, p in zip(asks, params)]
    chunks = drain(sched)
    for req in reqs:
        want = engine.generate(prompt_ids=req.prompt_ids, params=req.params, speculative=False)
        assert [t for c in chunks[req.id] for t in c.token_ids] == want.token_ids
    assert sum(s.accepted for r in reqs for s in r.output.steps) >= 10


# ---------------------------------------------------------------------------- draft chains
DRAFT_PROMPTS = ([5, 9, 13, 17, 21], [30, 31, 3, 4, 6, 8, 10, 12, 14, 16, 18], [7, 7, 8])
DRAFT_PARAMS = (SamplingParams(max_new_tokens=30, ignore_eos=True),
                SamplingParams(temperature=0.8, seed=5, max_new_tokens=26, ignore_eos=True),
                SamplingParams(max_new_tokens=20, ignore_eos=True))
CHEAP_DRAFT = lambda rows: 0.1 + 0.01 * rows       # noqa: E731


def oracled_batch(oracle_for: int):
    """The tiny row-stable target, each DRAFT_PROMPTS request's plain output, and an oracle draft
    of request `oracle_for`'s: (model, target layout, outputs, draft)."""
    from spec_helpers import oracle_draft
    model = tiny_target(seed=4)
    target = build_target(model, torch.bfloat16, row_stable=True)
    plain = Engine(target, StubTokenizer(), max_model_len=CTX)
    truth = [plain.generate(prompt_ids=p, params=q, speculative=False).token_ids
             for p, q in zip(DRAFT_PROMPTS, DRAFT_PARAMS)]
    return model, target, truth, oracle_draft(model, DRAFT_PROMPTS[oracle_for] + truth[oracle_for])


@pytest.mark.lossless
@pytest.mark.parametrize("oracle_for", [0, 1])
def test_draft_chains_inside_the_batch_leave_outputs_as_plain(one_thread, oracle_for):
    """An EAGLE-3 draft (an oracle of one request's plain output, one token in three ranked wrong)
    proposes chains for every request of the batch from the target's features of the batch's
    forwards: the oracled request (greedy, or seeded sampling) accepts most of its draft tokens,
    the others few, and every output is plain decoding's alone."""
    from spec_helpers import oracle_draft
    model = tiny_target(seed=4)
    target = build_target(model, torch.bfloat16, row_stable=True)
    plain = Engine(target, StubTokenizer(), max_model_len=CTX)
    truth = [plain.generate(prompt_ids=p, params=q, speculative=False).token_ids
             for p, q in zip(DRAFT_PROMPTS, DRAFT_PARAMS)]
    draft = oracle_draft(model, DRAFT_PROMPTS[oracle_for] + truth[oracle_for])
    monitor = AcceptanceMonitor()       # the engine's acceptance watch sees the batch's draft chains
    sched = BatchScheduler(target, StubTokenizer(), set(), max_batch=3, max_model_len=CTX, prefill_chunk=8,
                           chain_costs=CHEAP_ROWS, draft=draft, draft_costs=CHEAP_DRAFT, monitor=monitor)
    assert sched.capture_ids == tuple(draft.config.aux_layer_ids)
    reqs = [sched.add(p, q) for p, q in zip(DRAFT_PROMPTS, DRAFT_PARAMS)]
    chunks = drain(sched)
    for req, want in zip(reqs, truth):
        assert [t for c in chunks[req.id] for t in c.token_ids] == want
    oracled = reqs[oracle_for].output.steps
    drafted = [s for s in oracled if s.arm == "draft"]
    every = [s for r in reqs for s in r.output.steps if s.arm == "draft"]
    assert monitor.steps == len(every) and monitor.accepted == sum(s.accepted for s in every)
    assert len(drafted) >= 3 and sum(s.accepted for s in drafted) >= len(truth[oracle_for]) // 3
    assert all(s.accepted_suffix == 0 for s in drafted)
    assert reqs[oracle_for].chain.draft.hits == sum(s.accepted for s in drafted)


def test_a_draft_chain_reads_the_features_of_every_fed_token(one_thread):
    """The draft cache after a batch run holds one row per token the request fed through the
    target (from its offset on), paired as SpecDecoder pairs them: its catch-up equals the draft
    run once over the same features and next ids."""
    from spec_helpers import tiny_draft
    model = tiny_target(seed=4)
    target = build_target(model, torch.bfloat16, row_stable=True)
    draft = tiny_draft(model)
    sched = BatchScheduler(target, StubTokenizer(), set(), max_batch=2, max_model_len=CTX, prefill_chunk=4,
                           chain_costs=DEAR_ROWS, draft=draft, draft_costs=CHEAP_DRAFT)
    req = sched.add(DRAFT_PROMPTS[1], SamplingParams(max_new_tokens=6, ignore_eos=True))
    other = sched.add(DRAFT_PROMPTS[0], SamplingParams(max_new_tokens=9, ignore_eos=True))
    drain(sched)
    d = req.chain.draft
    assert d.offset == 0 and d.slot is None and d.waiting_rows == len(req.prompt_ids) + 6 - 1
    feats = torch.cat(d.waiting)
    tokens = req.prompt_ids + req.out_ids
    d = sched.drafts.open(0)                          # its slot went with the request: a fresh one
    d.wait(feats)
    assert d.guess(1, tokens) and d.length == len(tokens) - 1
    one = draft.new_cache(CTX)
    ref = draft(torch.tensor([tokens[1:]]), torch.arange(len(tokens) - 1), one, features=feats[None],
                logits_rows=slice(-1, None))
    assert torch.equal(ref.logits[0, -1], d.head[0])
    out = target(torch.tensor([tokens[:-1]]), torch.arange(len(tokens) - 1), target.new_cache(CTX),
                 capture_ids=draft.config.aux_layer_ids)
    assert torch.equal(out.aux[0], feats)            # the batch's features are the solo forward's
    assert other.chain.draft.waiting_rows == len(other.prompt_ids) + 9 - 1


def test_a_long_catch_up_is_spread_over_the_tokens_a_request_has_left(target):
    """A draft waiting on a whole prompt would never look worth one chain; the rows past a step's
    worth are charged in proportion to the tokens the chain brings out of those left."""
    from eagle3.generate.chains import DRAFT_MAX_TOKENS, DraftSpend
    from spec_helpers import tiny_draft
    draft = tiny_draft(tiny_target(seed=3))
    costs = lambda rows: 1.0 + 0.1 * rows           # noqa: E731
    sched = BatchScheduler(target, StubTokenizer(), set(), max_batch=2, max_model_len=CTX,
                           chain_costs=CHEAP_ROWS, draft=draft, draft_costs=costs)
    d = sched.drafts.open(0)
    d.wait(torch.zeros(60, 3 * 32))
    step = DRAFT_MAX_TOKENS + 1
    share = (1 + expected_tokens(d.rate, 2)) / 100
    spend = DraftSpend(costs)
    assert sched._draft_ms(d, 100, spend)(2) == pytest.approx(costs(step) + (costs(60) - costs(step)) * share
                                                             + costs(1))
    d.waiting = [torch.zeros(3, 3 * 32)]             # a step's worth: charged in full
    assert sched._draft_ms(d, 100, spend)(1) == pytest.approx(costs(3))


def test_a_second_draft_chain_pays_only_the_rows_it_adds_to_each_level():
    """Draft chains of a step share their forwards (one a level over every chain's rows): the
    first chain pays whole forwards, the next what its rows add to them."""
    from eagle3.generate.chains import DraftSpend
    costs = lambda rows: 1.0 + 0.1 * rows           # noqa: E731
    spend = DraftSpend(costs)
    assert spend.added_ms(3, 1) == pytest.approx(costs(3))
    assert spend.added_ms(0, 3) == pytest.approx(2 * costs(1))   # its head is ready: 2 forwards
    spend.take(3, 2)
    assert spend.added_ms(2, 3) == pytest.approx(0.2 + 0.1 + costs(1))
    assert spend.added_ms(0, 1) == 0.0


def test_a_request_back_from_the_solo_engine_keeps_its_draft_context(one_thread):
    """Three speculative steps alone, then company: the request's draft chain starts from the solo
    draft's cache and waiting rows (token 0 on, not from the join), its draft chains keep being
    accepted in the batch, and every output is plain decoding's."""
    from eagle3.speculative.tree import SpecParams
    model, target, truth, draft = oracled_batch(0)
    solo = Engine(target, StubTokenizer(), draft=draft, spec=SpecParams(2, 3, 6, 0.0), max_model_len=CTX)
    sched = BatchScheduler(target, StubTokenizer(), set(), max_batch=3, max_model_len=CTX, prefill_chunk=8,
                           solo=solo, chain_costs=CHEAP_ROWS, draft=draft, draft_costs=CHEAP_DRAFT)
    first = sched.add(DRAFT_PROMPTS[0], DRAFT_PARAMS[0])
    chunks: dict = {}
    for _ in range(4):                                  # the prefill, then 3 solo steps
        for e in sched.step():
            chunks.setdefault(e.request.id, []).append(e.chunk)
    assert first.solo is not None and first.chain is None
    solo_rows = solo.draft_cache.length + sum(f.shape[0] for _, f in first.solo.decoder.pending)
    others = [sched.add(p, q) for p, q in zip(DRAFT_PROMPTS[1:], DRAFT_PARAMS[1:])]
    for rid, cs in drain(sched).items():
        chunks.setdefault(rid, []).extend(cs)
    d = first.chain.draft
    assert d.offset == 0 and solo_rows == len(first.prompt_ids) + len(chunks[first.id][0].token_ids) + \
        sum(len(c.token_ids) for c in chunks[first.id][1:4]) - 1
    for req, want in zip([first] + others, truth):
        assert [t for c in chunks[req.id] for t in c.token_ids] == want
    assert sum(s.accepted for s in first.output.steps[4:] if s.arm == "draft") >= 5


def test_a_source_below_the_floor_rate_is_not_asked():
    """The acceptance below which no chain can pay this step: higher for a larger batch (each
    row's share of the step is smaller); a chain at a rate above it can pay, at or below never."""
    free = lambda k: 0.0                            # noqa: E731
    planner = ChainPlanner(CHEAP_ROWS)
    floor1, floor16 = planner.floor_rate(1, 1), planner.floor_rate(16, 16)
    assert 0.0 < floor1 < floor16 < 1.0
    assert planner.plan([Option("a", "suffix", 32, floor16 - 0.01, free)], 16, 16) == {}
    assert planner.plan([Option("a", "suffix", 32, floor16 + 0.2, free)], 16, 16)
    assert ChainPlanner(CHEAP_ROWS, max_rows=16).floor_rate(16, 16) == 1.0


def test_no_chain_makes_a_forward_longer_than_the_cost_table_measured(target):
    sched = BatchScheduler(target, StubTokenizer(), set(), max_batch=2, max_model_len=CTX,
                           chain_costs=CHEAP_ROWS, chain_rows=32)
    assert sched.chains.max_rows == 32
    assert sched.chains.plan([Option("a", "suffix", 8, 0.99, lambda k: 0.0)], 40, 2) == {}


def test_a_draft_the_batch_cannot_use_is_refused_where_it_enters(target):
    """An EAGLE-1 draft (no aux features), a draft without its costs, or one for another
    vocabulary raise at construction instead of being dropped; chain_mode says what runs."""
    from eagle3.errors import ContractError, InputError
    from spec_helpers import tiny_draft
    model = tiny_target(seed=3)
    kw = dict(max_batch=2, max_model_len=CTX, chain_costs=CHEAP_ROWS)
    with pytest.raises(InputError, match="EAGLE-3"):
        BatchScheduler(target, StubTokenizer(), set(), draft=tiny_draft(model, algorithm="eagle"),
                       draft_costs=CHEAP_DRAFT, **kw)
    with pytest.raises(InputError, match="draft_costs"):
        BatchScheduler(target, StubTokenizer(), set(), draft=tiny_draft(model), **kw)
    with pytest.raises(ContractError, match="vocab"):
        BatchScheduler(target, StubTokenizer(), set(), draft=tiny_draft(tiny_target(seed=3, vocab=48)),
                       draft_costs=CHEAP_DRAFT, **kw)
    sched = BatchScheduler(target, StubTokenizer(), set(), draft=tiny_draft(model), draft_costs=CHEAP_DRAFT, **kw)
    assert "EAGLE-3 draft" in sched.chain_mode()
    assert "cost table" in BatchScheduler(target, StubTokenizer(), set(), max_batch=2).chain_mode()


def _layout_pool(slots: int):
    from eagle3.draft.inference import build_draft_layout
    from eagle3.generate.chains import DraftPool
    from spec_helpers import tiny_draft
    model = tiny_target(seed=4)
    layout = build_draft_layout(tiny_draft(model, seed=2))
    return model, layout, DraftPool(layout, CTX, slots)


def _draft_alone(draft, seq: list[int], offset: int, feats: torch.Tensor, k: int):
    """The solo engine's drafting of a chain: the catch-up over the features (the ids after each
    of their tokens at positions offset..), then one forward a token; (tokens, catch-up logits)."""
    cache = draft.new_cache(CTX)
    m = feats.shape[0]
    out = draft(torch.tensor([seq[offset + 1:offset + 1 + m]]), torch.arange(offset, offset + m), cache,
                features=feats[None], logits_rows=slice(-1, None))
    logits, hidden, first = out.logits[0, -1], out.hidden[0, -1], out.logits[0, -1]
    tokens = []
    for d in range(k):
        token = draft.to_target_ids(logits.argmax().view(1))
        tokens.append(int(token))
        if d + 1 < k:
            o = draft(token.view(1, 1), torch.tensor([offset + m + d]), cache, hidden=hidden.view(1, 1, -1),
                      logits_rows=slice(-1, None))
            logits, hidden = o.logits[0, -1], o.hidden[0, -1]
    return tokens, first


def test_drafting_several_chains_in_one_forward_equals_drafting_each_alone(one_thread):
    """The pool's batched draft (one forward over every chain's catch-up rows, then one a token
    over the chains still going, InferenceDraft.forward_rows) proposes each chain's tokens as the
    solo engine drafts that chain alone, with its logits within float error, and leaves each slot
    at its catch-up."""
    model, layout, pool = _layout_pool(3)
    gen = torch.Generator().manual_seed(0)
    width = layout.reference.expected_feature_width
    seqs = [torch.randint(0, 32, (n,), generator=gen).tolist() for n in (9, 5, 12)]
    offsets, ks = (0, 3, 1), (3, 1, 4)
    chains, feats = [], []
    for seq, off in zip(seqs, offsets):
        f = torch.randn(len(seq) - off - 1, width, generator=gen)
        c = pool.open(off)
        c.wait(f[:4])
        c.wait(f[4:])
        chains.append(c)
        feats.append(f)
    calls = []
    real = layout.forward_rows
    layout.forward_rows = lambda *a, **kw: calls.append(len(a[1].blocks)) or real(*a, **kw)
    together = pool.guess([(c, k, s) for c, k, s in zip(chains, ks, seqs)])
    del layout.forward_rows
    assert calls == [3, 2, 2]             # batched: the catch-ups, then chains 1 and 3 twice (3 alone)
    for c, k, s, f, got in zip(chains, ks, seqs, feats, together):
        want, logits = _draft_alone(layout, s, c.offset, f, k)
        assert got == want
        torch.testing.assert_close(c.head[0], logits, rtol=1e-4, atol=1e-4)
        assert c.length == len(s) - c.offset - 1 and not c.waiting


@pytest.mark.lossless
def test_batched_draft_chains_leave_outputs_as_plain(one_thread):
    """The packed draft layout drafting every request's chain together inside the batch: each
    output is plain decoding's alone, and some steps drafted several chains in one forward."""
    model, layout, _ = _layout_pool(1)
    target = build_target(model, torch.bfloat16, row_stable=True)
    plain = Engine(target, StubTokenizer(), max_model_len=CTX)
    truth = [plain.generate(prompt_ids=p, params=q, speculative=False).token_ids
             for p, q in zip(DRAFT_PROMPTS, DRAFT_PARAMS)]
    sched = BatchScheduler(target, StubTokenizer(), set(), max_batch=3, max_model_len=CTX, prefill_chunk=8,
                           chain_costs=CHEAP_ROWS, draft=layout, draft_costs=CHEAP_DRAFT)
    calls = []
    real = layout.forward_rows
    layout.forward_rows = lambda *a, **kw: calls.append(len(a[1].blocks)) or real(*a, **kw)
    reqs = [sched.add(p, q) for p, q in zip(DRAFT_PROMPTS, DRAFT_PARAMS)]
    chunks = drain(sched)
    for req, want in zip(reqs, truth):
        assert [t for c in chunks[req.id] for t in c.token_ids] == want
    assert calls and max(calls) >= 2
    assert sched.drafts.cache.num_free == 3                    # every request's slot came back


# ---------------------------------------------------------------------------- trees: a chain and an alternate
class OracleTree(ChainState):
    """Guesses a wrong chain every other time it is asked, with the request's known plain output
    as its alternate branch (and the right chain with a wrong alternate the other times)."""

    def __init__(self, req, truth: list[int]):
        super().__init__()
        self.req, self.truth, self.turn = req, truth, 0

    def _right(self, most: int) -> list[int]:
        n = len(self.req.out_ids)
        return self.truth[n:n + min(most, 3)]

    def _wrong(self, most: int) -> list[int]:
        right = self._right(most)
        return [(right[0] + 1) % 32] + right[1:] if right else []

    def guess(self, most: int) -> list[int]:      # asked first, then alternate
        self.turn += 1
        return self._wrong(most) if self.turn % 2 else self._right(most)

    def alternate(self, most: int) -> list[int]:
        return self._right(most) if self.turn % 2 else self._wrong(most)


@pytest.mark.lossless
@pytest.mark.parametrize("max_batch", [1, 4])
def test_trees_in_a_batch_leave_sampled_outputs_as_plain(target, alone, one_thread, max_batch):
    """Blocks of a chain and an alternate branch, right on either side by turns, for greedy and
    seeded sampling requests together: every output is plain decoding's alone, the paths through
    the alternate were taken and their rows kept, and the sources' acceptance counts each branch."""
    nearly_free = lambda rows: 10.0 + 0.01 * rows     # noqa: E731  every guessed node is taken
    sched, reqs = run_oracles(target, alone, OracleTree, max_batch, nearly_free)
    greedy = [r for r in reqs if r.params.greedy]
    assert all(r.chain.alt.hits >= 4 for r in greedy)           # paths through the alternate
    assert all(r.chain.hits >= 4 for r in greedy)               # and through the chain
    assert sum(r.chain.alt.chains for r in reqs) >= 10
    assert sched.cache.num_free == max_batch


def test_the_planner_adds_an_alternate_where_rows_are_cheap():
    from eagle3.generate.chains import ranked_nodes
    free = lambda k: 0.0                            # noqa: E731
    nodes = ranked_nodes(0.4, 4, 0.5, 2)
    assert nodes[0] == (0, 0.4) and [b for b, _ in nodes].count(1) == 2
    assert nodes[1] == (1, pytest.approx(0.3))      # (1 - 0.4) * 0.5: worth more than 0.4^2
    opt = Option("a", "suffix", len(nodes), 0.4, free, nodes=nodes)
    assert opt.expect(2) == pytest.approx(0.7) and opt.branches(3) == (2, 1)
    k = ChainPlanner(CHEAP_ROWS).plan([opt], rows=1, decoders=1)["a"][1]
    assert opt.branches(k)[1] >= 1                  # cheap rows: the alternate's first token pays
    dear = lambda rows: 10.0 + 3.0 * rows           # noqa: E731  a row costs 30% of a forward
    sure = Option("a", "suffix", 6, 0.8, free, nodes=ranked_nodes(0.8, 4, 0.1, 2))
    k = ChainPlanner(dear).plan([sure], rows=1, decoders=1)["a"][1]
    assert k >= 2 and sure.branches(k) == (k, 0)    # dear rows: the chain, not its alternate
    assert ranked_nodes(0.5, 0, 0.5, 2) == ()       # no chain, no tree


def test_check_tree_follows_the_drawn_token_into_either_branch():
    from eagle3.generate.chains import Guess, check_tree
    g = Guess("suffix", [3, 4], [5, 1])
    tokens, parents = [-1] + g.tokens, g.parents()
    assert parents == [-1, 0, 1, 0, 3]
    assert g.ancestors().tolist()[4] == [True, False, False, True, True]
    logits = torch.full((5, 6), -5.0)
    logits[0, 5] = logits[3, 1] = logits[4, 2] = 5.0    # root draws 5 (the alternate), then 1, then 2
    out, path = check_tree(logits, tokens, parents, SamplingParams(), torch.Generator())
    assert out == [5, 1, 2] and path == [0, 3, 4]
    logits[0, 3], logits[0, 5] = 6.0, 0.0                 # now the chain's first token, then a miss
    assert check_tree(logits, tokens, parents, SamplingParams(), torch.Generator()) == ([3, 0], [0, 1])
    with pytest.raises(ValueError, match="distinct tokens"):
        check_tree(logits[:4], [-1, 3, 4, 3], [-1, 0, 1, 0], SamplingParams(), torch.Generator())


def test_sampled_trees_draw_what_plain_sampling_draws():
    """A seeded tree check emits plain sampling's draws with the same seed, and the token after an
    accepted alternate is distributed as the target says there (chi-square)."""
    from eagle3.generate.chains import check_tree
    from eagle3.sampling import sample_next, target_probs
    torch.manual_seed(1)
    logits = torch.randn(4, 10) * 1.5
    params = SamplingParams(temperature=0.8)
    top2 = logits[0].topk(2).indices.tolist()
    tokens, parents = [-1, top2[0], 7, top2[1]], [-1, 0, 1, 0]     # a chain of 2, an alternate of 1
    counts = torch.zeros(10)
    for seed in range(3000):
        got, path = check_tree(logits, tokens, parents, params, torch.Generator().manual_seed(seed))
        plain_gen = torch.Generator().manual_seed(seed)
        assert got == [int(sample_next(logits[r], params, plain_gen)) for r in path]
        if path[1:2] == [3]:                    # through the alternate: the next draw is row 3's
            counts[got[1]] += 1
    assert counts.sum() > 300
    assert chi_square_p(counts, target_probs(logits[3], params)) > 1e-3


class ScriptedGate(BatchGate):
    """Speculation on and off by a script of batch steps (True: on), whatever the steps cost."""

    check_due = False             # no plain checks: the script alone says on or off

    def __init__(self, script):
        super().__init__()
        self.script, self.steps = script, 0

    def _next(self) -> None:
        self.steps += 1
        self.on = self.script[self.steps % len(self.script)]

    def observe(self, tokens, decoders, wall_ms, plain_ms) -> None:
        self._next()

    def observe_plain(self, wall_ms, forward_ms) -> None:
        self._next()


@pytest.mark.lossless
def test_speculation_switched_off_and_on_in_the_batch_stays_lossless(one_thread):
    """The gate turns speculation inside the batch off and on: off steps capture no features and
    ask for no guesses; back on, each draft chain starts over from its next token and its oracled
    request accepts draft tokens again. Every output is plain decoding's alone."""
    from eagle3.runtime.costs import CostTable, LiveCosts
    model, target, truth, draft = oracled_batch(0)
    table = CostTable((1, 2, 4, 8), tuple(CHEAP_ROWS(r) for r in (1, 2, 4, 8)), (0.1,) * 4)
    sched = BatchScheduler(target, StubTokenizer(), set(), max_batch=3, max_model_len=CTX, prefill_chunk=8,
                           chain_costs=CHEAP_ROWS, draft=draft, draft_costs=CHEAP_DRAFT,
                           live=LiveCosts(table))
    sched.gate = ScriptedGate([True] * 4 + [False] * 5)
    captured, real = [], target.forward_rows

    def forward_rows(*args, **kw):
        captured.append((sched.gate.on, "capture_ids" in kw))
        return real(*args, **kw)
    target.forward_rows = forward_rows
    reqs = [sched.add(p, q) for p, q in zip(DRAFT_PROMPTS, DRAFT_PARAMS)]
    chunks = drain(sched)
    for req, want in zip(reqs, truth):
        assert [t for c in chunks[req.id] for t in c.token_ids] == want
    assert all(on == capture for on, capture in captured) and not all(on for on, _ in captured)
    restarted = [s for s in reqs[0].output.steps[9:] if s.arm == "draft"]   # after an off stretch
    assert sum(s.accepted for s in restarted) >= 3


def test_a_draft_chain_keeps_at_most_a_window_of_rows_waiting(one_thread):
    """Past CATCH_UP_WINDOW waiting rows a draft chain starts over from the latest of them (its slot
    emptied, its offset moved to the first kept row), so its catch-up stays bounded; what it then
    drafts equals the draft run over those rows alone at their positions."""
    from eagle3.generate.chains import CATCH_UP_WINDOW
    from spec_helpers import tiny_draft
    model = tiny_target(seed=4)
    draft = tiny_draft(model)
    sched = BatchScheduler(build_target(model, torch.bfloat16, row_stable=True), StubTokenizer(), set(),
                           max_batch=1, max_model_len=CTX, chain_costs=CHEAP_ROWS, draft=draft,
                           draft_costs=CHEAP_DRAFT)
    tokens = [(7 * i) % 32 for i in range(CATCH_UP_WINDOW + 31)]
    with torch.inference_mode():
        out = model(torch.tensor([tokens[:-1]]), torch.arange(len(tokens) - 1), model.new_cache(CTX),
                    capture_ids=draft.config.aux_layer_ids)
    d = sched.drafts.open(0)
    d.wait(out.aux[0, :20])
    assert d.guess(1, tokens) and d.length == 20 and d.offset == 0
    d.wait(out.aux[0, 20:])
    n = len(tokens) - 1
    assert d.waiting_rows == CATCH_UP_WINDOW and d.offset == n - CATCH_UP_WINDOW and d.length == 0
    d.guess(1, tokens)
    off = d.offset
    with torch.inference_mode():
        alone = draft(torch.tensor([tokens[off + 1:]]), torch.arange(off, n), draft.new_cache(CTX),
                      features=out.aux[:, off:], logits_rows=slice(-1, None))
    assert torch.allclose(alone.logits[0, -1], d.head[0], atol=1e-5)


def test_a_draft_whose_chains_never_pay_is_still_checked_now_and_then(one_thread, monkeypatch):
    """Rows priced so dear that no chain pays: a one-token draft chain still runs every
    DRAFT_PROBE_EVERY batch steps, so the monitor keeps measuring the draft's own acceptance;
    outputs stay plain decoding's."""
    from eagle3.generate import batch as batch_module
    from spec_helpers import tiny_draft
    monkeypatch.setattr(batch_module, "DRAFT_PROBE_EVERY", 5)
    model = tiny_target(seed=4)
    target = build_target(model, torch.bfloat16, row_stable=True)
    monitor = AcceptanceMonitor()
    sched = BatchScheduler(target, StubTokenizer(), set(), max_batch=2, max_model_len=CTX, prefill_chunk=8,
                           chain_costs=DEAR_ROWS, draft=tiny_draft(model), draft_costs=CHEAP_DRAFT,
                           monitor=monitor)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    reqs = [sched.add(p, params) for p in DRAFT_PROMPTS[:2]]
    chunks = drain(sched)
    plain = Engine(target, StubTokenizer(), max_model_len=CTX)
    for req in reqs:
        want = plain.generate(prompt_ids=req.prompt_ids, params=params, speculative=False).token_ids
        assert [t for c in chunks[req.id] for t in c.token_ids] == want
    drafted = [s for r in reqs for s in r.output.steps if s.arm == "draft"]
    assert 3 <= len(drafted) <= 30 // 5 + 1 and all(s.proposed == 1 for s in drafted)
    assert monitor.steps == len(drafted)


def test_steps_with_prompt_rows_are_not_judged_by_the_gate(one_thread):
    """The gate and the live fit take decode steps only: a prompt piece's rows cost a fraction of
    the cost table's slope a row, and one such step read as several times dearer held speculation
    on where it lost."""
    from eagle3.runtime.costs import CostTable, LiveCosts
    model, target, truth, draft = oracled_batch(0)
    table = CostTable((1, 2, 4, 8), tuple(CHEAP_ROWS(r) for r in (1, 2, 4, 8)), (0.1,) * 4)
    live = LiveCosts(table)
    sched = BatchScheduler(target, StubTokenizer(), set(), max_batch=3, max_model_len=CTX, prefill_chunk=8,
                           chain_costs=CHEAP_ROWS, draft=draft, draft_costs=CHEAP_DRAFT, live=live)
    judged, real = [], sched._judge

    def judge(blocks, emitted, context, forward_ms, wall_ms):
        before = (dict(sched.gate.counts), sum(f[0] for f in live.fits.values()))
        real(blocks, emitted, context, forward_ms, wall_ms)
        after = (dict(sched.gate.counts), sum(f[0] for f in live.fits.values()))
        judged.append((all(d for _, _, d in blocks), before != after))
    sched._judge = judge
    reqs = [sched.add(p, q) for p, q in zip(DRAFT_PROMPTS, DRAFT_PARAMS)]
    chunks = drain(sched)
    for req, want in zip(reqs, truth):
        assert [t for c in chunks[req.id] for t in c.token_ids] == want
    assert any(not decode_only for decode_only, _ in judged)          # prompt pieces ran
    assert all(seen == decode_only for decode_only, seen in judged)
