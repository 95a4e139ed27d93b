"""Whether a batch speculates at all: goodput against plain decoding, measured from its own steps.

Inside a batch each request may append a chain of guesses (generate.chains); the planner takes a
chain where its cost model says it pays. What the model leaves out is paid in every step while
speculation is on: the target's captured features for the draft, the draft's catch-ups, asking
every request's suffix index, the planning itself. Under load these cost more than the chains
win (MT-bench, 16 clients: 0.81-0.88x plain decoding). So the batch's steps are judged as they
run, as vLLM and SGLang switch speculation off where it does not pay:

    plain_ms(step)  = the forward of the step's rows without chains (runtime.costs.LiveCosts, fitted
                      to the forwards as they run) x the calibration: a rolling mean of plain steps'
                      wall ms over that prediction for their rows, measured in this batch
    efficiency      = (tokens the decoding requests got / the step's wall ms)
                      / (decoding requests / plain_ms(step))

Plain steps come from the stretches where speculation is off and, while it is on, from a check:
the first step of all, every START_GAP-th until START_CHECKS were seen, then every
CHECK_EVERY-th step, decode plainly (features still captured, so the drafts keep their
context). Without them the fit saw only forwards with
chains and, inside serving, predicted plain decoding ~10-15% dearer than it was: the gate read
1.04-1.11 where speculation ran at 0.91-0.95x plain (8 clients, MT-bench, T=0), and kept it on.
The start's calibration is the median of its checks, and the speculative steps' average is kept
against the model and calibrated when read: with one check at the start (a first decode step
while the server answered 16 new streams: 1.8x the model) the gate read 1.5 and kept speculation
on for ~140 steps at 0.9x plain (16 clients), the later checks moving only the steps after them.

Speculation stays on while the rolling efficiency of its steps is at least 1 + margin (each step
held within half to twice the average: one step stalled by another process moves it little).
Below it, the batch decodes plainly (no features captured, no index asked, no planning) and tries
again after `interval` steps: a probe of `probe_steps` speculative steps, judged by their median
alone (the start is such a trial too).
A probe that pays turns speculation on and resets the interval; one that does not doubles it, up
to max_interval, so a workload where guesses never pay spends at most ~probe_steps / max_interval
of its steps probing. Choosing never changes what is emitted: a chain's tokens are plain
decoding's.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from ..errors import InputError

GATE_MARGIN = 0.04        # speculation in the batch must beat plain decoding by this share
GATE_MEMORY = 0.9         # the weight of earlier speculative steps in the rolling efficiency
CHECK_EVERY = 16          # while speculation is on, every this-many-th step is plain: its measure
START_CHECKS = 3          # plain checks at the start, one every START_GAP steps (the start's trial
START_GAP = 4             # ... included): the calibration is their median until then
PROBE_STEPS = 8           # speculative steps a probe runs
FIRST_INTERVAL = 32       # plain steps before the first probe after switching off
MAX_INTERVAL = 1024       # ... doubling up to this many


@dataclass
class BatchGate:
    margin: float = GATE_MARGIN
    probe_steps: int = PROBE_STEPS
    first_interval: int = FIRST_INTERVAL
    max_interval: int = MAX_INTERVAL
    on: bool = True                       # speculation inside the batch this step
    interval: int = FIRST_INTERVAL        # plain steps before the next probe
    raw: float = 1.0                      # rolling, over speculative steps: efficiency / calibration
    window: list = field(default_factory=list)   # the current probe's (or start's) raw efficiencies
    calibration: float = 1.0              # plain steps' wall ms / the model's ms for them (rolling)
    plain_seen: int = 0
    first_ratios: list = field(default_factory=list)   # the first START_CHECKS plain steps' ratios
    on_steps: int = 0                     # speculative steps since the last check
    off_steps: int = 0                    # plain steps since speculation went off
    counts: dict = field(default_factory=lambda: {"on": 0, "off": 0, "checks": 0, "switches_off": 0,
                                                  "probes": 0})

    def __post_init__(self):
        if self.probe_steps < 1 or self.first_interval < 1 or self.max_interval < self.first_interval:
            raise InputError(f"BatchGate probe_steps ({self.probe_steps}) and first_interval "
                             f"({self.first_interval}) must be >= 1 and max_interval "
                             f"({self.max_interval}) >= first_interval")
        self.interval = self.first_interval

    @property
    def probing(self) -> bool:
        """Speculation is on for a trial (at the start, or a probe after a plain stretch)."""
        return self.on and len(self.window) < self.probe_steps

    @property
    def efficiency(self) -> float:
        """Speculative steps' tokens per ms over plain decoding's, by the calibration now."""
        return self.raw * self.calibration

    def plain_ms(self, model_ms: float) -> float:
        """A plain step's predicted ms given the model's ms for its rows (LiveCosts)."""
        return model_ms * self.calibration

    @property
    def check_due(self) -> bool:
        """Speculation is on and this step is its plain check: the first step of all, then
        every START_GAP-th until START_CHECKS were seen (the trial at the start included, so it
        is judged against measured plain steps, not one), then every CHECK_EVERY-th step
        outside a probe."""
        if not self.on:
            return False
        if self.plain_seen < START_CHECKS:
            return not self.plain_seen or self.on_steps >= START_GAP - 1
        return not self.probing and self.on_steps >= CHECK_EVERY - 1

    def observe_plain(self, wall_ms: float, model_ms: float) -> None:
        """A step decoded plainly (speculation off, or a check): its wall time and the model's ms
        for its rows."""
        if model_ms > 0 and wall_ms > 0:
            self.plain_seen += 1
            ratio = wall_ms / model_ms
            if self.plain_seen <= START_CHECKS:        # one odd step of the first is outvoted
                self.first_ratios.append(ratio)
                self.calibration = statistics.median(self.first_ratios)
            else:                                      # one stalled step moves it little
                ratio = min(max(ratio, self.calibration / 2), self.calibration * 2)
                weight = max(1.0 / self.plain_seen, 1.0 - GATE_MEMORY)
                self.calibration += (ratio - self.calibration) * weight
        self.counts["off" if not self.on else "checks"] += 1
        self.on_steps = 0
        if not self.on:
            self.off_steps += 1
            if self.off_steps >= self.interval:                  # probe
                self.on, self.window = True, []
                self.counts["probes"] += 1

    def observe(self, tokens: int, decoders: int, wall_ms: float, plain_ms: float) -> None:
        """A step speculation was on for: the tokens its `decoders` decoding requests got in
        `wall_ms`, where plain decoding would have taken `plain_ms` for one token each."""
        if decoders < 1 or wall_ms <= 0 or plain_ms <= 0:
            return
        self.counts["on"] += 1
        self.on_steps += 1
        raw = (tokens / wall_ms) / (decoders / plain_ms) / self.calibration
        if self.probing:
            self.window.append(raw)
            if len(self.window) == self.probe_steps:
                self.raw = statistics.median(self.window)
                self._decide(probe=True)
            return
        raw = min(max(raw, self.raw / 2), self.raw * 2)      # one stalled step moves it little
        self.raw += (raw - self.raw) * (1.0 - GATE_MEMORY)
        self._decide(probe=False)

    def _decide(self, probe: bool) -> None:
        if self.efficiency >= 1.0 + self.margin:
            if probe:
                self.interval = self.first_interval
            return
        self.on, self.off_steps = False, 0
        self.counts["switches_off"] += 1
        if probe and self.counts["probes"]:       # a probe that did not pay: wait longer for the next
            self.interval = min(2 * self.interval, self.max_interval)

    def summary(self) -> dict:
        """The gate as it stands: `speculating` (on now), its efficiency and interval, and the
        steps it judged by kind (counts: on, off, checks, probes, switches_off)."""
        return {"speculating": self.on, "efficiency": round(self.efficiency, 3),
                "interval": self.interval, **self.counts}
