"""The adaptive step's policy (pure: a cost table and steps in, a choice out) and the cost table."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

import pytest

from eagle3.runtime.costs import QUIET_SHARE, CostTable, machine_costs
from eagle3.errors import InputError
from eagle3.speculative.policy import CATCH_UP_PRIOR_ROWS, PLAIN, SUFFIX_ONLY, AdaptivePolicy, name_of
from eagle3.speculative.step import Step
from eagle3.speculative.tree import SpecParams

ROWS = (1, 2, 4, 8, 16)
TABLE = CostTable(ROWS, (10.0, 10.5, 11.0, 13.0, 19.0), (1.0, 1.0, 1.1, 1.3, 1.8))
TREE, CHAIN = SpecParams(4, 5, 8, 0.0), SpecParams.chain(3)


def feed(policy, arm, accepted: int, proposed: int, levels: int, wall_ms: float | None = None):
    """One step of `arm`; wall_ms None: the time the policy's own table gives (a truthful clock)."""
    if wall_ms is None:
        wall_ms = clock(policy.costs, arm, proposed + 1, levels)
    policy.observe(arm, Step([0] * (accepted + 1), accepted, proposed=proposed), levels, wall_ms)


def clock(costs: CostTable, arm, rows: int, levels: int) -> float:
    """What a step of `arm` takes on a machine whose forwards cost what `costs` says (no overhead)."""
    if arm == PLAIN:
        return costs.target(1)
    draft = levels * costs.draft(arm.top_k) if isinstance(arm, SpecParams) else 0.0
    return costs.target(rows) + draft


def test_cost_table_interpolates_and_extrapolates():
    assert TABLE.target(1) == 10.0 and TABLE.target(3) == pytest.approx(10.75)
    assert TABLE.target(24) == pytest.approx(25.0)           # slope over the upper half (8 -> 16)
    # a last pair measured nearly flat (noise) does not make rows past the table look free
    noisy = CostTable((1, 2, 4, 8, 12, 16), (10.0, 10.5, 11.0, 13.0, 16.0, 16.1), ())
    assert noisy.target(24) == pytest.approx(16.1 + (16.1 - 13.0) / 8 * 8)
    assert TABLE.draft(4) == pytest.approx(1.1)
    assert CostTable.from_json(TABLE.to_json()) == TABLE


def test_untried_shapes_go_first_then_the_best_rate():
    p = AdaptivePolicy((TREE, CHAIN), TABLE, probe_every=0)
    assert p.choose() == TREE
    feed(p, TREE, accepted=2, proposed=7, levels=4)            # 3 tokens / (13 + 4 * 1.1) ms
    assert p.choose() == CHAIN
    feed(p, CHAIN, accepted=0, proposed=3, levels=2)           # 1 token / (11 + 2 * 1.0) ms
    assert p.choose() == TREE
    assert p.rate(TREE) == pytest.approx(3 / (13 + 4 * 1.1))


def test_falls_back_to_plain_when_nothing_is_accepted_and_probes_again():
    p = AdaptivePolicy((TREE,), TABLE, memory=0.5, probe_every=8, max_probe_every=8, probe_share=0)
    choices = []
    for _ in range(16):
        arm = p.choose()
        choices.append(arm)
        if arm == PLAIN:
            feed(p, PLAIN, 0, 0, 0)
        else:
            feed(p, TREE, accepted=0, proposed=7, levels=5)
    assert choices[0] == TREE and choices[1] == PLAIN         # one step shows the draft does not pay
    assert choices[7] == TREE and choices[15] == TREE         # probed every 8 steps
    assert choices.count(PLAIN) == 13
    assert p.summary()["chosen"] == {"tree4x5n8": 3, PLAIN: 13}


def test_plain_is_never_chosen_when_not_allowed_and_a_good_draft_stays():
    p = AdaptivePolicy((TREE,), TABLE, probe_every=0, allow_plain=False)
    feed(p, TREE, accepted=0, proposed=7, levels=5)
    assert p.choose() == TREE
    q = AdaptivePolicy((TREE,), TABLE, probe_every=0)
    for _ in range(5):
        feed(q, q.choose(), accepted=3, proposed=7, levels=4)
    assert q.choose() == TREE and q.chosen["tree4x5n8"] == 5


def test_overhead_is_the_average_wall_time_past_the_forwards():
    p = AdaptivePolicy((TREE,), TABLE, probe_every=0)
    feed(p, TREE, accepted=1, proposed=3, levels=2, wall_ms=11.0 + 2 * 1.1 + 3.0)   # 4 rows
    feed(p, TREE, accepted=1, proposed=3, levels=2, wall_ms=11.0 + 2 * 1.1 + 1.0)
    assert p.overhead_ms == pytest.approx(2.0)
    assert name_of(SpecParams(4, 5, 8, 0.05)) == "tree4x5n8p0.05" and name_of(CHAIN) == "chain3"


def test_machine_costs_are_cached_per_key(tmp_path, monkeypatch):
    from spec_helpers import tiny_draft, tiny_target
    monkeypatch.setenv("EAGLE3_CACHE", str(tmp_path))
    target = tiny_target(layers=2)
    draft = tiny_draft(target)
    table = machine_costs(target, draft, reps=1)
    assert len(table.target_ms) == len(table.rows) and len(table.draft_ms) == len(table.rows)
    assert all(ms > 0 for ms in table.target_ms + table.draft_ms)
    files = list((tmp_path / "costs").glob("*.json"))
    assert len(files) == 1
    # the cache is read (a 1-row cost far below any forward now: never taken for a busy moment's,
    # which a single timed forward of reps=1 could look like)
    marked = CostTable(table.rows, (1e-3,) * len(table.rows), (2.0,) * len(table.rows))
    files[0].write_text(marked.to_json())
    assert machine_costs(target, draft).draft(1) == 2.0
    assert machine_costs(target, draft, remeasure=True, reps=1).draft(1) != 2.0


@contextlib.contextmanager
def cores_taken(seconds: float = 60.0):
    """Half of this machine's cores spinning in other processes (each stops by itself)."""
    spin = f"import time\nt = time.time()\nwhile time.time() - t < {seconds}: pass"
    procs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(max(1, (os.cpu_count() or 2) // 2))]
    time.sleep(0.3)
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_table_measured_while_another_process_holds_a_core_does_not_survive_a_quiet_run(tmp_path, monkeypatch):
    from spec_helpers import tiny_draft, tiny_target
    monkeypatch.setenv("EAGLE3_CACHE", str(tmp_path))
    target = tiny_target(layers=2)
    draft = tiny_draft(target)
    reps = 15                       # a window of ~0.5 s: the watch counts 10 ms ticks
    with cores_taken():
        busy = machine_costs(target, draft, reps=reps)
    assert not busy.quiet and busy.others > QUIET_SHARE
    path = next((tmp_path / "costs").glob("*.json"))
    assert not CostTable.from_json(path.read_text()).quiet             # cached, marked as disturbed
    quiet = machine_costs(target, draft, reps=reps)                     # measured again
    assert quiet != busy and CostTable.from_json(path.read_text()) == quiet
    if quiet.quiet:   # (steal time from a busy host counts as others too: not in this test's hands)
        assert machine_costs(target, draft) == quiet                    # and now served from the cache


def test_a_cached_table_far_above_a_quiet_forward_now_is_measured_again(tmp_path, monkeypatch):
    """A table cached as quiet whose 1-row cost is several times what one forward costs now (a
    table from an older version, or a busy moment the watch could not see) is measured anew."""
    from spec_helpers import tiny_target
    monkeypatch.setenv("EAGLE3_CACHE", str(tmp_path))
    target = tiny_target(layers=2)
    table = machine_costs(target, None, reps=3)
    path = next((tmp_path / "costs").glob("*.json"))
    inflated = CostTable(table.rows, tuple(20 * ms + 5.0 for ms in table.target_ms), ())
    path.write_text(inflated.to_json())
    assert machine_costs(target, None).target(1) < inflated.target(1) / 2


def test_averages_start_as_the_mean_then_forget_exponentially():
    p = AdaptivePolicy((TREE,), TABLE, memory=0.9, probe_every=0)   # the mean of the first 10
    seen = [(0, 3, 1), (4, 7, 4), (2, 7, 3)]                          # (accepted, proposed, levels)
    for accepted, proposed, levels in seen:
        feed(p, TREE, accepted, proposed, levels)
    tokens, rows, levels = (sum(x) / 3 for x in zip(*[(a + 1, n + 1, lv) for a, n, lv in seen]))
    assert p.rate(TREE) == pytest.approx(tokens / (TABLE.target(rows) + levels * TABLE.draft(4)))
    q = AdaptivePolicy((TREE,), TABLE, memory=0.9, probe_every=0)
    for _ in range(10):
        feed(q, TREE, accepted=1, proposed=7, levels=3)
    feed(q, TREE, accepted=6, proposed=7, levels=3)                   # the 11th weighs 1 - memory
    assert q.rate(TREE) == pytest.approx((0.9 * 2 + 0.1 * 7) / (TABLE.target(8) + 3 * TABLE.draft(4)))


DEAR_TREES = CostTable(ROWS, (10.0, 20.0, 25.0, 30.0, 40.0), (2.0,) * 5)
SLOW_PLAIN = CostTable(ROWS, (25.0,) + TABLE.target_ms[1:], TABLE.draft_ms)   # 1 row 2.5x the table


@pytest.mark.parametrize("table,truth,accepted,want", [
    (TABLE, DEAR_TREES, 1, PLAIN),      # the table says trees pay (2 tokens / 17.4 ms), they do not
    (DEAR_TREES, TABLE, 1, TREE),       # the table says they do not (2 / 38 ms), they do
    (TABLE, SLOW_PLAIN, 0, TREE),       # plain steps take 25 ms, not 10: a 1-token tree pays
], ids=["trees-slower", "trees-faster", "plain-slower"])
def test_the_clock_corrects_a_stale_table(table, truth, accepted, want):
    p = AdaptivePolicy((TREE,), table, probe_every=0)
    choices = []
    for _ in range(12):
        arm = p.choose()
        choices.append(arm)
        acc = accepted if arm != PLAIN else 0
        feed(p, arm, acc, 7 if arm != PLAIN else 0, 4, clock(truth, arm, 8 if arm != PLAIN else 1, 4))
    assert choices[2:] == [want] * 10, [name_of(a) for a in choices]
    for arm, rows in ((TREE, 8), (PLAIN, 1)):       # what each arm costs on the machine, now
        assert p.cost_ms(arm) == pytest.approx(clock(truth, arm, rows, 4))


def test_probes_back_off_while_nothing_changes_and_restart_when_the_choice_changes():
    p = AdaptivePolicy((TREE,), TABLE, probe_every=4, max_probe_every=16, probe_share=0)
    off: list[int] = []                     # steps that did not take the leading arm
    for i in range(90):
        arm = p.choose()
        good = i >= 43                      # from the probe at 43 on, the tree accepts 6 tokens
        if arm != (TREE if i >= 44 else PLAIN):
            off.append(i)
        feed(p, arm, 6 if good and arm == TREE else 0, 7 if arm == TREE else 0, 5)
    # untried, the first probe at probe_every - 1, then 8, 16, 16 steps apart; the tree leads from
    # 44 on: plain is probed 4 steps later, then 8, 16, 16 apart
    assert off == [0, 3, 11, 27, 43, 48, 56, 72, 88]


def test_a_probe_that_loses_much_waits_until_its_loss_is_a_small_share():
    """A probe predicted to lose L ms past the leader comes no sooner than L / (probe_share x the
    leader's step) steps after the last: probes every max_probe_every steps of a shape that never
    paid cost ~3% of the time at T=1 on the GGUF codes. A probe that loses little keeps the
    doubling intervals."""
    def probes(policy, accepted, steps=400):
        out = []
        for i in range(steps):
            arm = policy.choose()
            if arm != PLAIN:
                out.append(i)
            feed(policy, arm, accepted if arm == TREE else 0, 7 if arm == TREE else 0, 5 if arm == TREE else 0)
        return out

    # the tree accepts nothing: 1 token in 13 + 5 x 1.1 = 18.5 ms against plain's 10 ms a token
    lossy = AdaptivePolicy((TREE,), TABLE, probe_every=4, max_probe_every=16, probe_share=0.02)
    seen = probes(lossy, accepted=0)
    # ... and before it, the draft's catch-up over the rows plain steps left (the table's, before
    # any was seen; CATCH_UP_PRIOR_ROWS rows: 64, extrapolated to 4.8 ms)
    assert lossy.catch_up_ms == pytest.approx(TABLE.draft(CATCH_UP_PRIOR_ROWS)) == pytest.approx(4.8)
    assert lossy.probe_loss_ms(TREE, PLAIN) == pytest.approx(8.5 + 4.8)
    assert lossy.quiet_steps(TREE, PLAIN) == int(13.3 / (0.02 * 10.0))         # 66 steps
    gaps = [b - a for a, b in zip(seen, seen[1:])]
    assert seen[:2] == [0, 3] and all(g >= 66 for g in gaps[1:]), seen
    # the whole loss stays near probe_share of the time: 13.3 ms a probe over >= 66 plain steps
    assert len(seen) <= 2 + 400 // 66
    lossy.observe_catch_up(rows=40, ms=2.0)          # a measured catch-up replaces the prior
    assert lossy.probe_loss_ms(TREE, PLAIN) == pytest.approx(8.5 + 2.0)
    doubling = probes(AdaptivePolicy((TREE,), TABLE, probe_every=4, max_probe_every=16, probe_share=0), 0)
    assert len(doubling) > 2 * len(seen)
    # the tree leads (2 tokens in 18.5 ms); a probe of plain loses 10 - 18.5 / 2 = 0.75 ms, which
    # waits 0.75 / (0.02 x 18.5) = 2 steps: within the doubling intervals, so they stand
    def plain_probes(share):
        drafted = set(probes(AdaptivePolicy((TREE,), TABLE, probe_every=4, max_probe_every=16,
                                            probe_share=share), accepted=1))
        return [i for i in range(400) if i not in drafted]
    assert plain_probes(0.02) == plain_probes(0) and len(plain_probes(0)) > 20
    with pytest.raises(InputError, match="probe_share must be in"):
        AdaptivePolicy((TREE,), TABLE, probe_share=1.0)


def test_suffix_only_is_offered_with_a_match_and_taken_when_its_rate_is_highest():
    p = AdaptivePolicy((TREE,), TABLE, probe_every=0)
    assert p.suffix_only_tokens == TREE.max_tree_size - 1          # the largest block the caches hold
    feed(p, p.choose(), accepted=1, proposed=7, levels=4)          # 2 tokens / 17.4 ms
    assert p.choose(suffix_ready=True) == SUFFIX_ONLY              # untried, and a match this step
    feed(p, SUFFIX_ONLY, accepted=4, proposed=7, levels=0)         # 5 tokens / 13 ms: no draft levels
    assert p.rate(SUFFIX_ONLY) == pytest.approx(5 / TABLE.target(8))
    assert p.choose(suffix_ready=True) == SUFFIX_ONLY
    assert p.choose(suffix_ready=False) == TREE                    # no match: not offered
    for _ in range(3):
        feed(p, SUFFIX_ONLY, accepted=0, proposed=7, levels=0)     # mean 2 tokens / 13 ms: still best
    assert p.choose(suffix_ready=True) == SUFFIX_ONLY
    for _ in range(5):
        feed(p, SUFFIX_ONLY, accepted=0, proposed=7, levels=0)     # mean 13/9 / 13 ms < 2 / 17.4
    assert p.choose(suffix_ready=True) == TREE
    assert p.summary()["chosen"] == {"tree4x5n8": 1, "suffix": 9}
    assert name_of(SUFFIX_ONLY) == "suffix"


def test_suffix_only_averages_are_kept_per_match_class():
    """A long match is a copy or a loop under way, a short one a guess: a suffix-only block's
    averages are kept per class (shorter than 4 tokens, 4-7, 8 and more), so failed guesses after short
    matches neither keep them coming nor put the copies' blocks below plain decoding."""
    p = AdaptivePolicy((TREE,), TABLE, probe_every=0)
    feed(p, p.choose(), accepted=0, proposed=7, levels=4)            # the tree, untried, first
    for _ in range(3):                                               # a copy: 8 tokens a block
        assert p.choose(suffix_ready=True, suffix_match=12) == SUFFIX_ONLY
        feed(p, SUFFIX_ONLY, accepted=7, proposed=7, levels=0)
    short = []
    for _ in range(30):                                              # guesses that fail
        arm = p.choose(suffix_ready=True, suffix_match=2)
        short.append(arm)
        feed(p, arm, 0, 7 if arm == SUFFIX_ONLY else 0, 0)
    assert short[0] == SUFFIX_ONLY and short[1:] == [PLAIN] * 29      # its class tried once
    assert p.choose(suffix_ready=True, suffix_match=9) == SUFFIX_ONLY  # copies still pay
    assert p.summary()["suffix_by_match"] == {
        "<4": {"tokens": 1.0, "rows": 8.0, "correction": 1.0, "steps": 1},
        "8+": {"tokens": 8.0, "rows": 8.0, "correction": 1.0, "steps": 3}}


def test_suffix_only_blocks_fit_the_caches_the_shapes_size():
    assert AdaptivePolicy((TREE,), TABLE, suffix_only_tokens=0).arms(suffix_ready=True) == [TREE, PLAIN]
    with pytest.raises(InputError, match="suffix_only_tokens"):
        AdaptivePolicy((CHAIN,), TABLE, suffix_only_tokens=8)      # 9 rows; chain3 verifies 4


def test_a_rebuilt_kernel_is_costed_anew(monkeypatch):
    """The cost key covers the kernels' build (a changed source measures again) where the layout
    runs them, and only there."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent))
    from spec_helpers import tiny_target
    from eagle3 import kernels
    from eagle3.runtime.backend import choose_backend
    from eagle3.runtime.costs import cost_key
    from eagle3.runtime.target import build_target
    target = build_target(tiny_target(layers=2), backend=choose_backend("cpu", __import__("torch").float32, True))
    if target.backend.kernels is None:
        pytest.skip("no eagle3 kernels on this CPU")
    before = cost_key(target, None)
    state = kernels.state()
    monkeypatch.setattr(kernels, "_STATE", state._replace(build_dir=Path("/x/another-build")))
    assert cost_key(target, None) != before
    from dataclasses import replace
    plain = build_target(tiny_target(layers=2), backend=replace(target.backend, kernels=None))
    key = cost_key(plain, None)
    monkeypatch.setattr(kernels, "_STATE", state)
    assert cost_key(plain, None) == key


def test_sampled_requests_get_the_shallow_shapes_and_a_longer_memory(monkeypatch):
    """api.adaptive_policy's factory: greedy requests choose among DEFAULT_SHAPES, sampled ones among
    SAMPLED_SHAPES (at T=1 a second draft level is rarely accepted) with averages that remember
    longer (acceptance steps are coin flips there); shapes given: those for both."""
    import eagle3.runtime.costs as costs_module
    from eagle3.api import adaptive_policy
    from eagle3.speculative.policy import DEFAULT_SHAPES, DRAFTLESS_SUFFIX_TOKENS, SAMPLED_MEMORY, SAMPLED_SHAPES
    monkeypatch.setattr(costs_module, "machine_costs", lambda *args, **kwargs: TABLE)
    draft = object()
    make = adaptive_policy(None, draft)
    greedy, sampled = make(True), make(False)
    assert greedy.shapes == DEFAULT_SHAPES and greedy.memory == 0.9
    assert sampled.shapes == SAMPLED_SHAPES and sampled.memory == SAMPLED_MEMORY > greedy.memory
    assert max(s.depth for s in SAMPLED_SHAPES) < max(s.depth for s in DEFAULT_SHAPES)
    assert adaptive_policy(None, draft, shapes=(CHAIN,))(False).shapes == (CHAIN,)
    # no draft: no shapes, suffix-only blocks (and the sampled memory for sampled requests)
    draftless = adaptive_policy(None, None)
    assert draftless(True).shapes == () and draftless(True).suffix_only_tokens == DRAFTLESS_SUFFIX_TOKENS
    assert draftless(False).memory == SAMPLED_MEMORY


def test_an_untimed_step_counts_its_tokens_but_not_its_time():
    """A step the thread governor ran on its probed count (timed=False) says nothing of the arm's cost."""
    policy = AdaptivePolicy((TREE,), TABLE)
    feed(policy, TREE, 3, 7, 5)
    ratio, overhead = policy.stats[TREE].correction, policy.overhead_ms
    policy.observe(TREE, Step([0] * 4, 3, proposed=7), 5, 500.0, timed=False)
    assert policy.stats[TREE].correction == ratio and policy.overhead_ms == overhead
    assert policy.stats[TREE].steps == 2 and policy.stats[TREE].tokens.value == 4
    policy.observe(TREE, Step([0] * 4, 3, proposed=7), 5, 500.0)
    assert policy.stats[TREE].correction > ratio


def test_a_probe_runs_probe_steps_steps(monkeypatch):
    """Sampled requests: one step's acceptance is a coin flip, so a first try and each probe run
    probe_steps steps (the factory gives SAMPLED_PROBE_STEPS); the governor sees probe_due all along."""
    import eagle3.runtime.costs as costs_module
    from eagle3.speculative.policy import SAMPLED_PROBE_STEPS
    policy = AdaptivePolicy((TREE, CHAIN), TABLE, probe_steps=4)
    first = []
    for _ in range(8):
        arm = policy.choose()
        first.append(arm)
        feed(policy, arm, 0, 7 if arm == TREE else 3, 5 if arm == TREE else 3)   # nothing accepted
    assert first == [TREE] * 4 + [CHAIN] * 4
    runs = []
    for _ in range(60):
        due = policy.probe_due
        arm = policy.choose()
        runs.append((arm, due))
        feed(policy, arm, 0, 0 if arm == PLAIN else 7 if arm == TREE else 3,
             0 if arm == PLAIN else 5 if arm == TREE else 3)
    probes = [i for i, (arm, _) in enumerate(runs) if arm != PLAIN]
    assert probes and len(probes) % 4 == 0, probes
    assert all(probes[i + 3] == probes[i] + 3 for i in range(0, len(probes), 4)), probes
    assert all(due for arm, due in runs if arm != PLAIN)
    with pytest.raises(InputError, match="probe_steps must be >= 1"):
        AdaptivePolicy((TREE,), TABLE, probe_steps=0)
    from eagle3.api import adaptive_policy
    monkeypatch.setattr(costs_module, "machine_costs", lambda *args, **kwargs: TABLE)
    make = adaptive_policy(None, None)
    assert make(False).probe_steps == SAMPLED_PROBE_STEPS > 1 and make(True).probe_steps == 1


def test_kept_rates_equal_rates_computed_afresh():
    """rate() keeps each arm's value until a step changes what it reads (its own averages, or the
    drafting steps' shared overhead): after any sequence of steps every kept rate is the fresh one."""
    import random
    rng = random.Random(0)
    p = AdaptivePolicy((TREE, CHAIN), TABLE, probe_every=4)
    for i in range(300):
        arm = p.choose(suffix_ready=i % 3 == 0)
        proposed = 0 if arm == PLAIN else rng.randint(2, 12)
        accepted = 0 if arm == PLAIN else rng.randint(0, min(proposed, 5))
        levels = 0 if arm in (PLAIN, SUFFIX_ONLY) else rng.randint(1, 5)
        wall = clock(TABLE, arm, proposed + 1, levels) * rng.uniform(0.7, 1.6) + rng.uniform(0, 2)
        p.observe(arm, Step([0] * (accepted + 1), accepted, proposed=proposed), levels, wall,
                  timed=rng.random() > 0.1)
        kept = {a: p.rate(a) for a in p.arms(suffix_ready=True)}
        p.rates.clear()
        assert kept == {a: p.rate(a) for a in p.arms(suffix_ready=True)}, i


def test_one_step_held_up_barely_moves_an_arms_cost_and_a_lasting_change_is_followed():
    """A 120 ms plain step (a garbage-collector pass; the table says 10 ms) made plain decoding cost
    ~3.7x for the policy, which then drafted where drafting lost, and plain was not tried again for
    hundreds of steps. Now a step's sample is held within 2x of the average (after a few steps)."""
    p = AdaptivePolicy((TREE,), TABLE, probe_every=0)
    for _ in range(20):
        feed(p, PLAIN, 0, 0, 0)
    feed(p, PLAIN, 0, 0, 0, wall_ms=120.0)
    assert p.cost_ms(PLAIN) <= 1.11 * TABLE.target(1)
    for _ in range(15):                            # the machine really is 2x slower now
        feed(p, PLAIN, 0, 0, 0, wall_ms=2 * TABLE.target(1))
    assert p.cost_ms(PLAIN) >= 1.75 * TABLE.target(1)


def test_blocks_not_taken_teach_their_class_without_a_probe():
    """A greedy step's suffix block that was not taken is judged by the tokens emitted next
    (observe_shadow): a class whose blocks would pay is taken at its next match, with no probe due,
    and one whose blocks would fail is left to plain decoding, also untried."""
    p = AdaptivePolicy((TREE,), TABLE, probe_every=0)
    feed(p, p.choose(), accepted=0, proposed=7, levels=4)            # the tree, untried, first
    for _ in range(3):                                               # at a match of 5: 6 tokens
        p.observe_shadow(5, tokens=6, rows=7)
    for _ in range(3):                                               # at a match of 2: 1 token
        p.observe_shadow(2, tokens=1, rows=4)
    assert p.choose(suffix_ready=True, suffix_match=5) == SUFFIX_ONLY
    assert p.choose(suffix_ready=True, suffix_match=2) == PLAIN
    assert p.summary()["suffix_by_match"] == {
        "<4": {"tokens": 1.0, "rows": 4.0, "correction": 1.0, "steps": 0, "shadows": 3},
        "4-7": {"tokens": 6.0, "rows": 7.0, "correction": 1.0, "steps": 0, "shadows": 3}}


def test_a_losing_draft_is_still_asked_every_draft_probe_every_steps():
    """A draft that accepts nothing loses every comparison and its probes wait by their loss (up to
    max_quiet_every); a drafted step still comes every draft_probe_every steps, so the draft's own
    acceptance stays measured (a broken draft is seen on /health), and those steps count as probes."""
    def drafted(policy, steps=3000):
        out = []
        for i in range(steps):
            arm = policy.choose()
            if arm != PLAIN:
                out.append(i)
            feed(policy, arm, 0, 7 if arm == TREE else 0, 5 if arm == TREE else 0)
        return out
    forced = AdaptivePolicy((TREE,), TABLE, probe_every=4, max_probe_every=16, probe_share=0.001,
                            draft_probe_every=200)
    seen = drafted(forced)
    assert max(b - a for a, b in zip(seen, seen[1:])) <= 200 + 1 and forced.draft_probes >= 10
    assert forced.spent["probe"] >= forced.spent["tree"]
    free = drafted(AdaptivePolicy((TREE,), TABLE, probe_every=4, max_probe_every=16, probe_share=0.001,
                                  draft_probe_every=0))
    assert max(b - a for a, b in zip(free, free[1:])) > 400


def test_every_drafted_step_is_foreseen_a_window_ahead():
    """draft_within(W) is True at every step W or fewer steps before a drafted one (a probe, a
    forced draft step, a shape leading), so the plain steps before it capture the draft's rows;
    on a long plain stretch it is False most of the time (those steps capture nothing)."""
    window = 16
    p = AdaptivePolicy((TREE,), TABLE, probe_every=4, max_probe_every=64, probe_share=0.001,
                       draft_probe_every=200)
    foreseen, drafted = [], []
    for i in range(3000):
        foreseen.append(p.draft_within(window))
        arm = p.choose()
        if arm != PLAIN:
            drafted.append(i)
        feed(p, arm, 0, 7 if arm == TREE else 0, 5 if arm == TREE else 0)
    assert len(drafted) >= 10
    assert all(all(foreseen[j] for j in range(max(d - window, 0), d + 1)) for d in drafted)
    assert foreseen.count(False) > 0.5 * len(foreseen)


def test_a_plain_stretch_skips_only_choices_that_would_be_plain():
    """plain_run(W) promises plain steps the policy would choose anyway: run with the stretches
    (the decoder asks nothing inside one), the arms taken are step for step those of asking at
    every step, and the stretches end W steps before each drafted step. The stretch's steps are
    reported as the decoder reports them (observe_stretch, observed at the next choice): the
    averages and the accounting end as those of observing every step."""
    window = 16

    def run(stretches: bool):
        p = AdaptivePolicy((TREE,), TABLE, probe_every=4, max_probe_every=64, probe_share=0.001,
                           draft_probe_every=200)
        arms, left, asked = [], 0, 0
        for i in range(2000):
            wall = 10.0 + (i % 7) * 0.5          # plain steps' times vary
            if left:
                left = left - 1
                arms.append(PLAIN)
                p.observe_stretch(wall)
                continue
            arm, asked = p.choose(), asked + 1
            arms.append(arm)
            feed(p, arm, 0, 7 if arm == TREE else 0, 5 if arm == TREE else 0,
                 wall if arm == PLAIN else None)
            if stretches and arm == PLAIN and not p.probing:
                left = p.plain_run(window)
        return arms, asked, p.summary()
    (every, asked_every, summary_every), (stretched, asked, summary) = run(False), run(True)
    assert stretched == every and asked < 0.5 * asked_every
    assert summary == summary_every
    drafted = [i for i, a in enumerate(every) if a != PLAIN]
    assert len(drafted) >= 10
