"""Speculation inside the batch: suffix chains planned from the cost of rows, checked row by row as
plain decoding samples (eagle3/generate/chains.py, BatchScheduler with chain_costs)."""
from __future__ import annotations

import pytest
import torch

from eagle3.generate import Engine, SamplingParams
from eagle3.generate.batch import BatchScheduler
from eagle3.generate.chains import ChainPlanner, ChainState, check_chain, expected_tokens
from eagle3.runtime.target import build_target

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


@pytest.mark.parametrize("max_batch", [1, 4])
def test_accepted_and_rejected_chains_leave_sampled_outputs_as_plain(target, alone, one_thread, max_batch):
    """Chains that are mostly right, wrong at known places, for seeded sampling and greedy
    requests: the rows past a rejected guess are dropped from the slot and every output is plain
    decoding's alone."""
    sched = BatchScheduler(target, StubTokenizer(), set(), max_batch=max_batch, max_model_len=CTX,
                           prefill_chunk=8, chain_costs=CHEAP_ROWS)
    reqs = []
    for p, params in zip(PROMPTS, PARAMS):
        req = sched.add(p, params)
        req.chain = OracleChain(req, alone.generate(prompt_ids=p, params=params, speculative=False).token_ids)
        reqs.append(req)
    chunks = drain(sched)
    for req in reqs:
        assert [t for c in chunks[req.id] for t in c.token_ids] == req.chain.truth
        steps = req.output.steps
        assert sum(s.accepted for s in steps) >= len(req.chain.truth) // 3
        assert any(s.accepted < s.proposed for s in steps)      # some chains were cut
        assert req.chain.chains == sum(1 for s in steps if s.proposed)


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
    planner = ChainPlanner(CHEAP_ROWS)
    chosen = planner.plan([("a", list(range(8)), 0.9), ("b", [1, 2, 3], 0.05)], rows=4, tokens=4.0)
    assert list(chosen) == ["a"] and len(chosen["a"]) == 8            # b's guesses do not pay
    # one token per row costs 10 ms a row: a guess right 95% of the time still loses
    assert ChainPlanner(DEAR_ROWS).plan([("a", [1, 2, 3], 0.95)], rows=1, tokens=1.0) == {}
    # the forward's row limit caps the chain
    assert len(ChainPlanner(CHEAP_ROWS, max_rows=6).plan([("a", list(range(8)), 0.9)], 4, 4.0)["a"]) == 2
    assert expected_tokens(0.5, 3) == pytest.approx(0.875)
    with pytest.raises(Exception, match="positive"):
        ChainPlanner(lambda rows: 0.0)


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
    greedy, one seeded sampling) decoded together with the machine's cost table: outputs equal
    plain decoding alone, and guessed tokens were accepted."""
    from eagle3.api import load_engine
    engine = load_engine(max_model_len=512)
    sched = BatchScheduler.from_engine(engine, max_batch=4)
    assert sched.chains is not None
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
