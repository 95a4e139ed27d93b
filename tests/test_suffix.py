"""Suffix index and cross-request cache: `propose` against a brute-force search of the same spec."""
from __future__ import annotations

import random

import pytest

from eagle3.errors import InputError
from eagle3.speculative.suffix import SuffixCache, SuffixCandidate, SuffixIndex, _Tail


# ---------------------------------------------------------------------------- brute force
def lz_copy(seq: list[int], e: int, max_tokens: int) -> list[int]:
    """Copy forward from e, appending each copied token so the copy can read its own output."""
    x = list(seq)
    for j in range(max_tokens):
        x.append(x[e + j])
    return x[len(seq):]


def grouped(seqs: list[list[int]], suffix: list[int]) -> dict[int, tuple[int, int, int]]:
    """next token -> (count, latest seq index, latest end) over every occurrence of `suffix`."""
    length, groups = len(suffix), {}
    for i, seq in enumerate(seqs):
        for e in range(length, len(seq)):
            if seq[e - length:e] == suffix:
                count = groups.get(seq[e], (0,))[0]
                groups[seq[e]] = (count + 1, i, e)
    return groups


def brute_ranked(seqs, context, min_match, max_match, limit, exclude, longest):
    out, seen = [], set(exclude)
    for length in range(min(max_match, longest), min_match - 1, -1):
        groups = grouped(seqs, context[len(context) - length:])
        for tok, (count, i, e) in sorted(groups.items(), key=lambda kv: (-kv[1][0], -kv[1][1], -kv[1][2])):
            if len(out) < limit and tok not in seen:
                seen.add(tok)
                out.append((length, count, i, e))
    return out


def brute_own(seq, max_tokens, min_match, max_match, limit):
    ranked = brute_ranked([seq], seq, min_match, max_match, limit, (), len(seq) - 1)
    return [SuffixCandidate(lz_copy(seq, e, max_tokens), length, count)
            for length, count, _, e in ranked]


def brute_cache(stored, context, max_tokens, min_match, max_match, limit, exclude):
    ranked = brute_ranked(stored, context, min_match, max_match, limit, exclude, len(context))
    return [SuffixCandidate(stored[i][e:e + max_tokens], length, count, True)
            for length, count, i, e in ranked]


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
    with pytest.raises(InputError, match="max_tokens"):
        SuffixCache(0)


# ---------------------------------------------------------------------------- cross-request cache
def counts(cache: SuffixCache) -> dict:
    """The trie's structure and counts (latest ends are global positions, so left out)."""
    def walk(node) -> dict | tuple:
        if isinstance(node, _Tail):
            return ("tail", node.limit)
        assert all(s[0] > 0 for s in node.follow.values())
        return {"follow": {t: s[0] for t, s in node.follow.items()},
                "older": {t: walk(c) for t, c in node.older.items()}}
    return walk(cache.trie.root)


def all_lead_to_statistics(node, depth: int, min_match: int) -> bool:
    """No node is left that neither has statistics nor leads to some (eviction pruned)."""
    if isinstance(node, _Tail):
        return node.limit >= min_match
    kids = all(all_lead_to_statistics(c, depth + 1, min_match) for c in node.older.values())
    return kids and (depth == 0 or bool(node.older) or bool(node.follow))


def rebuilt(cache: SuffixCache) -> SuffixCache:
    fresh = SuffixCache(cache.max_tokens, cache.trie.min_match, cache.trie.max_match)
    for seq in cache.sequences:
        fresh.add(seq)
    return fresh


@pytest.mark.parametrize("seed", range(4))
def test_cache_propose_equals_brute_force_with_eviction(seed):
    rng = random.Random(100 + seed)
    budget, vocab = rng.randint(20, 200), rng.randint(4, 6)
    min_match, max_match = rng.randint(1, 3), rng.randint(3, 10)
    cache = SuffixCache(budget, min_match, max_match)
    stored: list[list[int]] = []
    for _ in range(12):
        seq = random_seq(rng, vocab, rng.randint(1, 120))
        cache.add(seq)
        stored.append(seq[-budget:])
        while sum(map(len, stored)) > budget:
            stored.pop(0)
        assert cache.stored_tokens == sum(map(len, stored)) <= budget
        assert cache.sequences == stored
        own = SuffixIndex(min_match, max_match, max_candidates=3, cache=cache)
        for part in chunks(rng, random_seq(rng, vocab, rng.randint(1, 40))):
            own.extend(part)
            max_tokens = rng.randint(1, 10)
            mine = brute_own(own.tokens, max_tokens, min_match, max_match, 3)
            shared = brute_cache(stored, own.tokens, max_tokens, min_match, max_match,
                                 3 - len(mine), {c.tokens[0] for c in mine})
            assert own.propose(max_tokens) == mine + shared


def test_eviction_leaves_the_trie_of_the_remaining_sequences():
    rng = random.Random(7)
    cache = SuffixCache(100, 2, 6)
    for _ in range(15):
        cache.add(random_seq(rng, 4, rng.randint(10, 60)))
        assert all_lead_to_statistics(cache.trie.root, 0, 2)
    cache.add([1] * 100)                                       # the whole budget: the rest goes
    assert [len(s) for s in cache.sequences] == [100] and cache.stored_tokens == 100
    assert counts(cache) == counts(rebuilt(cache))
    cache.add(list(range(250)))                                # longer than the budget: its tail
    assert cache.sequences == [list(range(150, 250))] and cache.stored_tokens == 100
    assert counts(cache) == counts(rebuilt(cache))
    assert set(cache.trie.root.older) == set(range(151, 249))  # ends 2..99; no 1 is left
    assert all(isinstance(c, _Tail) for c in cache.trie.root.older.values())   # novel: no splits


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
    waited for a gen-2 collection, 50-120 ms inside a decode step, which the adaptive step then
    took for the cost of the arm it had run."""
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
