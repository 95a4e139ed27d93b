"""Suffix index: `propose` against a brute-force search of the same spec."""
from __future__ import annotations

import random

import pytest

from eagle3.errors import InputError
from eagle3.speculative.suffix import SuffixCandidate, SuffixIndex


# ---------------------------------------------------------------------------- brute force
def lz_copy(seq: list[int], e: int, max_tokens: int) -> list[int]:
    """Copy forward from e, appending each copied token so the copy can read its own output."""
    x = list(seq)
    for j in range(max_tokens):
        x.append(x[e + j])
    return x[len(seq):]


def grouped(seq: list[int], suffix: list[int]) -> dict[int, tuple[int, int]]:
    """next token -> (count, latest end) over every occurrence of `suffix` in `seq`."""
    length, groups = len(suffix), {}
    for e in range(length, len(seq)):
        if seq[e - length:e] == suffix:
            groups[seq[e]] = (groups.get(seq[e], (0,))[0] + 1, e)
    return groups


def brute_own(seq, max_tokens, min_match, max_match, limit):
    """The module docstring's candidates, by trying every match length and occurrence."""
    out, seen = [], set()
    for length in range(min(max_match, len(seq) - 1), min_match - 1, -1):
        groups = grouped(seq, seq[len(seq) - length:])
        for tok, (count, e) in sorted(groups.items(), key=lambda kv: (-kv[1][0], -kv[1][1])):
            if len(out) < limit and tok not in seen:
                seen.add(tok)
                out.append(SuffixCandidate(lz_copy(seq, e, max_tokens), length, count))
    return out


def random_seq(rng: random.Random, vocab: int, length: int) -> list[int]:
    """Random tokens with copied stretches and loops, so long matches happen."""
    seq: list[int] = []
    while len(seq) < length:
        kind = rng.random()
        if kind < 0.5 or len(seq) < 4:
            seq.append(rng.randrange(vocab))
        elif kind < 0.8:
            start = rng.randrange(len(seq))
            seq += seq[start:start + rng.randrange(1, 20)]
        else:
            seq += seq[-rng.randrange(1, 4):] * rng.randrange(1, 6)
    return seq[:length]


def chunks(rng: random.Random, seq: list[int]):
    i = 0
    while i < len(seq):
        step = rng.choice([1, 1, 2, 3, 7, 20])
        yield seq[i:i + step]
        i += step


# ---------------------------------------------------------------------------- own sequence
@pytest.mark.parametrize("seed", range(6))
def test_propose_equals_brute_force_on_random_sequences(seed):
    rng = random.Random(seed)
    for _ in range(5):
        vocab, length = rng.randint(4, 6), rng.randint(1, 300)
        min_match = rng.randint(1, 3)
        max_match = rng.randint(min_match, 16)
        limit = rng.randint(1, 3)
        index = SuffixIndex(min_match, max_match, limit)
        seq = random_seq(rng, vocab, length)
        for part in chunks(rng, seq):
            index.extend(part)
            max_tokens = rng.randint(1, 12)
            want = brute_own(index.tokens, max_tokens, min_match, max_match, limit)
            assert index.propose(max_tokens) == want, (index.tokens, max_tokens)


def test_edge_cases():
    index = SuffixIndex()
    assert index.propose() == []                             # empty
    index.extend([5])
    assert index.propose() == []
    index.extend([1, 2, 3, 4])
    assert index.propose() == []                             # no repeat of the last 2 tokens
    index = SuffixIndex(max_candidates=1)
    index.extend([1, 2, 3, 1, 2])
    # [1, 2] occurred ending at 2, followed by 3: the copy runs into the end and repeats "3 1 2"
    assert index.propose(7) == [SuffixCandidate([3, 1, 2, 3, 1, 2, 3], 2, 1)]
    assert index.propose(0) == []


def test_a_loop_keeps_proposing_the_loop():
    index = SuffixIndex(max_match=4)
    index.extend([9] * 12)
    assert index.propose(8) == [SuffixCandidate([9] * 8, 4, 8)]   # ends 4..11 all match 9 9 9 9
    index = SuffixIndex()
    index.extend([3, 1, 2] + [4, 5, 6] * 5)
    (cand,) = index.propose(10)
    assert cand.tokens == [4, 5, 6, 4, 5, 6, 4, 5, 6, 4] and cand.match_len == 12


def test_candidates_rank_by_count_then_recency_with_distinct_first_tokens():
    index = SuffixIndex(min_match=1, max_match=2, max_candidates=3)
    index.extend([1, 2, 7, 1, 2, 8, 1, 2, 8, 0, 1, 2, 9, 5, 2])
    # after "5 2": no earlier "5 2"; L = 1: "2" followed by 7 (once), 8 (twice), 9 (latest)
    got = index.propose(2)
    assert [c.tokens[0] for c in got] == [8, 9, 7]
    assert [(c.match_len, c.count) for c in got] == [(1, 2), (1, 1), (1, 1)]
    assert got[0].tokens == [8, 0]                           # from the latest "2 8" (position 8)


def test_longer_match_wins_over_a_more_frequent_short_one():
    index = SuffixIndex(min_match=1, max_match=3, max_candidates=2)
    index.extend([4, 1, 2, 6, 1, 2, 6, 0, 1, 2, 6, 4, 1, 2])
    got = index.propose(1)
    assert got[0] == SuffixCandidate([6], 3, 1)              # "4 1 2" -> 6 beats "1 2"
    assert len(got) == 1                                     # every "1 2" / "2" led to 6


def test_parameters_are_checked():
    for kw in (dict(min_match=0), dict(min_match=3, max_match=2), dict(max_candidates=0)):
        with pytest.raises(InputError):
            SuffixIndex(**kw)


def test_a_copied_index_is_independent():
    import copy
    index = SuffixIndex()
    index.extend([1, 2, 3, 1, 2])
    twin = copy.deepcopy(index)
    index.extend([9, 9, 9])
    twin.extend([3])
    assert twin.propose(2) == [SuffixCandidate([1, 2], 3, 1)]
    assert index.propose(1) == [SuffixCandidate([9], 2, 1)]


def test_a_dropped_index_is_freed_without_the_garbage_collector():
    """An index whose trie held a method of the index was a reference cycle: its thousands of nodes
    waited for a gen-2 collection inside a decode step, which the adaptive step then took for the
    cost of the arm it had run."""
    import gc
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        gc.collect()
        index = SuffixIndex()
        index.extend(list(range(40)) * 4)
        del index
        assert gc.collect() == 0         # freed by reference counting alone: no cycle left over
    finally:
        if was:
            gc.enable()


def test_has_match_says_whether_propose_returns_a_continuation():
    """has_match(m), the plain stretch's cheap question, agrees with propose(n, m) at every step of
    random and repetitive sequences, for every match length asked."""
    rng = random.Random(0)
    for vocab, n in ((3, 300), (20, 400), (400, 300)):
        index = SuffixIndex()
        for _ in range(n):
            index.extend([rng.randrange(vocab)])
            for m in range(0, 12):
                assert index.has_match(m) == bool(index.propose(4, m)), (vocab, len(index.tokens), m)


def test_a_stretch_asked_only_has_match_proposes_what_an_index_kept_current_does():
    """Tokens appended while only has_match is asked (a plain stretch) reach the trie at the next
    proposal: every answer and every proposal equals an index that proposed after every token,
    for match lengths past max_match too, with tokens appended one and several at a time."""
    rng = random.Random(1)
    for vocab in (3, 20, 400):
        lazy, eager = SuffixIndex(), SuffixIndex()
        seq = [rng.randrange(vocab) for _ in range(500)]
        i = 0
        while i < len(seq):
            block = seq[i:i + rng.choice((1, 1, 1, 3))]
            i += len(block)
            lazy.extend(block)
            eager.extend(block)
            want = eager.propose(6, 0)
            for m in (0, 2, 5, 8, 16, 17):
                assert lazy.has_match(m) == bool(eager.propose(6, m)), (vocab, i, m)
            if rng.random() < 0.1:
                assert lazy.propose(6, 0) == want, (vocab, i)
        assert lazy.propose(6, 0) == eager.propose(6, 0)
