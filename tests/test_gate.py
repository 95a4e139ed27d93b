"""The batch's speculation gate and the live cost fit: pure bookkeeping, no model."""
from __future__ import annotations

import random

import pytest

from eagle3.errors import InputError
from eagle3.runtime.costs import CostTable, LiveCosts
from eagle3.speculative.gate import BatchGate

PLAIN_MS = 10.0


def run(gate: BatchGate, efficiency, steps: int) -> list[bool]:
    """`steps` batch steps of one decoding request; a speculative step at `efficiency(i)` times
    plain decoding's tokens per ms. -> whether each step speculated."""
    on = []
    for i in range(steps):
        on.append(gate.on)
        if gate.on:
            gate.observe(1, 1, PLAIN_MS / efficiency(i), PLAIN_MS)
        else:
            gate.observe_plain(PLAIN_MS, PLAIN_MS)       # the model prices plain steps right
    return on


def test_speculation_that_loses_goes_off_and_its_probes_thin_out():
    """A start that loses turns speculation off; each probe that loses doubles the wait for the
    next, so at most a few percent of the steps speculate over a long run."""
    gate = BatchGate(probe_steps=4, first_interval=8, max_interval=64)
    on = run(gate, lambda i: 0.9, 600)
    assert on[:4] == [True] * 4 and not any(on[4:12]) and on[12:16] == [True] * 4
    starts = [i for i in range(1, 600) if on[i] and not on[i - 1]]
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert gaps[:3] == [4 + 16, 4 + 32, 4 + 64] and set(gaps[3:]) == {4 + 64}
    assert sum(on) <= 4 + 4 * (1 + 600 // 64) and gate.counts["switches_off"] == len(starts) + 1


def test_a_probe_that_pays_turns_speculation_on_and_resets_the_wait():
    gate = BatchGate(probe_steps=4, first_interval=8, max_interval=64)
    run(gate, lambda i: 0.9, 100)                      # off, waits doubled
    assert not gate.on or gate.probing
    assert gate.interval > 8
    on = run(gate, lambda i: 1.3, 100)                 # the workload turns to copies: guesses pay
    assert all(on[-50:]) and gate.interval == 8


def test_one_stalled_step_does_not_turn_speculation_off():
    """Speculation that pays (1.1x) stays on through a step stalled 20x by another process; a
    lasting loss turns it off within a few steps."""
    gate = BatchGate(probe_steps=4)
    assert all(run(gate, lambda i: 0.05 if i == 20 else 1.1, 40))
    on = run(gate, lambda i: 0.8, 40)
    assert not all(on) and on.index(False) <= 6


def test_the_margin_keeps_speculation_that_barely_pays_off():
    gate = BatchGate(probe_steps=4, margin=0.05)
    assert not run(gate, lambda i: 1.03, 10)[-1]
    gate = BatchGate(probe_steps=4, margin=0.0)
    assert run(gate, lambda i: 1.03, 10)[-1]


def test_a_plain_step_is_predicted_by_its_measured_wall_over_the_model():
    gate = BatchGate()
    for _ in range(20):
        gate.observe_plain(12.0, 10.0)
    assert gate.plain_ms(10.0) == pytest.approx(12.0)
    with pytest.raises(InputError, match="probe_steps"):
        BatchGate(probe_steps=0)


TABLE = CostTable((1, 2, 4, 8, 16, 32), (4.0, 4.4, 5.0, 7.0, 12.0, 23.0), (0.2,) * 6)


def test_live_costs_fit_the_forwards_as_they_run():
    """Forwards whose one row costs 1.2x the table and extra rows 1.5x: the fit finds both, so a
    chain's rows are priced at what they cost now (the table alone: 8 ms for 12 more rows at 16
    rows, measured ~12)."""
    live = LiveCosts(TABLE)
    assert live.target(16) == TABLE.target(16)        # nothing seen: the table
    rng = random.Random(0)
    for _ in range(300):
        rows = rng.choice([3, 8, 12, 16, 20])
        ms = 1.2 * 4.0 + 1.5 * (TABLE.target(rows) - 4.0)
        live.observe(rows, ms * rng.uniform(0.97, 1.03), context=300)
    a, b = live.factors(300)
    assert a == pytest.approx(1.2, rel=0.05) and b == pytest.approx(1.5, rel=0.05)
    assert live.target(16, 300) == pytest.approx(1.2 * 4 + 1.5 * 8, rel=0.03)
    assert live.factors(2000) == live.factors(None)   # a context bucket not seen: the fit over all


def test_live_costs_of_one_row_count_scale_the_table_and_never_make_rows_free():
    live = LiveCosts(TABLE)
    for _ in range(30):
        live.observe(16, 18.0)
    assert live.target(16) == pytest.approx(18.0)
    assert live.target(20) > live.target(16) > live.target(8)
    # a fit pulled toward free extra rows keeps them at half the one-row factor or more
    live = LiveCosts(TABLE)
    for rows in [1, 32] * 20:
        live.observe(rows, 4.0 if rows == 1 else 4.5)
    a, b = live.factors()
    assert b >= 0.5 * a and live.target(32) > live.target(16)


def test_plain_decoding_is_measured_by_checks_while_speculation_is_on():
    """While on, the first step of all and then every CHECK_EVERY-th step (outside a probe) is a
    plain check; its wall time over the model's calibrates the prediction of plain decoding, so a
    model that prices plain steps 30% too dear no longer reads a loss as a gain."""
    from eagle3.speculative.gate import CHECK_EVERY
    gate = BatchGate(probe_steps=4)
    model_ms, true_ms = 13.0, 10.0                     # the model prices a plain step 30% too dear
    checks, on = [], []
    for i in range(200):
        if not gate.on:
            gate.observe_plain(true_ms, model_ms)
        elif gate.check_due:
            checks.append(i)
            gate.observe_plain(true_ms, model_ms)
        else:                                          # speculation at 0.9x plain
            gate.observe(1, 1, true_ms / 0.9, gate.plain_ms(model_ms))
        on.append(gate.on)
    assert checks[0] == 0 and gate.calibration == pytest.approx(true_ms / model_ms)
    assert sum(on[100:]) < 20                          # off but for its probes
    fooled = BatchGate(probe_steps=4)                  # without the calibration: 0.9 x 1.3 > 1
    assert all(run(fooled, lambda i: 0.9 * 1.3, 100))
    steady = BatchGate(probe_steps=4)
    steady.observe_plain(10.0, 10.0)
    gaps = []
    for i in range(100):
        if steady.check_due:
            gaps.append(i)
            steady.observe_plain(10.0, 10.0)
        else:
            steady.observe(2, 1, 10.0, steady.plain_ms(10.0))
    from eagle3.speculative.gate import START_CHECKS, START_GAP
    steps = [b - a for a, b in zip(gaps, gaps[1:])]    # the start's checks close together, then sparse
    start = START_CHECKS - 1                           # (one was seen before the loop)
    assert steady.on and steps[:start - 1] == [START_GAP] * (start - 1)
    assert steps[start:] == [CHECK_EVERY] * (len(steps) - start)


def test_one_odd_check_at_the_start_does_not_keep_a_loss_on():
    """The first decode step of a server's batch took 1.8x the model (the server answering 16 new
    streams beside it); the plain steps after it cost what the model says, and speculation runs at
    0.92x plain. The start's calibration is the median of its checks, and the speculative steps'
    average is read by the calibration as it stands: speculation goes off within the start's
    trial and a first probe, not ~140 steps later."""
    gate = BatchGate()
    model_ms, on = 10.0, []
    for i in range(160):
        on.append(gate.on)
        if not gate.on or gate.check_due:
            gate.observe_plain(18.0 if i == 0 else model_ms, model_ms)
        else:
            gate.observe(1, 1, model_ms / 0.92, gate.plain_ms(model_ms))
    assert gate.calibration == pytest.approx(1.0)
    assert all(on[:11]) and not any(on[11:43])        # the start's trial (8 steps and 3 checks), off
    assert sum(on) == 11 + 8 + 8                       # then two probes in 160 steps


def test_a_later_check_corrects_the_speculative_average_at_once():
    """Steps judged against a calibration that a later check corrects are read by the new one:
    the average is kept against the model, not against the calibration of its time."""
    gate = BatchGate(probe_steps=2)
    for _ in range(3):
        gate.observe_plain(20.0, 10.0)                 # plain steps 2x the model (so far)
    for _ in range(2):
        gate.observe(1, 1, 18.0, gate.plain_ms(10.0))  # 1.11x of what plain seemed to cost
    assert gate.on and gate.efficiency == pytest.approx(20.0 / 18.0)
    for _ in range(30):
        gate.observe_plain(12.0, 10.0)                 # plain steps measured again: 1.2x the model
    assert gate.efficiency == pytest.approx(12.0 / 18.0, rel=0.05)


def test_metrics_show_the_gate_as_it_stands():
    """/metrics reads the gate at scrape time: whether the batch speculates, its efficiency and
    the steps it judged by kind move with the gate."""
    from prometheus_client.parser import text_string_to_metric_families

    from eagle3.serve.metrics import ServerMetrics
    gate = BatchGate(probe_steps=4, first_interval=8, max_interval=64)
    metrics = ServerMetrics(max_depth=4)
    metrics.watch_gate(gate.summary)

    def scrape() -> dict:
        text = metrics.render().decode()
        return {(s.name, s.labels.get("kind")): s.value for fam in text_string_to_metric_families(text)
                for s in fam.samples if s.name.startswith("eagle3:batch_")}
    before = scrape()
    assert before[("eagle3:batch_speculation_on", None)] == 1.0
    run(gate, lambda i: 0.9, 10)                 # a losing start: off after its 4 steps
    after = scrape()
    assert after[("eagle3:batch_speculation_on", None)] == 0.0
    assert after[("eagle3:batch_gate_efficiency", None)] == pytest.approx(gate.efficiency, abs=1e-3)
    assert gate.efficiency < 1.0
    assert {k: after[("eagle3:batch_gate_steps", k)] for k in ("on", "off", "switches_off")} == \
        {"on": 4.0, "off": 6.0, "switches_off": 1.0}
