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
the root).

Why a context trie and not a suffix automaton: the trie reads contexts backwards (last token
first) to depth max_match, and at every node of depth >= min_match keeps, per next token, the
count and the latest end. Appending a token walks one path of at most max_match nodes (no rescan),
and `propose` walks the current suffix's path once, so both are O(max_match), and counts and
recency are exact at every match length. A suffix automaton finds unbounded matches in O(1)
amortised time, but per-state occurrence counts and latest ends need updates along the whole
suffix-link path (O(n) per token in a loop like "a a a a"). A context seen only once is a single
tail entry, split into nodes when a second occurrence shares it (as in a suffix tree), so novel
text costs one entry per token, and a loop costs time rather than memory (the full depth is
walked per token, over nodes that already exist).
"""
from __future__ import annotations

from typing import Callable, Iterable, NamedTuple, Sequence

from ..errors import InputError


class SuffixCandidate(NamedTuple):
    tokens: list[int]       # the continuation; tokens[0] is proposed after the current last token
    match_len: int          # length L of the matched suffix
    count: int              # occurrences of S_L followed by tokens[0]


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
        if limit < self.min_match:                  # no statistics to keep, so no nodes either
            return
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


class _Lookup:
    """tokens[pos]: a sequence's lookup for its trie, holding the list and not the index."""
    __slots__ = ("tokens",)

    def __init__(self, tokens: list[int]):
        self.tokens = tokens

    def __call__(self, pos: int) -> int:
        return self.tokens[pos]


SYNC_EVERY = 64     # tokens appended before the trie indexes them unasked (SuffixIndex.extend)


class SuffixIndex:
    """The suffix index of one growing sequence (prompt + output): `extend` as tokens are emitted,
    `propose` before each draft tree. O(max_match) per appended token and per proposal."""

    def __init__(self, min_match: int = 2, max_match: int = 16, max_candidates: int = 2):
        if max_candidates < 1:
            raise InputError(f"SuffixIndex max_candidates must be >= 1, got {max_candidates}")
        self.tokens: list[int] = []
        # the list's own lookup, not a method of self: a trie holding self would make every index
        # a reference cycle, its thousands of nodes freed only by the garbage collector (a long
        # gen-2 pass inside a decode step, which the adaptive step took for a slow arm)
        self.trie = _ContextTrie(min_match, max_match, _Lookup(self.tokens))   # deepcopy-safe too
        self.max_candidates = max_candidates
        self.indexed = 0                    # tokens[:indexed] are in the trie (`_sync`)
        self.windows: dict[int, set[tuple[int, ...]]] = {}   # k -> the k-token windows followed by a token

    def extend(self, tokens: Iterable[int]) -> None:
        """Append emitted tokens. The trie takes them when a proposal needs it (`_sync`): a plain
        stretch asks only `has_match`, answered from the windows, and the trie then indexes the
        stretch in one pass (each token walked alone between two target forwards found its nodes
        gone from the CPU caches: ~17 us a step against ~2 us in a pass), at the latest every
        SYNC_EVERY tokens: a proposal after a long stretch does not index it all in its own step."""
        seq, windows = self.tokens, self.windows
        for tok in tokens:
            seq.append(int(tok))
            n = len(seq) - 1                # the token before it now has a next token
            for k, seen in windows.items():
                if n >= k:
                    seen.add(tuple(seq[n - k:n]))
        if len(seq) - self.indexed >= SYNC_EVERY:
            self._sync()

    def _sync(self) -> None:
        """Index the tokens appended since the trie last took any (a proposal, or SYNC_EVERY)."""
        trie, n = self.trie, len(self.tokens)
        for e in range(self.indexed, n):
            trie.add(e, min(trie.max_match, e))
        self.indexed = n

    def has_match(self, min_match: int = 0) -> bool:
        """Whether propose(n, min_match) would return a continuation (n >= 1), at a fraction of
        its cost: the adaptive step's plain stretch asks this every step. The last k tokens
        (k = max(min_match, the index's min_match)) occurred before with a next token, kept as the
        set of k-token windows (one per token, made on the first ask for k), so no trie walk."""
        k, seq = max(min_match, self.trie.min_match), self.tokens
        if k > self.trie.max_match or k > len(seq):
            return False
        seen = self.windows.get(k)
        if seen is None:
            seen = self.windows[k] = {tuple(seq[e - k:e]) for e in range(k, len(seq))}
        return tuple(seq[-k:]) in seen

    def propose(self, max_tokens: int = 8, min_match: int = 0) -> list[SuffixCandidate]:
        """Up to max_candidates continuations (distinct first tokens) of matches at least
        `min_match` tokens long (ranked longest first, so the shorter ones are never built)."""
        if max_tokens < 1:
            return []
        self._sync()
        n, seq = len(self.tokens), self.tokens
        # the own trie holds ends e <= n-1 only (the last token has no next yet): all earlier
        out = []
        for length, _, count, e in self.trie.ranked(seq, self.max_candidates, set()):
            if length < min_match:
                break
            period = n - e
            cont = [seq[e + j % period] for j in range(max_tokens)]
            out.append(SuffixCandidate(cont, length, count))
        return out
