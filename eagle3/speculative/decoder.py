"""SpecDecoder: EAGLE-3 (and EAGLE-1/2) speculative decoding for one sequence.

One step reads like the algorithm: draft a tree -> verify it in one target forward -> accept ->
commit the accepted path in the target cache -> extend the draft over the accepted tokens.

With spec.suffix_tokens > 0 the drafted tree also gets up to that many nodes from suffix matches
over the prompt and the output so far (suffix.py; merged in merge.py, one host copy of the tree
per step). Suffix nodes are ordinary tree nodes to the verify forward, so they get target features
there and the draft extends over them like over draft nodes; a suffix chain can reach below
spec.depth (the verify block is at most spec.max_tree_size rows, inside spec.cache_slack).

With a policy (policy.AdaptivePolicy) each step takes the shape the policy chooses, or a plain
step: one target forward of the root, the token drawn as plain decoding draws it. A plain step
runs no draft forward: its (feature, next id) row waits in `pending` and the draft catches up over
all waiting rows in one forward before the next drafted tree (draft length = target length again).
Prefill leaves the prompt's rows waiting the same way (with or without a policy), so a request
decoded plainly throughout never runs the draft.
A suffix-only step (policy.SUFFIX_ONLY, chosen only at a step where the suffix index has a match)
verifies the root and the index's continuations alone (2 x (the last suffix-only block's accepted
nodes + 1) nodes, within half to four times policy.suffix_only_tokens, after a match of 8+ tokens;
a fixed size by the match's class after a shorter one: `suffix_only_budget`) and
runs no draft forward either: the (features, next ids) rows of its accepted nodes wait in `pending`
like a plain step's, and its tree goes through the same verifiers as a hybrid tree (a suffix
continuation is a point-mass proposal, fixed by the context; see verify.py).
Without a draft (a target no draft was trained for) the policy has no tree shapes: each step is a
suffix-only block or a plain step, nothing waits in `pending` and there is no draft cache.

Cache bookkeeping (n = target cache length at the start of a step):

    target cache   tokens 0..n-1; the root (last emitted token, position n) is not cached yet
    draft cache    n rows: row i pairs the target feature of token i with the id of token i+1,
                   at position i; the last row's logits/hidden are `self.head` (they propose
                   the tree's first level). After a restart (`_catch_up`, CATCH_UP_WINDOW) row i
                   is token draft_offset + i's, at its true position, and the draft cache holds
                   n - draft_offset rows; below, "n" is the draft's length + draft_offset
    tree forward   level-d tokens (d = 1..depth-1) go through the draft at position n+d-1, hidden =
                   the draft output of their parent's row; rows n.. hold them and are dropped
    verify         the T tree nodes at positions n + depth, KV written at n..n+T-1, then the
                   accepted nodes compacted to n..n+m (keep) -> target length n+m+1
    extend         draft rows n..n+m pair the features of the m+1 accepted nodes with the ids
                   of accepted tokens 2..m and the bonus -> draft length n+m+1 again
"""
from __future__ import annotations

import time
from typing import NamedTuple, Optional

import torch

from ..errors import ContractError, InputError
from ..sampling import SamplingParams, sample_next
from .step import Step
from ..models.layers import tree_block_mask
from ..models.kv_cache import KVCache
from ..draft.model import DraftBase
from .merge import SUFFIX, merge_suffix
from .policy import PLAIN, SHORT_MATCH_NODES, SUFFIX_ONLY, AdaptivePolicy, match_class, name_of
from .suffix import SuffixIndex
from .tree import (Frontier, Level, SpecParams, Tree, build_tree, concat_levels, expand,
                   root_frontier, select_nodes)
from .verify import Acceptance, verify_greedy, verify_sampled


class DraftHead(NamedTuple):
    """The draft's output at its last cached row: proposes the first tree level."""
    logits: torch.Tensor   # [Vd]
    hidden: torch.Tensor   # [H] pre-norm, fed back as hidden= for the first level's children


# A suffix-only block's size follows the last one's acceptance: SUFFIX_GROWTH x (accepted + 1)
# nodes, at least half policy.suffix_only_tokens (the size before any) and at most SUFFIX_MAX_FACTOR
# times it; past it only as far as both caches have room beyond the slack reserved at prefill. A
# copy under way grows its blocks, a guess that failed shrinks them back. Replayed on the copy
# workload's greedy outputs (studies/suffix-budget/suffix_budget_sim.py), this rule beat a fixed block size and
# doubling after each block accepted whole.
SUFFIX_GROWTH = 2
SUFFIX_MAX_FACTOR = 4
# ... that at a match of 8+ tokens. A shorter match is a guess, not a copy under way: its block has a
# fixed size by the match's class (policy.SHORT_MATCH_NODES).
# The draft's way back after rows it did not run (a prompt, plain or suffix-only steps): over at most
# this many of the latest, from an empty draft cache. Rotary attention depends on positions only
# through their differences, so the restarted rows at draft positions 0.. see each other as they
# would at their true positions; the draft loses the context before them, and the return costs
# one forward of at most this many rows instead of one over the whole stretch (at T=1 a return
# after a 400-token stretch cost ~8 plain steps). Lossless either way: the draft only proposes.
CATCH_UP_WINDOW = 64


class Shadow:
    """A suffix-only block not taken at a greedy step, judged by the tokens emitted from that step
    on: at T=0 the target's choice decides acceptance whatever arm emits the tokens, so the block
    would have accepted the longest common prefix of a continuation and those tokens. Known once
    every continuation has met a mismatch or its end (AdaptivePolicy.observe_shadow)."""

    def __init__(self, conts: list[list[int]], match: int, rows: int):
        self.conts, self.match, self.rows = conts, match, rows
        self.matched = [0] * len(conts)      # per continuation: tokens matched so far
        self.open = list(range(len(conts)))  # continuations not yet ended

    def feed(self, tokens: list[int]) -> Optional[int]:
        """The accepted nodes once known (None: not yet)."""
        still = []
        for i in self.open:
            cont, before = self.conts[i], self.matched[i]
            n = before
            for tok in tokens:
                if n == len(cont) or cont[n] != tok:
                    break
                n += 1
            self.matched[i] = n
            if n < len(cont) and n == before + len(tokens):     # every token matched, more to come
                still.append(i)
        self.open = still
        return None if still else max(self.matched)


class Verified(NamedTuple):
    """A verified tree block: the acceptance and the target features of the accepted nodes."""
    acc: Acceptance
    features: Optional[torch.Tensor]   # [m+1, F] at the root and the accepted nodes, in path
                                       # order (None without a draft: nothing reads them)


class SpecDecoder:
    """Implements eagle3.generate.types.Decoder with a draft model and tree verification."""

    def __init__(self, target, draft: Optional[DraftBase], cache: KVCache, draft_cache: Optional[KVCache],
                 params: SamplingParams, spec: Optional[SpecParams] = None,
                 policy: Optional[AdaptivePolicy] = None):
        self.target, self.draft, self.cache, self.draft_cache = target, draft, cache, draft_cache
        self.params, self.spec, self.policy = params, spec or SpecParams(), policy
        self.timed = True      # the next step runs on the chosen thread count (Engine.decode_step)
        self.last_run: Optional[tuple] = None   # the last policy step: arm, rows, levels, catch-up rows
        self.suffix_only_tokens = policy.suffix_only_tokens if policy else 0
        if draft is None:      # no draft: suffix-only blocks and plain steps under the policy
            if policy is None or policy.shapes or not self.suffix_only_tokens:
                raise InputError("a SpecDecoder without a draft needs a policy of suffix-only blocks "
                                 "(no tree shapes, suffix_only_tokens > 0): api.adaptive_policy(target, None)")
            self.shapes, self.capture_ids = (), ()
        else:
            self.shapes = (self.spec,) + (tuple(policy.shapes) if policy else ())
            self.capture_ids = check_draft(draft, target, self.shapes)
        self.device = target.device
        self.gen = params.generator(self.device)
        self.eyes = {s.top_k: torch.eye(s.top_k, dtype=torch.bool, device=self.device) for s in self.shapes}
        self._slack = cache_slack(self.shapes, self.suffix_only_tokens)
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []   # plain steps' (next id, feature)
        self.plain_left = 0            # steps of a plain stretch still to run (policy.plain_run)
        self._expected: Optional[float] = None   # expected_ms of the stretch's first step
        self.draft_offset = 0          # tokens before the draft cache's row 0 (a restart drops them)
        self.levels = 0                                              # draft forwards this step
        self.caught_up: Optional[tuple[int, float]] = None           # this step's catch-up: rows, ms
        self.root = torch.zeros(1, dtype=torch.long, device=self.device)
        self.head: Optional[DraftHead] = None
        self.suffix: Optional[SuffixIndex] = None   # over the prompt and the output so far
        self.suffix_last: Optional[int] = None      # the last suffix-only block's accepted nodes
        self.shadow: Optional[Shadow] = None        # a block not taken, being judged (greedy)

    @property
    def expected_ms(self) -> Optional[float]:
        """The last policy step's cost by the policy's table, catch-up included: what the thread
        governor weighs the step's time by (a tree step costs several plain ones). Inside a plain
        stretch the value of its first step serves the rest."""
        if self.last_run is None:
            return None
        if self.plain_left and self._expected is not None:
            return self._expected
        self._expected = self.policy.step_cost_ms(*self.last_run)
        return self._expected

    @property
    def slack(self) -> int:
        """Cache rows reserved past the output at prefill: the largest verify block or draft tree."""
        return self._slack

    @property
    def caches(self) -> tuple[KVCache, ...]:
        return (self.cache,) if self.draft is None else (self.cache, self.draft_cache)

    # ------------------------------------------------------------------ decoder interface
    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int], max_new_tokens: int) -> Step:
        n = len(prompt_ids)
        self.pending, self.suffix_last, self.shadow, self.plain_left = [], None, None, 0
        self.draft_offset = 0
        for cache in self.caches:
            cache.reset()
            cache.check_room(n + max_new_tokens + self.slack - 1)
        t0 = time.perf_counter()
        ids = torch.tensor(prompt_ids, device=self.device)
        out = self.target(ids[None], torch.arange(n, device=self.device), self.cache,
                          logits_rows=slice(-1, None), capture_ids=self.capture_ids)
        self.root = sample_next(out.logits[0, -1], self.params, self.gen).view(1)
        t1 = time.perf_counter()
        # the draft's rows over the prompt wait like a plain step's: the first drafted tree catches
        # up over them, and a request the policy decodes plainly never runs them (the draft's
        # prefill is a cost on the GGUF codes, where plain steps win)
        self.head = None
        if self.draft is not None:
            self._wait(torch.cat([ids[1:], self.root]), self._features(out)[0])
        root = int(self.root)
        if self.suffix_only_tokens or any(s.suffix_tokens for s in self.shapes):
            self.suffix = SuffixIndex()
            self.suffix.extend(list(prompt_ids) + [root])
        return Step([root], 0, draft_s=time.perf_counter() - t1, verify_s=t1 - t0)

    @torch.inference_mode()
    def step(self) -> Step:
        if self.policy is None:
            return self.tree_step()
        if self.plain_left:
            if not self._suffix_offers():
                return self._stretch_step()
            self.plain_left = 0
        t0 = time.perf_counter()
        conts, match, budget = self.suffix_only_candidates()
        arm = self.policy.choose(suffix_ready=bool(conts), suffix_match=match)
        self.levels, self.caught_up = 0, None
        if arm not in (PLAIN, SUFFIX_ONLY) and self.head is None and not self.pending:
            arm = PLAIN        # nothing captured to draft from (a leader changed unforeseen): this
            step = self.plain_step(capture=True)     # step captures, the next may draft
        elif arm == PLAIN:
            step = self.plain_step()
        elif arm == SUFFIX_ONLY:
            step = self.suffix_step(conts, budget)
        else:
            self.spec = arm
            step = self.tree_step()
        wall_ms = 1e3 * (time.perf_counter() - t0)
        if conts and arm != SUFFIX_ONLY and self.shadow is None and self.params.greedy:
            self.shadow = Shadow(conts, match, 1 + min(budget, sum(map(len, conts))))
        self._judge_shadow(step.tokens)
        self.last_run = (arm, step.proposed + 1, self.levels, self.caught_up[0] if self.caught_up else 0)
        self._expected = None
        if self.caught_up is not None:
            # the draft's catch-up over rows that plain / suffix-only steps left is the price of
            # coming back to drafting, paid once per return whatever the shape: charged to the
            # shape, it made every probe after a plain stretch look slow (a draft forward over the
            # whole stretch) and kept the policy on plain decoding where a shape paid (T=1)
            rows, ms = self.caught_up
            self.policy.observe_catch_up(rows, ms)
            wall_ms -= ms
        self.policy.observe(arm, step, self.levels, wall_ms, timed=self.timed)
        if arm == PLAIN and not self.policy.probing:
            self.plain_left = self.policy.plain_run(CATCH_UP_WINDOW)
        return step._replace(arm=name_of(arm))

    def _suffix_offers(self) -> bool:
        """Whether the suffix index would offer a suffix-only block now."""
        return bool(self.suffix is not None and self.suffix_only_tokens
                    and self.suffix.has_match(self.policy.suffix_only_min_match))

    def _stretch_step(self) -> Step:
        """A step of a plain stretch (AdaptivePolicy.plain_run): a plain step without asking the
        policy, capturing nothing (no drafted step comes within CATCH_UP_WINDOW steps after the
        stretch), reported to the policy as any step. Its bookkeeping is what plain decoding's is,
        plus the suffix index: over a stretch the adaptive step costs what plain decoding does."""
        self.plain_left -= 1
        t0 = time.perf_counter()
        step = self.plain_step(capture=False)
        self._judge_shadow(step.tokens)
        self.policy.observe_stretch(1e3 * (time.perf_counter() - t0), timed=self.timed)
        return step

    def _judge_shadow(self, tokens: list[int]) -> None:
        """Feed the emitted tokens to the block being judged; once known, the policy gets what it
        would have emitted."""
        if self.shadow is None:
            return
        accepted = self.shadow.feed(tokens)
        if accepted is not None:
            self.policy.observe_shadow(self.shadow.match, accepted + 1, self.shadow.rows)
            self.shadow = None

    def plain_step(self, capture: Optional[bool] = None) -> Step:
        """One target forward of the root; the token drawn as plain decoding draws it. The target's
        features for the draft are captured only where the policy may draft within
        CATCH_UP_WINDOW steps (`draft_within`); elsewhere the draft's waiting rows are dropped, so
        it restarts from the rows captured after (a plain stretch costs what plain decoding does)."""
        t0 = time.perf_counter()
        start = self.cache.length
        positions = torch.tensor([start], device=self.device)
        if capture is None:
            capture = self.policy is None or self.policy.draft_within(CATCH_UP_WINDOW)
        capture = capture and self.draft is not None
        out = self.target(self.root[None], positions, self.cache,
                          capture_ids=self.capture_ids if capture else ())
        self.root = sample_next(out.logits[0, -1], self.params, self.gen).view(1)
        if capture:
            self._wait(self.root, self._features(out)[0])
        elif self.draft is not None:
            self._restart(start + 1, [])
        token = int(self.root)
        if self.suffix is not None:
            self.suffix.extend([token])
        return Step([token], 0, verify_s=time.perf_counter() - t0, arm=PLAIN)

    def suffix_only_candidates(self) -> tuple[list[list[int]], int, int]:
        """The continuations a suffix-only step would verify now (empty: no match, or no such arm),
        the longest match they continue (0: none) and the block's nodes for it. With several, the
        first (most frequent, longest match) is cut to leave the others a quarter of the budget."""
        shortest = self.policy.suffix_only_min_match
        if self.suffix is None or not self.suffix_only_tokens or not self.suffix.has_match(shortest):
            return [], 0, 0       # has_match first: propose indexes the tokens a stretch left
        most = self._within_room(SUFFIX_MAX_FACTOR * self.suffix_only_tokens)
        cands = self.suffix.propose(most, shortest)
        match = max((c.match_len for c in cands), default=0)
        budget = self.suffix_only_budget(match)
        return first_cut([c.tokens[:budget] for c in cands], budget), match, budget

    def suffix_only_budget(self, match: int) -> int:
        """Nodes a suffix-only block continuing a match `match` tokens long holds now. Below the
        last match class: its fixed size (policy.SHORT_MATCH_NODES, at most suffix_only_tokens).
        Else SUFFIX_GROWTH x (the last block's accepted nodes + 1), within [suffix_only_tokens // 2,
        SUFFIX_MAX_FACTOR x suffix_only_tokens] and the caches' room (`_within_room`)."""
        base, cls = self.suffix_only_tokens, match_class(match)
        if cls < len(SHORT_MATCH_NODES):
            return min(SHORT_MATCH_NODES[cls], base)
        last = self.suffix_last
        want = base // 2 if last is None else SUFFIX_GROWTH * (last + 1)
        return self._within_room(min(max(want, base // 2, 1), SUFFIX_MAX_FACTOR * base))

    def _within_room(self, want: int) -> int:
        """`want` nodes, past suffix_only_tokens only as far as both caches have room beyond the
        slack reserved at prefill."""
        base = self.suffix_only_tokens
        if want <= base:
            return want
        room = min(c.max_len for c in self.caches) - self.cache.length - self.slack
        return max(base, min(want, base + room))

    def suffix_step(self, conts: list[list[int]], budget: int) -> Step:
        """The root and the suffix continuations, verified in one target forward; no draft forward
        (the accepted nodes' rows wait in `pending` for the next drafted tree)."""
        if not conts:
            raise ContractError("suffix-only step", "no suffix continuation", "at least one",
                                "choose SUFFIX_ONLY only with choose(suffix_ready=True)")
        t0 = time.perf_counter()
        start = self.cache.length
        m = merge_suffix([int(self.root)], [-1], conts, budget)
        tree = build_tree(self._ids(m.tokens), self._ids(m.parents), start, m.depth, m.sources)
        acc, features = self._verify(tree, start)
        self.suffix_last = acc.accept_len
        self.root = self._ids(acc.tokens[-1:])
        if self.draft is not None:
            self._wait(self._ids(acc.tokens), features)
        self.suffix.extend(acc.tokens)
        return Step(acc.tokens, acc.accept_len, verify_s=time.perf_counter() - t0,
                    proposed=tree.size - 1, accepted_suffix=acc.accept_len)

    def tree_step(self) -> Step:
        t0 = time.perf_counter()
        self._catch_up()
        tree = self.draft_tree()
        t1 = self._clock()
        start = self.cache.length
        acc, features = self._verify(tree, start)
        t2 = time.perf_counter()
        self.root = self._ids(acc.tokens[-1:])
        self._extend(self._ids(acc.tokens), features, self.draft_cache.length)
        if self.suffix is not None:
            self.suffix.extend(acc.tokens)
        t3 = time.perf_counter()
        return Step(acc.tokens, acc.accept_len, draft_s=(t1 - t0) + (t3 - t2), verify_s=t2 - t1,
                    proposed=tree.size - 1, accepted_suffix=suffix_only(tree, acc.nodes))

    # ------------------------------------------------------------------ parts
    def _clock(self) -> float:
        """Time after the queued draft work: on CUDA the split of draft and verify time needs a sync
        (one per step); on the CPU work is synchronous."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _ids(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _verify(self, tree: Tree, start: int) -> Verified:
        """One target forward over the tree block at cache row `start`; the accepted path is
        compacted to start.. in the cache."""
        out = self.target(tree.tokens[None], tree.positions, self.cache,
                          attn_mask=tree_block_mask(start, tree.mask), capture_ids=self.capture_ids)
        acc = self.accept(out.logits[0], tree)
        kept = self._ids(acc.nodes)
        self.cache.keep(start, kept)
        return Verified(acc, self._features(out)[0, kept] if self.draft is not None else None)

    def accept(self, logits: torch.Tensor, tree: Tree) -> Acceptance:
        # logits [T, V] at the tree nodes
        if self.params.greedy:
            return verify_greedy(logits, tree)
        return verify_sampled(logits, tree, self.params, self.gen)

    def _wait(self, next_ids: torch.Tensor, features: torch.Tensor) -> None:
        """Rows for the draft's next catch-up: (next ids, features) of the tokens after the draft
        cache. Past CATCH_UP_WINDOW entries they are joined and only the latest CATCH_UP_WINDOW
        rows kept (all the catch-up reads), so a long plain stretch holds a bounded list."""
        self.pending.append((next_ids, features))
        if len(self.pending) > CATCH_UP_WINDOW:        # each entry holds a row or more
            self.pending = [self._joined_waiting()]

    def _joined_waiting(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The waiting rows as one (next ids, features) block of at most CATCH_UP_WINDOW rows:
        more, and the draft restarts from the latest of them (`_restart`, the rows before
        dropped)."""
        ids = torch.cat([i for i, _ in self.pending])
        feats = torch.cat([f for _, f in self.pending])
        if ids.numel() > CATCH_UP_WINDOW:
            self._restart(self.draft_offset + self.draft_cache.length + ids.numel() - CATCH_UP_WINDOW, [])
            ids, feats = ids[-CATCH_UP_WINDOW:], feats[-CATCH_UP_WINDOW:]
        return ids, feats

    def _restart(self, position: int, rows: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The draft starts again at token `position` from an empty cache, `rows` (that token's and
        the following ones') waiting: the rows before are dropped."""
        self.draft_cache.truncate(0)
        self.draft_offset, self.head, self.pending = position, None, rows

    def _catch_up(self) -> None:
        """The draft over the rows plain steps left waiting (one forward), so it proposes again;
        its rows and time in `caught_up`, and not one of the step's levels. More than
        CATCH_UP_WINDOW rows waiting (a prompt, a plain stretch): the draft restarts from the last
        CATCH_UP_WINDOW of them alone (`restart`), so the way back costs a bounded forward."""
        if self.pending:
            t0 = time.perf_counter()
            ids, feats = self._joined_waiting()
            self.pending = []
            self._extend(ids, feats, self.draft_cache.length)
            self.levels -= 1
            self.caught_up = (ids.numel(), 1e3 * (time.perf_counter() - t0))

    def draft_tree(self) -> Tree:
        """EAGLE-2 dynamic tree over the draft cache; the draft cache is left at its prefix."""
        spec, n = self.spec, self.draft_cache.length
        eye = self.eyes[spec.top_k]
        frontier, level = expand(root_frontier(self.device), self.head.logits[None], spec.top_k, 0)
        levels: list[Level] = [level]
        hidden = self.head.hidden.expand(spec.top_k, -1)               # [K, H]
        ancestors = eye[:, :0]                                         # [K, rows so far]
        for depth in range(1, spec.depth):
            if self._settled(levels, frontier):
                break
            out = self._draft_level(frontier, hidden, ancestors, position=self.draft_offset + n + depth - 1)
            offset = sum(lv.scores.numel() for lv in levels)
            frontier, level = expand(frontier, out.logits[0], spec.top_k, offset)
            levels.append(level)
            hidden = out.hidden[0, frontier.rows]
            ancestors = torch.cat([ancestors, eye], dim=1)[frontier.rows]
        self.draft_cache.truncate(n)
        return self._layout(concat_levels(levels), self.cache.length)   # the target's prefix

    def _settled(self, levels: list[Level], frontier: Frontier) -> bool:
        """True when no deeper candidate can enter the tree, so drafting can stop with the same tree.

        A child's score is its parent's plus a log-prob <= 0, so nothing below the frontier beats the
        frontier's best; if that is no better than the (num_draft_tokens-1)-th best candidate so far,
        the kept set is final (ties go to the earlier candidate, and deeper ones come later). The
        same holds when the frontier's best is below spec.min_prob. Checked on the CPU only: on CUDA
        the test would be a host sync per level.
        """
        if self.device.type != "cpu":
            return False
        best = float(frontier.scores.max())
        if best < self.spec.min_score:
            return True
        need = self.spec.num_draft_tokens - 1
        if sum(lv.scores.numel() for lv in levels) < need:
            return False
        return best <= float(torch.cat([lv.scores for lv in levels]).topk(need).values[-1])

    def _draft_level(self, frontier: Frontier, hidden: torch.Tensor, ancestors: torch.Tensor,
                     position: int):
        # frontier of K nodes -> one draft forward over them, tree-masked
        k, n = self.spec.top_k, self.draft_cache.length - ancestors.shape[1]
        prefix = torch.ones(k, n, dtype=torch.bool, device=self.device)
        mask = torch.cat([prefix, ancestors, self.eyes[k]], dim=1)[None, None]
        self.levels += 1
        ids = self.draft.to_target_ids(frontier.tokens)
        positions = torch.full((k,), position, dtype=torch.long, device=self.device)
        return self.draft(ids[None], positions, self.draft_cache, hidden=hidden[None], attn_mask=mask)

    def _layout(self, cands: Level, prefix_len: int) -> Tree:
        sel = select_nodes(cands, self.spec.num_draft_tokens, self.spec.min_score)
        tokens = torch.cat([self.root, self.draft.to_target_ids(cands.tokens[sel.cand_idx])])
        if self.suffix is None or not self.spec.suffix_tokens:
            return build_tree(tokens, sel.parents, prefix_len, self.spec.depth)
        return self._with_suffix(tokens, sel.parents, prefix_len)

    def _with_suffix(self, tokens: torch.Tensor, parents: torch.Tensor, prefix_len: int) -> Tree:
        """The draft tree with the suffix continuations merged in. A continuation can follow draft
        nodes for up to spec.depth tokens (free) before it adds up to suffix_tokens nodes."""
        spec = self.spec
        conts = [c.tokens for c in self.suffix.propose(spec.depth + spec.suffix_tokens)]
        m = merge_suffix(tokens.tolist(), parents.tolist(), conts, spec.suffix_tokens)
        return build_tree(self._ids(m.tokens), self._ids(m.parents), prefix_len,
                          max(spec.depth, m.depth), m.sources)

    def _features(self, out) -> torch.Tensor:
        """What the draft reads from the target: captured aux states (EAGLE-3) or final hidden."""
        return out.aux if self.capture_ids else out.hidden

    def _extend(self, next_ids: torch.Tensor, features: torch.Tensor, start: int) -> None:
        """Draft rows start.. pairing features [m, F] of tokens start.. with next_ids [m]."""
        self.draft_cache.truncate(start)
        self.levels += 1
        m = next_ids.numel()
        positions = torch.arange(start, start + m, device=self.device) + self.draft_offset
        out = self.draft(next_ids[None], positions, self.draft_cache, features=features[None],
                         logits_rows=slice(-1, None))
        self.head = DraftHead(out.logits[0, -1], out.hidden[0, -1])


def cache_slack(shapes, suffix_only_tokens: int = 0) -> int:
    """Cache rows past the output that speculation needs: the largest verify block or draft tree
    of the shapes, or a suffix-only block with its root (the Engine sizes its caches by it)."""
    return max(max((s.cache_slack for s in shapes), default=1), suffix_only_tokens + 2)


def check_draft(draft: DraftBase, target, shapes) -> tuple[int, ...]:
    """The draft fits the shapes and the target's vocabulary; the target layers it reads."""
    cfg = draft.config
    for shape in shapes:
        if shape.top_k > cfg.draft_vocab_size:
            raise InputError(f"spec top_k={shape.top_k} exceeds the draft vocabulary "
                             f"({cfg.draft_vocab_size}); lower top_k")
    if cfg.vocab_size != target.config.vocab_size:
        raise ContractError("draft vocab_size", cfg.vocab_size, target.config.vocab_size,
                            "this draft was trained for a target with another vocabulary; "
                            "use the draft made for this target")
    return tuple(cfg.aux_layer_ids) if cfg.algorithm == "eagle3" else ()


def first_cut(conts: list[list[int]], budget: int) -> list[list[int]]:
    """A suffix-only block's continuations: with several, the first (most frequent, longest match)
    is cut to leave the others a quarter of the budget."""
    if len(conts) > 1:
        conts = [conts[0][:budget - budget // 4]] + conts[1:]
    return conts


def suffix_only(tree: Tree, nodes: list[int]) -> int:
    """Accepted nodes (after the root) that only the suffix source proposed."""
    if tree.sources is None:
        return 0
    return sum(tree.sources[t] == SUFFIX for t in nodes[1:])
