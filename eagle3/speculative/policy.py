"""The adaptive step: which tree shape to draft next, or plain decoding, from measured costs and the
rolling acceptance of each choice.

Arms are named choices: PLAIN (one target row, no draft forward), SpecParams shapes, and
SUFFIX_ONLY: the suffix index's continuations alone as the verify block (no draft forward; offered
only at a step where the index has a match; the decoder sizes each block from the last one's
acceptance, half to four times suffix_only_tokens). For each arm the policy keeps rolling averages
of what its steps did (`RollingMean`: the plain mean of the first ~1/(1 - memory) steps, then
exponential with weight `memory` on the past):

    tokens   emitted tokens per step (accepted draft tokens + 1)
    rows     target rows verified per step (the tree's size; dynamic under min_prob)
    levels   draft forwards per step (tree levels run, plus the extend over the accepted tokens)
    ratio    wall time / the table's cost of that step (below)

and predicts a step's cost from the machine's cost table (runtime.costs: target ms by rows, draft ms
by rows), scaled by the arm's ratio, so a table gone stale (other load on the machine, the thread
governor down to one thread) is corrected per arm after a few steps while one noisy step is not:

    table(shape) = target_ms(rows) + levels * draft_ms(top_k) + overhead_ms
    table(SUFFIX_ONLY) = target_ms(rows) + overhead_ms
    table(PLAIN) = target_ms(1)                      (tokens = 1 exactly)
    cost(arm)    = table(arm) * ratio(arm)           (ratio 1 before the arm's first step)
    rate(arm)    = tokens(arm) / cost(arm)

A drafting step after plain or suffix-only steps first runs the draft over the rows they left
(`SpecDecoder._catch_up`, one forward of that many rows). That is the price of returning to
drafting, the same for every shape and growing with the stretch it follows; the decoder passes it
to `observe_catch_up` and leaves it out of the step's wall time and levels, so a probe after a
long plain stretch is judged by what the shape costs, not by the stretch (charged to the shape, it
made every probe at T=1 look slow, and plain decoding won every comparison it should have lost).

overhead_ms (tree building, verification, bookkeeping) is the rolling wall time past the predicted
forwards of the drafting steps, shared by the shapes; it is updated before the step's ratio is
taken, so the two do not count the same milliseconds twice. `correct_costs=False` trusts the table
as it is (the ratios are still kept).

`choose` returns the arm of the highest rate. An arm not tried yet goes first (the shapes in the
given order, then SUFFIX_ONLY). A probe takes the arm chosen least recently other than the best, so
a stretch where the draft starts to pay again (or a better shape, or plain decoding gone cheap) is
found after a fallback. The first probe comes at step probe_every - 1; each probe doubles the
interval to the next (up to max_probe_every), and the interval restarts at probe_every when the
leading arm among the shapes and plain changes (a probe that changed the choice, or the averages
moving). So a stable choice spends few steps on probes: at T=1, where plain wins most steps, a
probe at every base interval was a speculative step that did not pay. A probe that the averages
say will lose much waits longer still: the next probe comes no sooner than the steps over which
its predicted loss (`probe_loss_ms`: its steps' time past what the leader takes for as many
tokens) is probe_share of the leader's time, up to max_quiet_every steps. At T=1 on the GGUF
codes a probe of a sampled shape loses ~15 ms (four steps at ~1.2-1.6 tokens, each dearer than two
plain ones), and probes every 128 steps cost ~3% of the time: more than any shape won back. A
first try and a probe each run `probe_steps` steps: sampled requests take SAMPLED_PROBE_STEPS,
since one step's acceptance there is a coin flip, and single-step tries often left a paying shape
at "1.0 tokens a step" behind plain decoding, probed again only a doubling interval later.
Choosing never changes what is emitted: every arm is lossless.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional, Union

from ..errors import ContractError, InputError
from .step import Step
from .tree import SpecParams

PLAIN = "plain"
SUFFIX_ONLY = "suffix"
Arm = Union[str, SpecParams]

# the adaptive step's default choices for greedy requests (with PLAIN): the default tree, the same
# with up to 8 suffix nodes, and a small tree with suffix nodes for stretches where deep drafts are
# rejected
DEFAULT_SHAPES = (SpecParams(4, 5, 8, 0.05, suffix_tokens=8), SpecParams(4, 5, 8, 0.05),
                  SpecParams(2, 3, 4, 0.1, suffix_tokens=4))
# ... and for sampled requests: one level of 3 or 7 siblings, and the small tree. At T=1 the
# shipped draft's second level is rarely accepted, so a deep tree's levels cost a draft forward
# each for almost nothing, while a node's siblings are all tried in one verify row each (verify.py:
# P(accept) = the target's mass on the set), which beats a chain of one (scripts/measure_tau.py
# --temperatures 1 --tree 3,1,4,0 etc.). Sampled acceptance is a coin flip step to step, so the
# averages remember longer (SAMPLED_MEMORY) than greedy's: with greedy's memory one short run of
# rejections sent the policy to plain decoding for a probe interval.
SAMPLED_SHAPES = (SpecParams(3, 1, 4, 0.0), SpecParams(7, 1, 8, 0.0), SpecParams(2, 3, 4, 0.1, suffix_tokens=4))
SAMPLED_MEMORY = 0.97
# a target without a draft: suffix-only blocks or plain decoding, for greedy and sampled requests;
# a block starts at half DRAFTLESS_SUFFIX_TOKENS and grows to 4x it while a copy runs
# (SpecDecoder.suffix_only_budget), and needs a match of DRAFTLESS_MIN_MATCH tokens (the pair that
# did best on the copy workload for both benchmarked targets, docs/benchmarks.md)
DRAFTLESS_SUFFIX_TOKENS = 8
DRAFTLESS_MIN_MATCH = 4
SAMPLED_PROBE_STEPS = 4
# sampled requests offer suffix-only blocks at a match of 8+ tokens only: a short match's block is
# accepted node by node with the target's probability of each guess, and its classes' first tries
# and probes cost more than they won (MT-bench T=1: 0.97x plain with them, 2026-12-04)
SAMPLED_MIN_MATCH = 8
# a suffix-only block's averages are kept per class of the match it continues (shorter than 4
# tokens, 4-7, 8 and more): a long match is a copy or a loop under way, whose blocks accept many
# tokens, a short one a guess (SpecDecoder sizes its block by the class). With one average over all,
# the short matches' guesses put the arm below plain decoding: on 40 greedy MT-bench answers (the
# default codes) it was offered at ~1,660 steps with a match of 8+ and taken at 68. The short
# classes learn from the blocks not taken too (observe_shadow): with probes alone a class that
# failed its first try was left for a probe interval, and blocks were taken at 170 of 4,393 steps
# with a match of 2-7 tokens where they paid.
SUFFIX_MATCH_CLASSES = (4, 8)
# a suffix-only block's nodes after a match of each class but the last (<4, 4-7; SpecDecoder's
# growth rule at 8+). Replayed on the 80 greedy MT-bench answers with the decoder's step costs as
# measured on the codes (studies/suffix-budget), 3 / 6 nodes there and the growth rule at 8+ gave
# 1.29x plain, the growth rule at every match 1.17x and blocks at 8+ only 1.17x.
SHORT_MATCH_NODES = (3, 6)
if len(SHORT_MATCH_NODES) != len(SUFFIX_MATCH_CLASSES):
    raise ContractError("SHORT_MATCH_NODES", len(SHORT_MATCH_NODES), len(SUFFIX_MATCH_CLASSES),
                        "give one block size per match class below the last (SUFFIX_MATCH_CLASSES)")


def match_class(match: int) -> int:
    """The class of a suffix match `match` tokens long: 0 below SUFFIX_MATCH_CLASSES[0], ..."""
    return sum(match >= c for c in SUFFIX_MATCH_CLASSES)

SPEC_MARGIN = 0.03        # a speculative arm is taken over plain decoding only when its predicted
                          # tokens per ms beat plain's by this share: within noise of plain, a
                          # drafting step's variance and catch-ups cost more than the gain
CATCH_UP_PRIOR_ROWS = 64  # the draft's catch-up predicted before any was seen (decoder.CATCH_UP_WINDOW)
DRAFT_MEASURE_STEPS = 32  # the draft's own steps a server needs to judge it (monitor.DraftWatch);
DRAFT_PROBE_FIRST = 4     # until it has them, a drafted step at least every this many steps ...
DRAFT_PROBE_EVERY = 512   # ... then at least this often, whatever the averages say: a server's
                          # draft's own acceptance stays measured (/health, eagle3 doctor --server),
                          # so a draft gone bad (random or lost weights) is seen, not hidden behind
                          # plain steps. Only a server asks it (serve.app.measure_draft): nothing
                          # reads it elsewhere, and at T=1 each forced step costs 2-3 plain ones
PROBE_SHARE = 0.01        # a probe's predicted loss may cost at most this share of the time between
MAX_QUIET_EVERY = 2048    # ... probes, which still come at least this often (in steps)
SAMPLED_PROBE_SHARE = 0.0025   # ... for sampled requests, where plain decoding wins ~96% of the
                               # steps: at 1% the probes and their catch-ups were ~1% of the time
                               # (MT-bench T=1: 0.98x plain; 2.6% of the time in probe steps)
PLAIN_RUN_STEPS = 64      # a plain stretch the decoder runs without asking (plain_run) ...
PLAIN_RUN_MARGIN = 1.1    # ... where plain beats every shape by this much
STRETCH_STEP = Step([0], 0)   # what observe reads of a plain stretch's step (plain's averages are fixed)
BOUND_AFTER = 3           # an arm's time averages hold a step's sample in bounds after this many


def draft_interval(drafted: int, every: int = DRAFT_PROBE_EVERY, measure: int = 0) -> int:
    """The most steps between drafted steps after `drafted` of them: DRAFT_PROBE_FIRST until the
    draft has `measure` own steps (the server asks DRAFT_MEASURE_STEPS, so that it judges its
    draft within its first few hundred steps, at the price of ~32 steps that may lose, once),
    then `every`."""
    return min(DRAFT_PROBE_FIRST, every) if drafted < measure else every


@dataclass
class RollingMean:
    """A rolling mean: the plain mean of the first ~1/(1 - memory) values, then an exponential
    average with weight `memory` on the past. So the first value is not blended with a zero prior,
    and one lucky or unlucky early step weighs 1/n, like every other, instead of ~memory."""
    memory: float
    value: float = 0.0
    count: int = 0

    def add(self, x: float) -> None:
        self.count += 1
        self.value += (x - self.value) * max(1.0 / self.count, 1.0 - self.memory)

    def add_bounded(self, x: float, factor: float = 2.0, floor: float = 0.0) -> None:
        """add(x), x first held within [value / factor, value * factor + floor] once a few values
        are in: one step held up by something else (a garbage-collector pass, the OS) moves the
        average by at most (factor - 1) x (1 - memory), while a lasting change is followed within
        a few steps. Unbounded, one stalled plain step made plain decoding look several times dearer
        to the policy, which then drafted where drafting lost for the rest of the run."""
        if self.count >= BOUND_AFTER:
            x = min(max(x, self.value / factor), self.value * factor + floor)
        self.add(x)


@dataclass
class ArmStats:
    memory: float
    steps: int = 0
    last_step: int = -1
    shadows: int = 0           # untaken suffix-only blocks judged by the greedy tokens (observe_shadow)

    def __post_init__(self):
        self.tokens, self.rows, self.levels, self.ratio = (RollingMean(self.memory) for _ in range(4))

    @property
    def correction(self) -> float:
        """Observed wall time / the table's prediction (1.0 before the first step)."""
        return self.ratio.value if self.ratio.count else 1.0


@dataclass
class AdaptivePolicy:
    shapes: tuple[SpecParams, ...]
    costs: object                              # runtime.costs.CostTable
    memory: float = 0.9
    probe_every: int = 16                      # 0: never probe
    max_probe_every: int = 128
    allow_plain: bool = True
    correct_costs: bool = True                 # False: cost = the table's, uncorrected
    suffix_only_tokens: Optional[int] = None   # a suffix-only block's base size (None: the largest
                                               # shape's verify block - 1; 0: no arm)
    suffix_only_min_match: int = 2             # a suffix-only block needs a match this long
    probe_steps: int = 1                       # steps an arm runs when first tried or probed
    probe_share: float = PROBE_SHARE           # 0: probe intervals ignore what a probe loses
    max_quiet_every: int = MAX_QUIET_EVERY
    draft_probe_every: int = 0                 # a drafted step at least this often (0: none forced)
    measure_steps: int = 0                     # drafted steps taken densely first (draft_interval)
    spec_margin: float = SPEC_MARGIN           # a speculative arm must beat plain by this share
    stats: dict = field(default_factory=dict)  # arm -> ArmStats
    chosen: Counter = field(default_factory=Counter)
    steps: int = 0

    def __post_init__(self):
        if not self.shapes and not self.suffix_only_tokens:
            raise InputError("AdaptivePolicy needs a tree shape or suffix-only blocks; pass "
                             "shapes=DEFAULT_SHAPES, or suffix_only_tokens > 0 for a target without a draft")
        if not 0.0 <= self.memory < 1.0:
            raise InputError(f"AdaptivePolicy memory must be in [0, 1), got {self.memory}")
        if self.probe_every and self.max_probe_every < self.probe_every:
            raise InputError(f"AdaptivePolicy max_probe_every ({self.max_probe_every}) is below "
                             f"probe_every ({self.probe_every}); raise max_probe_every")
        self.suffix_only_tokens = self._suffix_budget(self.suffix_only_tokens)
        self.stats = {arm: ArmStats(self.memory) for arm in (*self.shapes, PLAIN, SUFFIX_ONLY)}
        # SUFFIX_ONLY's stats are those of the match class of the step (choose's suffix_match)
        self.suffix_classes = [self.stats[SUFFIX_ONLY]] + [ArmStats(self.memory) for _ in SUFFIX_MATCH_CLASSES]
        self.overhead = RollingMean(self.memory)
        self.catch_ups = Counter()             # returns to drafting: count, rows, ms (not any arm's)
        self.catch_up = RollingMean(self.memory)   # ... and the ms of one (a shape's probe pays it)
        self.spent = Counter()                 # ms by kind: plain, suffix, tree, chain, probe, catch-up
        self.probing = False                   # the step chosen last is a first try or a probe
        self.interval = self.probe_every       # steps from the last probe to the next one
        self.next_probe = self.probe_every - 1
        self.leader: Optional[Arm] = None      # the best of the shapes and plain at the last choice
        self.run: tuple[Optional[Arm], int] = (None, 0)   # a probe under way: its arm, steps left
        self.rates: dict = {}                  # arm -> rate, until a step changes what it reads
        self.draft_probes = 0                  # drafted steps forced by draft_probe_every
        self._shapes_tried = False             # every shape has had probe_steps steps
        self.unsettled: list[tuple[float, bool]] = []   # plain stretch steps not yet observed
        if self.probe_steps < 1:
            raise InputError(f"AdaptivePolicy probe_steps must be >= 1, got {self.probe_steps}")
        if not 0.0 <= self.probe_share < 1.0:
            raise InputError(f"AdaptivePolicy probe_share must be in [0, 1), got {self.probe_share}")

    def _suffix_budget(self, tokens: Optional[int]) -> int:
        """A suffix-only block must fit the cache slack the shapes size (Engine, SpecDecoder); without
        shapes (no draft) it sizes the slack itself."""
        if not self.shapes:
            return tokens
        most = max(s.max_tree_size for s in self.shapes) - 1
        if tokens is None:
            return most
        if not 0 <= tokens <= most:
            raise InputError(f"AdaptivePolicy suffix_only_tokens={tokens} does not fit the largest "
                             f"verify block of the shapes ({most} nodes after the root); use 0..{most}")
        return tokens

    @property
    def overhead_ms(self) -> float:
        return self.overhead.value

    # ------------------------------------------------------------------ choice
    def arms(self, suffix_ready: bool = False) -> list[Arm]:
        """The arms offered at a step; suffix_ready: the suffix index has a match at this step."""
        suffix = [SUFFIX_ONLY] if suffix_ready and self.suffix_only_tokens else []
        return list(self.shapes) + suffix + ([PLAIN] if self.allow_plain else [])

    def choose(self, suffix_ready: bool = False, suffix_match: int = 0) -> Arm:
        """The arm of this step; suffix_match: the length of the match the suffix index continues
        (its class picks the suffix-only averages the step reads and updates)."""
        self._settle()
        if not suffix_ready and self._plain_holds():
            self.probing = False
            return PLAIN
        if suffix_ready:
            self._suffix_class(suffix_match)
        arms = self.arms(suffix_ready)
        self.probing = True
        untried = self._untried(arms)
        if untried is not None:
            return untried
        arm, left = self.run
        if left and arm in arms:                   # a probe runs probe_steps steps
            self.run = (arm, left - 1)
            return arm
        self.run = (None, 0)
        if self.draft_due:                         # the draft's own acceptance stays measured
            shape = min(self.shapes, key=lambda a: self.stats[a].last_step)
            self.draft_probes += 1
            return shape
        goodput = {a: self.goodput(a) for a in arms}
        best = max(arms, key=goodput.__getitem__)
        self._follow(best if not suffix_ready else
                     max((a for a in arms if a != SUFFIX_ONLY), key=goodput.__getitem__))
        others = [a for a in arms if a != best]
        if self.probe_due and others:
            probe = min(others, key=lambda a: self.stats[a].last_step)
            self.interval = min(2 * self.interval, self.max_probe_every)
            self.next_probe = self.steps + max(self.interval, self.quiet_steps(probe, best))
            self.run = (probe, self.probe_steps - 1)
            return probe
        self.probing = False
        return best

    def plain_run(self, window: int) -> int:
        """Steps from now that are plain whatever they cost, as long as the suffix index offers
        no block: plain leads every shape by PLAIN_RUN_MARGIN, and no probe or drafted step is
        due within them and `window` more steps (the decoder captures the draft's rows over
        those). At most PLAIN_RUN_STEPS. The decoder runs them without asking (`SpecDecoder`'s
        plain stretch) and reports each with `observe`, as any step."""
        self._settle()
        if not self._plain_holds(PLAIN_RUN_MARGIN):
            return 0
        return max(min(PLAIN_RUN_STEPS, self._next_drafted_in() - window), 0)

    def _plain_holds(self, margin: float = 1.0) -> bool:
        """The choice below is PLAIN again, decided from what a plain step can change (plain's
        own rate, the step count): plain led, nothing is untried, no probe run or drafted step is
        due, and plain still beats every shape (on a tie the shape wins, as in max). Most steps of
        a plain stretch end here, at a fraction of the full choice's cost."""
        if self.leader != PLAIN or not self._shapes_tried or self.probe_due or self.draft_due:
            return False
        plain = self.rate(PLAIN)
        return all(plain > margin * self.goodput(a) for a in self.shapes)

    def _untried(self, arms: list[Arm]) -> Optional[Arm]:
        """The first arm offered with fewer than probe_steps steps (taken or judged), or None.
        Steps only accumulate, so once every shape is tried only SUFFIX_ONLY (whose averages
        follow the match class) is looked at."""
        for a in arms:
            if a == PLAIN or (a != SUFFIX_ONLY and self._shapes_tried):
                continue
            if self.stats[a].steps + self.stats[a].shadows < self.probe_steps:
                return a
        self._shapes_tried = True
        return None

    def goodput(self, arm: Arm) -> float:
        """What the choice compares: an arm's predicted tokens per ms, a speculative arm's less
        SPEC_MARGIN where plain decoding may be chosen (so it is taken only where it beats plain
        by that margin; the rolling averages keep one lucky step from switching)."""
        rate = self.rate(arm)
        return rate if arm == PLAIN or not self.allow_plain else rate / (1.0 + self.spec_margin)

    def quiet_steps(self, probe: Arm, best: Arm) -> int:
        """Steps of `best` over which a probe of `probe` loses at most probe_share of the time (at
        most max_quiet_every; 0 without probe_share)."""
        if not self.probe_share:
            return 0
        steps = self.probe_loss_ms(probe, best) / (self.probe_share * self.cost_ms(best))
        return int(min(steps, self.max_quiet_every))

    def probe_loss_ms(self, probe: Arm, best: Arm) -> float:
        """What a probe of `probe` is predicted to cost past `best`: its probe_steps steps' time
        minus the time `best` takes for as many tokens (never below 0). The draft's catch-up before
        a shape's probe is left out: it runs over the rows since the last drafting step, so it
        grows with the interval and is the same share of the time whatever the interval."""
        per_step = self.cost_ms(probe) - self.tokens(probe) / self.rate(best)
        return max(self.probe_steps * per_step, 0.0) + (self.catch_up_ms if isinstance(probe, SpecParams) else 0.0)

    @property
    def catch_up_ms(self) -> float:
        """Predicted ms of the draft's catch-up before a shape's step after plain or suffix-only
        steps (its rolling average; before any, CATCH_UP_PRIOR_ROWS rows by the table)."""
        return self.catch_up.value if self.catch_up.count else self.costs.draft(CATCH_UP_PRIOR_ROWS)

    def _suffix_class(self, match: int) -> None:
        """Read and update the suffix-only averages of the class of a `match` tokens long."""
        stats = self.suffix_classes[match_class(match)]
        if self.stats[SUFFIX_ONLY] is not stats:
            self.stats[SUFFIX_ONLY] = stats
            self.rates.pop(SUFFIX_ONLY, None)

    def _follow(self, best: Arm) -> None:
        """Probe at the base interval again when the leading arm changed. The leader is taken
        among the arms offered at every step: SUFFIX_ONLY comes and goes with the matches."""
        if best != self.leader:
            self.leader, self.interval = best, self.probe_every
            self.next_probe = min(self.next_probe, self.steps + self.probe_every)

    def rate(self, arm: Arm) -> float:
        """Predicted tokens per ms of `arm` (kept until a step of that arm, or a drafting step's
        overhead, changes it: a plain step then recomputes one rate, not every arm's, which counts
        on the fastest plain steps)."""
        rate = self.rates.get(arm)
        if rate is None:
            rate = self.rates[arm] = self.tokens(arm) / self.cost_ms(arm)
        return rate

    def tokens(self, arm: Arm) -> float:
        """Tokens a step of `arm` emits on average (a plain step: 1 exactly)."""
        return 1.0 if arm == PLAIN else self.stats[arm].tokens.value

    def cost_ms(self, arm: Arm) -> float:
        """Predicted ms of a step of `arm`: the table's, times the arm's observed correction."""
        s = self.stats[arm]
        correction = s.correction if self.correct_costs else 1.0
        return self.table_ms(arm, s.rows.value, s.levels.value) * correction

    def table_ms(self, arm: Arm, rows: float, levels: float) -> float:
        """The cost table's ms of a step of `arm` verifying `rows` rows after `levels` draft forwards."""
        if arm == PLAIN:
            return self.costs.target(1)
        return self._forwards_ms(arm, rows, levels) + self.overhead_ms

    def step_cost_ms(self, arm: Arm, rows: float, levels: float, caught_up_rows: int = 0) -> float:
        """The predicted ms of a step as run (the table's, times the arm's observed correction),
        with the draft's catch-up over `caught_up_rows` rows first: what the thread governor weighs
        the step's wall time by. With the table's alone, a tree step (which costs ~1.5x its table
        ms inside decoding, the plain step less) read as a slowdown of two threads: a one-thread
        probe then won, and decoding ran on one thread for a while (MT-bench T=1: 0.97x plain
        with the governor, 1.00x without it)."""
        correction = self.stats[arm].correction if self.correct_costs else 1.0
        return (self.table_ms(arm, rows, levels) * correction
                + (self.costs.draft(caught_up_rows) if caught_up_rows else 0.0))

    def _forwards_ms(self, arm: Arm, rows: float, levels: float) -> float:
        draft = levels * self.costs.draft(arm.top_k) if isinstance(arm, SpecParams) else 0.0
        return self.costs.target(rows) + draft

    def _next_drafted_in(self) -> float:
        """Steps from now to the next probe or forced drafted step, whichever comes first (inf:
        neither is scheduled)."""
        ahead = self.next_probe - self.steps if self.probe_every else math.inf
        forced = self._forced_in()
        return ahead if forced is None else min(ahead, forced)

    def _forced_in(self) -> Optional[int]:
        """Steps from now to the next forced drafted step (<= 0: due; None: none forced)."""
        every = self.draft_every
        if not every:
            return None
        last = max(self.stats[a].last_step for a in self.shapes)
        return every - (self.steps - max(last, 0))

    @property
    def draft_every(self) -> int:
        """The most steps between drafted steps now (0: none forced): draft_interval of the
        drafted steps so far."""
        if not self.shapes or not self.draft_probe_every:
            return 0
        return draft_interval(sum(self.stats[a].steps for a in self.shapes), self.draft_probe_every,
                              self.measure_steps)

    @property
    def draft_due(self) -> bool:
        """No drafted step in the last draft_every steps (a policy with shapes)."""
        forced = self._forced_in()
        return forced is not None and forced <= 0

    def draft_within(self, steps: int) -> bool:
        """Whether a drafted step may come within `steps` steps: a shape leads or is untried, a
        probe or a forced draft step is due by then. Until then a plain step need not capture the
        target's features for the draft (SpecDecoder.plain_step): the draft restarts from the
        rows captured since (at most decoder.CATCH_UP_WINDOW of them would be read anyway)."""
        self._settle()
        if not self.shapes:
            return False
        if self.leader is None or self.leader != PLAIN or self.run[1] > 0:
            return True
        if any(self.stats[a].steps < self.probe_steps for a in self.shapes):
            return True
        return self._next_drafted_in() <= steps

    # ------------------------------------------------------------------ feedback
    @property
    def probe_due(self) -> bool:
        """The next choice may be a probe (the thread governor then holds its own)."""
        return self.run[1] > 0 or (bool(self.probe_every) and self.steps >= self.next_probe)

    def observe(self, arm: Arm, step: Step, levels: int, wall_ms: float, timed: bool = True) -> None:
        """One step taken with `arm`: its Step, the draft forwards it ran, its wall time. timed=False:
        the step ran on a thread count the governor was probing, so its time is not the arm's (its
        tokens, rows and levels still count)."""
        check_wall_ms(wall_ms)
        self._settle()
        self._observe(arm, step, levels, wall_ms, timed)

    def observe_stretch(self, wall_ms: float, timed: bool = True) -> None:
        """A step of a plain stretch (SpecDecoder's, which plain_run granted): kept as its time
        until the next call that reads or moves the averages (`_settle`), which observes the
        stretch's steps in one pass. Observed one at a time, between two target forwards that
        leave the policy's objects out of the CPU caches, each cost ~10 us (0.2% of a step)."""
        check_wall_ms(wall_ms)
        self.unsettled.append((wall_ms, timed))

    def _settle(self) -> None:
        if self.unsettled:
            steps, self.unsettled = self.unsettled, []
            for wall_ms, timed in steps:
                self._observe(PLAIN, STRETCH_STEP, 0, wall_ms, timed)

    def _observe(self, arm: Arm, step: Step, levels: int, wall_ms: float, timed: bool) -> None:
        self.chosen[name_of(arm)] += 1
        self.spent["probe" if self.probing else kind_of(arm)] += wall_ms
        self.steps += 1
        self.rates.pop(arm, None)
        s = self.stats[arm]
        rows = step.proposed + 1
        if arm != PLAIN or not s.steps:             # a plain step: 1 token, 1 row, no level, always
            s.tokens.add(len(step.tokens))
            s.rows.add(rows)
            s.levels.add(levels)
        s.steps += 1
        s.last_step = self.steps
        if not timed:
            return
        if isinstance(arm, SpecParams):                    # the drafting steps' bookkeeping
            self.overhead.add_bounded(max(wall_ms - self._forwards_ms(arm, rows, levels), 0.0), floor=1.0)
            self.rates = {PLAIN: self.rates[PLAIN]} if PLAIN in self.rates else {}   # all read it
        s.ratio.add_bounded(wall_ms / self.table_ms(arm, rows, levels))

    def observe_shadow(self, match: int, tokens: int, rows: int) -> None:
        """A suffix-only block not taken at a greedy step, judged by the tokens emitted after it
        (the target's own choice decides acceptance, whatever arm emitted them): it would have
        emitted `tokens` verifying `rows` rows. It moves its match class's tokens and rows averages
        as a taken block does, not the cost correction (no time was spent), so a class where
        blocks pay is found from the plain steps themselves, without probes."""
        self._settle()
        stats = self.suffix_classes[match_class(match)]
        stats.tokens.add(tokens)
        stats.rows.add(rows)
        stats.shadows += 1
        if self.stats[SUFFIX_ONLY] is stats:
            self.rates.pop(SUFFIX_ONLY, None)

    def observe_catch_up(self, rows: int, ms: float) -> None:
        """A drafting step first ran the draft over `rows` rows that plain or suffix-only steps left
        waiting: the price of returning to drafting (the step's wall time and levels passed to
        `observe` exclude it), kept apart for the summary."""
        self._settle()
        self.catch_ups.update(count=1, rows=rows, ms=ms)
        self.catch_up.add(ms)
        self.spent["catch-up"] += ms

    def summary(self) -> dict:
        """How the choices spread (arm name -> steps), each arm's averages and cost correction."""
        self._settle()
        return {"chosen": dict(self.chosen), "overhead_ms": round(self.overhead_ms, 3),
                "spent_ms": {k: round(v, 1) for k, v in self.spent.items()},
                "draft_probes": self.draft_probes,
                "catch_up": {k: round(v, 1) for k, v in self.catch_ups.items()},
                "probe_every": self.interval,
                "arms": {name_of(a): _averages(st, levels=True)
                         for a, st in self.stats.items() if st.steps and a != SUFFIX_ONLY},
                "suffix_by_match": {label: _averages(st)
                                    for label, st in zip(suffix_class_labels(), self.suffix_classes)
                                    if st.steps or st.shadows}}


def check_wall_ms(wall_ms: float) -> None:
    if wall_ms <= 0:
        raise InputError(f"AdaptivePolicy.observe wall_ms must be > 0, got {wall_ms}; pass the "
                         f"step's measured wall time in ms")


def _averages(st: ArmStats, levels: bool = False) -> dict:
    """An arm's averages as the summary reports them (a suffix-only class runs no draft levels)."""
    out = {"tokens": round(st.tokens.value, 3), "rows": round(st.rows.value, 2)}
    if levels:
        out["levels"] = round(st.levels.value, 2)
    out = {**out, "correction": round(st.correction, 3), "steps": st.steps}
    return {**out, "shadows": st.shadows} if st.shadows else out


def suffix_class_labels() -> list[str]:
    """The match classes' names ("<4", "4-7", "8+")."""
    bounds = SUFFIX_MATCH_CLASSES
    return ([f"<{bounds[0]}"] + [f"{a}-{b - 1}" for a, b in zip(bounds, bounds[1:])] + [f"{bounds[-1]}+"])


def kind_of(arm: Arm) -> str:
    """An arm's kind in the time accounting: plain, suffix, tree or chain."""
    if arm in (PLAIN, SUFFIX_ONLY):
        return arm
    return "chain" if arm.is_chain else "tree"


def name_of(arm: Arm) -> str:
    if arm in (PLAIN, SUFFIX_ONLY):
        return arm
    s: SpecParams = arm
    base = f"chain{s.depth}" if s.is_chain else f"tree{s.top_k}x{s.depth}n{s.num_draft_tokens}"
    return base + (f"p{s.min_prob:g}" if s.min_prob else "") + (f"s{s.suffix_tokens}" if s.suffix_tokens else "")
