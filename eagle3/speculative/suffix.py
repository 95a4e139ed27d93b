"""Suffix candidates: what followed earlier occurrences of the text's current suffix.

Text repeats itself (answers quote the question, code repeats identifiers, small models loop), so
the tokens that followed an earlier occurrence of the last few tokens are a cheap guess at the next
ones. The guesses become extra branches of the EAGLE tree (merge.py) and are verified with it.

Semantics (s = s[0..n-1], the prompt and the tokens emitted so far; S_L = s[n-L..n-1]):

    occurrence      an end e with L <= e <= n-1 and s[e-L..e-1] == S_L (it may overlap S_L);
                    its next token is s[e]
    match length    L runs from min(max_match, n-1) down to min_match; at each L the occurrences
                    of S_L are grouped by next token t: count_L(t) occurrences, the latest at
                    last_L(t); tokens are taken by count, most first, ties to the later last_L(t),
                    skipping tokens already proposed by a longer L, until max_candidates
    continuation    of the occurrence e = last_L(t), max_tokens long: s[e + (j mod (n - e))] for
                    j = 0, 1, ...: an LZ77 copy that, once it reaches the current end, copies its
                    own output, so a loop (p = n - e tokens long) keeps proposing the loop

So the first candidate is the most frequent continuation of the longest match, the most recent
among equals; candidates have distinct first tokens (their branches start at distinct children of
the root). A SuffixCache of recent finished sequences is consulted after the own sequence with the
same current suffix (there L may reach n), filling the remaining slots with new first tokens; its
continuations stop at the end of the stored sequence.

Why a context trie and not a suffix automaton: the trie reads contexts backwards (last token
first) to depth max_match, and at every node of depth >= min_match keeps, per next token, the
count and the latest end. Appending a token walks one path of at most max_match nodes (no rescan),
and `propose` walks the current suffix's path once, so both are O(max_match), and counts and
recency are exact at every match length. A suffix automaton finds unbounded matches in O(1)
amortised time, but per-state occurrence counts and latest ends need updates along the whole
suffix-link path (O(n) per token in a loop like "a a a a"). A context seen only once is a single
tail entry, split into nodes when a second occurrence shares it (as in a suffix tree), so novel
text costs one entry per token: measured ~130 bytes and ~5 us per token of random text, ~14 bytes
and ~55 us per token of a 3-token loop (the full depth is walked); `propose` takes ~1-20 us.
"""
from __future__ import annotations

from bisect import bisect_right
from typing import Callable, Iterable, NamedTuple, Optional, Sequence

from ..errors import InputError


class SuffixCandidate(NamedTuple):
    tokens: list[int]       # the continuation; tokens[0] is proposed after the current last token
    match_len: int          # length L of the matched suffix
    count: int              # occurrences of S_L followed by tokens[0]
    from_cache: bool = False  # found in the cross-request SuffixCache, not the own sequence


class _Node:
    """A context seen at least twice (or the root, or on the way to such contexts)."""
    __slots__ = ("older", "follow")

    def __init__(self):
        self.older: dict[int, _Node | _Tail] = {}  # context one token longer (one token earlier)
        self.follow: dict[int, list[int]] = {}     # next token -> [count, latest end]


class _Tail:
    """A context seen once, standing for every longer context of that occurrence up to `limit`."""
    __slots__ = ("e", "limit")

    def __init__(self, e: int, limit: int):
        self.e, self.limit = e, limit


class _ContextTrie:
    """Contexts read backwards to depth max_match; next-token statistics at depth >= min_match.

    Contexts that occurred once are one _Tail each, deepened (split into _Nodes) only when a second
    occurrence shares them: novel text costs O(1) nodes per token, a repeat O(shared length)."""

    def __init__(self, min_match: int, max_match: int, token_at: Callable[[int], int]):
        check_match_range(min_match, max_match)
        self.min_match, self.max_match, self.token_at = min_match, max_match, token_at
        self.root = _Node()

    def add(self, e: int, limit: int) -> None:
        """Record that the contexts before position e (at most `limit` long) were followed by it."""
        if limit < self.min_match:                  # no statistics to keep, so no nodes either:
            return                                  # every node leads to statistics (pruning)
        node, tok = self.root, self.token_at(e)
        for d in range(limit + 1):
            if d >= self.min_match:
                stat = node.follow.setdefault(tok, [0, e])
                stat[0] += 1
                stat[1] = e
            if d == limit:
                return
            key = self.token_at(e - d - 1)
            child = node.older.get(key)
            if child is None:
                node.older[key] = _Tail(e, limit)
                return
            if isinstance(child, _Tail):
                child = node.older[key] = self._split(child, d + 1)
            node = child

    def _split(self, tail: _Tail, depth: int) -> _Node:
        """The tail's context at `depth` as a _Node, the rest of the tail one level deeper."""
        node = _Node()
        if depth >= self.min_match:
            node.follow[self.token_at(tail.e)] = [1, tail.e]
        if depth < tail.limit:
            node.older[self.token_at(tail.e - depth - 1)] = tail
        return node

    def remove(self, e: int, limit: int) -> None:
        """Undo `add(e, limit)`, oldest occurrences first (so every latest end stays valid)."""
        if limit < self.min_match:
            return
        path, node, tok = [], self.root, self.token_at(e)
        for d in range(limit + 1):
            if d >= self.min_match:
                stat = node.follow[tok]
                stat[0] -= 1
                if stat[0] == 0:
                    del node.follow[tok]
            if d == limit:
                break
            key = self.token_at(e - d - 1)
            child = node.older[key]
            if isinstance(child, _Tail):            # the one occurrence it stands for is e
                del node.older[key]
                break
            path.append((node, key))
            node = child
        for parent, key in reversed(path):          # prune nodes left without contexts or stats
            child = parent.older[key]
            if child.older or child.follow:
                break
            del parent.older[key]

    def matches(self, context: Sequence[int]) -> list[tuple[int, list]]:
        """(L, [(next token, [count, latest end])]) for the suffixes of `context` seen before with
        statistics, longest first."""
        node, out = self.root, []
        for d in range(1, min(self.max_match, len(context)) + 1):
            child = node.older.get(context[-d])
            if child is None:
                break
            if isinstance(child, _Tail):
                length = self._tail_match(child, context, d)
                if length >= self.min_match:
                    out.append((length, [(self.token_at(child.e), [1, child.e])]))
                break
            node = child
            if d >= self.min_match and node.follow:
                out.append((d, list(node.follow.items())))
        return out[::-1]

    def _tail_match(self, tail: _Tail, context: Sequence[int], depth: int) -> int:
        """How far the tail's occurrence matches `context`, given it matches `depth` tokens."""
        stop = min(tail.limit, len(context))
        while depth < stop and self.token_at(tail.e - depth - 1) == context[-depth - 1]:
            depth += 1
        return depth

    def ranked(self, context: Sequence[int], limit: int, exclude: set[int]):
        """Up to `limit` (L, next token, count, latest end), by the module docstring's order."""
        out, seen = [], set(exclude)
        for length, follow in self.matches(context):
            for tok, (count, at) in sorted(follow, key=lambda kv: (-kv[1][0], -kv[1][1])):
                if len(out) == limit:
                    return out
                if tok not in seen:
                    seen.add(tok)
                    out.append((length, tok, count, at))
        return out


def check_match_range(min_match: int, max_match: int) -> None:
    if not 1 <= min_match <= max_match:
        raise InputError(f"suffix matching needs 1 <= min_match <= max_match, got min_match="
                         f"{min_match}, max_match={max_match}; raise max_match or lower min_match")


class SuffixCache:
    """Recent finished sequences for suffix matching across requests, capped at `max_tokens` stored
    tokens: adding a sequence evicts the oldest ones until the total fits (a sequence longer than
    the budget keeps its last `max_tokens` tokens). Memory is linear in the budget (see module)."""

    def __init__(self, max_tokens: int, min_match: int = 2, max_match: int = 16):
        if max_tokens < 1:
            raise InputError(f"SuffixCache max_tokens must be >= 1, got {max_tokens}; leave the "
                             f"cache out (None) to turn cross-request suffix matching off")
        self.max_tokens = max_tokens
        self.trie = _ContextTrie(min_match, max_match, self._token_at)
        self.tokens: list[int] = []              # the stored sequences, concatenated
        self.offset = 0                          # global position of tokens[0]
        self.starts: list[int] = []              # global position of each sequence's first token
        self.lengths: list[int] = []

    @property
    def stored_tokens(self) -> int:
        return len(self.tokens)

    @property
    def sequences(self) -> list[list[int]]:
        return [self._seq(i) for i in range(len(self.starts))]

    def add(self, tokens: Sequence[int]) -> None:
        seq = [int(t) for t in tokens][-self.max_tokens:]
        while self.starts and len(self.tokens) + len(seq) > self.max_tokens:
            self._evict()
        start = self.offset + len(self.tokens)
        self.tokens += seq
        self.starts.append(start)
        self.lengths.append(len(seq))
        for j in range(1, len(seq)):
            self.trie.add(start + j, min(self.trie.max_match, j))

    def _evict(self) -> None:
        start, length = self.starts.pop(0), self.lengths.pop(0)
        for j in range(1, length):
            self.trie.remove(start + j, min(self.trie.max_match, j))
        del self.tokens[:length]
        self.offset += length

    def _token_at(self, pos: int) -> int:
        return self.tokens[pos - self.offset]

    def _seq(self, i: int) -> list[int]:
        begin = self.starts[i] - self.offset
        return self.tokens[begin:begin + self.lengths[i]]

    def propose(self, context: Sequence[int], max_tokens: int, limit: int,
                exclude: Iterable[int] = ()) -> list[SuffixCandidate]:
        """Continuations of stored occurrences of `context`'s suffixes, first tokens not in
        `exclude`."""
        out = []
        for length, _, count, at in self.trie.ranked(context, limit, set(exclude)):
            i = bisect_right(self.starts, at) - 1
            stop = min(at + max_tokens, self.starts[i] + self.lengths[i])
            cont = self.tokens[at - self.offset:stop - self.offset]
            out.append(SuffixCandidate(cont, length, count, True))
        return out


class _Lookup:
    """tokens[pos]: a sequence's lookup for its trie, holding the list and not the index."""
    __slots__ = ("tokens",)

    def __init__(self, tokens: list[int]):
        self.tokens = tokens

    def __call__(self, pos: int) -> int:
        return self.tokens[pos]


class SuffixIndex:
    """The suffix index of one growing sequence (prompt + output): `extend` as tokens are emitted,
    `propose` before each draft tree. O(max_match) per appended token and per proposal."""

    def __init__(self, min_match: int = 2, max_match: int = 16, max_candidates: int = 2,
                 cache: Optional[SuffixCache] = None):
        if max_candidates < 1:
            raise InputError(f"SuffixIndex max_candidates must be >= 1, got {max_candidates}")
        self.tokens: list[int] = []
        # the list's own lookup, not a method of self: a trie holding self would make every index
        # a reference cycle, its thousands of nodes freed only by the garbage collector (gen-2
        # passes of 50-120 ms in a decode step, which the adaptive step took for a slow arm)
        self.trie = _ContextTrie(min_match, max_match, _Lookup(self.tokens))   # deepcopy-safe too
        self.max_candidates, self.cache = max_candidates, cache

    def extend(self, tokens: Iterable[int]) -> None:
        for tok in tokens:
            self.tokens.append(int(tok))
            n = len(self.tokens) - 1
            self.trie.add(n, min(self.trie.max_match, n))

    def propose(self, max_tokens: int = 8) -> list[SuffixCandidate]:
        """Up to max_candidates continuations (distinct first tokens), own sequence first."""
        if max_tokens < 1:
            return []
        n, seq = len(self.tokens), self.tokens
        # the own trie holds ends e <= n-1 only (the last token has no next yet): all earlier
        out = []
        for length, _, count, e in self.trie.ranked(seq, self.max_candidates, set()):
            period = n - e
            cont = [seq[e + j % period] for j in range(max_tokens)]
            out.append(SuffixCandidate(cont, length, count))
        if self.cache is not None and len(out) < self.max_candidates:
            out += self.cache.propose(seq, max_tokens, self.max_candidates - len(out),
                                      {c.tokens[0] for c in out})
        return out
