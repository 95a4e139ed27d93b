"""What a forward costs on this machine: the target by rows, the draft by rows, measured once and cached.

The adaptive step (speculative.policy) predicts a step's cost from this table rather than from the
step's own wall time, which is noisy on a shared CPU. Measured at the context the decoder runs at
(~200 cached tokens), median of `reps` forwards; cached per machine and model under
<cache_root>/costs/<key>.json, where the key covers the CPU model, the thread count, the layout's
backend and weight dtype, the kernels' build (sources and flags), and the model's shape.
`remeasure=True` (or EAGLE3_REMEASURE=1) measures again.

A table measured while other processes held the cores (a test suite, a build) would mislead every
later run, so each measurement is watched (`CpuWatch`: the CPU time /proc/stat counts beyond this
process's own, steal time included): one where others took more than QUIET_SHARE of the CPUs is
measured again (three tries, the quietest kept) and, if still disturbed, used for this run but
cached as not quiet, so the next run measures anew. A cached table is also checked against one
quiet 1-row forward at load: a table whose 1-row cost is over STALE_RATIO times it was measured in
a busy moment and is measured again.

    rows      1     2     4     8     12    16    24    32
    target    ms of one target forward appending `rows` tokens (a verify block of that many nodes)
    draft     ms of one draft forward over `rows` rows (a tree level of top_k rows, an extend)
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from .. import settings
from ..paths import cache_root

ROWS = (1, 2, 4, 8, 12, 16, 24, 32)


QUIET_SHARE = 0.1      # other processes' share of all CPUs above which a measurement is disturbed
                       # (one process spinning beside a 2-thread measurement on 2 cores: 0.16-0.2;
                       # a quiet machine: 0.00-0.02)
STALE_RATIO = 1.5      # a cached 1-row cost this much over a quiet one now (and STALE_MS more):
STALE_MS = 1.0         # measured in a busy moment (sub-ms forwards of tiny models jitter more)
TRIES = 3
WATCH_S = 0.25         # the load-time check runs at least this long


@dataclass(frozen=True)
class CostTable:
    rows: tuple[int, ...]
    target_ms: tuple[float, ...]       # per rows entry
    draft_ms: tuple[float, ...]        # per rows entry (empty without a draft)
    others: float = 0.0                # share of the CPUs other processes took while it was measured

    @property
    def quiet(self) -> bool:
        return self.others <= QUIET_SHARE

    def target(self, rows: float) -> float:
        return _interpolate(self.rows, self.target_ms, rows)

    def draft(self, rows: float) -> float:
        return _interpolate(self.rows, self.draft_ms, rows) if self.draft_ms else 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "CostTable":
        d = json.loads(text)
        return cls(tuple(d["rows"]), tuple(d["target_ms"]), tuple(d["draft_ms"]), float(d.get("others", 0.0)))


def _stat_ticks() -> Optional[tuple[int, int]]:
    """(busy, total) CPU ticks of the whole machine since boot (/proc/stat; steal counts as busy:
    another guest holding this one's core), or None where there is no /proc/stat."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    busy = user + nice + system + irq + softirq + steal
    return busy, busy + idle + iowait


class CpuWatch:
    """The share of all CPUs that other processes took while the block ran: (busy ticks - this
    process's own CPU time) / total ticks, less two ticks (both counters count whole ticks, 10 ms:
    a short block would otherwise read a kernel thread's one tick as a busy machine). 0.0 where
    /proc/stat is not there."""

    def __enter__(self) -> "CpuWatch":
        self.others = 0.0
        self._start = _stat_ticks(), _own_seconds()
        return self

    def __exit__(self, *exc) -> None:
        ticks, own = _stat_ticks(), _own_seconds()
        if ticks is None or self._start[0] is None:
            return
        hz = os.sysconf("SC_CLK_TCK")
        busy = (ticks[0] - self._start[0][0]) / hz
        total = (ticks[1] - self._start[0][1]) / hz
        if total > 0:
            self.others = min(1.0, max(0.0, (busy - (own - self._start[1]) - 2 / hz) / total))


def _own_seconds() -> float:
    t = os.times()
    return t.user + t.system


def _interpolate(xs: tuple[int, ...], ys: tuple[float, ...], x: float) -> float:
    """Piecewise linear in rows; past the last point, extrapolated along the slope over the upper
    half of the table (from half the last point's rows): the last two points alone can be a
    noisy pair whose slope makes extra rows look free."""
    if x <= xs[0]:
        return ys[0]
    for i in range(1, len(xs)):
        if x <= xs[i]:
            slope = (ys[i] - ys[i - 1]) / (xs[i] - xs[i - 1])
            return ys[i - 1] + slope * (x - xs[i - 1])
    if len(xs) == 1:
        return ys[0]
    half = max(xs[0], xs[-1] / 2)
    mid = _interpolate(xs, ys, half) if half < xs[-1] else ys[-2]
    span = xs[-1] - half if half < xs[-1] else xs[-1] - xs[-2]
    return ys[-1] + (ys[-1] - mid) / span * (x - xs[-1])


def _median_ms(fn: Callable[[], None], reps: int) -> float:
    fn()                                            # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * sorted(times)[len(times) // 2]


def _context(config, rows: tuple[int, ...], context: int) -> int:
    """The cached tokens a measurement runs over: `context`, or fewer where the model's positions
    end before context + the largest block (a tiny test model)."""
    return max(1, min(context, config.max_position - max(rows)))


@torch.inference_mode()
def target_costs(target, rows: tuple[int, ...] = ROWS, context: int = 200, reps: int = 7) -> list[float]:
    context = _context(target.config, rows, context)
    device = target.device
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.config.vocab_size, (1, context + max(rows)), generator=gen).to(device)
    cache = target.new_cache(context + max(rows) + 1)
    target(ids[:, :context], torch.arange(context, device=device), cache)
    out = []
    for n in rows:
        new, pos = ids[:, context:context + n], torch.arange(context, context + n, device=device)

        def one() -> None:
            cache.truncate(context)
            target(new, pos, cache)
        out.append(_median_ms(one, reps))
    return out


@torch.inference_mode()
def draft_costs(draft, rows: tuple[int, ...] = ROWS, context: int = 200, reps: int = 7) -> list[float]:
    context = _context(draft.config, rows, context)
    cfg, device = draft.config, draft.device
    gen = torch.Generator().manual_seed(1)
    cache = draft.new_cache(context + max(rows) + 1)
    hidden = torch.randn(1, context, cfg.hidden_size, generator=gen).to(device)
    ids = torch.randint(0, cfg.vocab_size, (1, context + max(rows)), generator=gen).to(device)
    draft(ids[:, :context], torch.arange(context, device=device), cache, hidden=hidden)
    out = []
    for n in rows:
        new, pos = ids[:, context:context + n], torch.full((n,), context, device=device)

        def one() -> None:
            cache.truncate(context)
            draft(new, pos, cache, hidden=hidden[:, :n], logits_rows=slice(None))
        out.append(_median_ms(one, reps))
    return out


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def kernel_build_id() -> str:
    """The eagle3 kernels' build (its directory is named by the hash of sources and flags)."""
    from .. import kernels
    build_dir = kernels.state().build_dir
    return f"kernels:{build_dir.name if build_dir is not None else 'none'}"


def cost_key(target, draft) -> str:
    backend = getattr(target, "backend", None)
    cfg = target.config
    parts = [platform.machine(), cpu_name(), str(torch.get_num_threads()),
             getattr(backend, "name", "reference"), str(getattr(backend, "weight_dtype", "")),
             str(getattr(backend, "row_stable", "")), getattr(target, "weights_name", ""),
             f"kv:{getattr(target, 'kv_dtype', '')}",
             f"{cfg.architecture}:{cfg.num_layers}x{cfg.hidden_size}:{cfg.vocab_size}",
             "rows:" + ",".join(map(str, ROWS))]                    # a new row set measures anew
    if getattr(backend, "kernels", None) is not None:      # a changed kernel source costs anew
        parts.append(kernel_build_id())
    if draft is not None:
        dcfg = draft.config
        parts.append(f"draft:{dcfg.hidden_size}:{dcfg.draft_vocab_size}:"
                     f"{getattr(draft, 'weights_name', '')}")
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:16]



def machine_costs(target, draft=None, remeasure: bool = False, reps: int = 7) -> CostTable:
    """The cost table of this target (and draft) on this machine: from the cache when it was
    measured quietly and still holds, else measured (a few seconds, watched: `CpuWatch`) and
    cached. A cache that cannot be written is skipped (the table is still returned)."""
    path = cache_root() / "costs" / f"{cost_key(target, draft)}.json"
    if not (remeasure or settings.enabled("EAGLE3_REMEASURE")) and path.is_file():
        try:
            cached = CostTable.from_json(path.read_text())
        except (ValueError, KeyError, TypeError):
            cached = None                           # a damaged entry: measure again
        if cached is not None and cached.quiet and not measured_when_busy(cached, target):
            return cached
    table = quietest_table(target, draft, reps)
    if not table.quiet:
        print(f"eagle3: the cost table was measured while other processes took {table.others:.0%} of "
              f"the CPUs ({TRIES} tries); it serves this run and is measured again on the next",
              file=sys.stderr)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(table.to_json())
        os.replace(tmp, path)
    except OSError:
        pass
    return table


def quietest_table(target, draft, reps: int) -> CostTable:
    """Measured up to TRIES times while other processes take more than QUIET_SHARE of the CPUs;
    the quietest try."""
    best = None
    for _ in range(TRIES):
        with CpuWatch() as watch:
            t = tuple(target_costs(target, ROWS, reps=reps))
            d = tuple(draft_costs(draft, ROWS, reps=reps)) if draft is not None else ()
        table = CostTable(ROWS, t, d, round(watch.others, 3))
        if best is None or table.others < best.others:
            best = table
        if best.quiet:
            break
    return best


def measured_when_busy(table: CostTable, target, reps: int = 5) -> bool:
    """Whether a cached table's 1-row cost is over STALE_RATIO times (and STALE_MS over) a 1-row
    forward measured now, in a quiet moment (a busy moment now proves nothing: the table is kept)."""
    with CpuWatch() as watch:   # at least WATCH_S long, so the watch's ticks mean something
        t0, samples = time.perf_counter(), []
        while len(samples) < 3 or time.perf_counter() - t0 < WATCH_S:
            samples += target_costs(target, (1,), reps=reps)
        now = sorted(samples)[len(samples) // 2]
    return watch.others <= QUIET_SHARE and table.target(1) > max(STALE_RATIO * now, now + STALE_MS)


# ---------------------------------------------------------------------------- measured as they run
CONTEXT_BUCKETS = (256, 512, 1024)    # mean cached tokens per row: up to each, then past the last
LIVE_MEMORY = 0.95                    # the weight of the earlier forwards in the fit
LIVE_MIN_FORWARDS = 4                 # a context bucket's own fit is used from this many forwards
MARGINAL_BOUNDS = (0.5, 4.0)          # the extra rows' factor, as a share of the one-row factor
ONE_ROW_BOUNDS = (0.25, 10.0)         # the one-row factor (a noisy fit never makes a forward free)


class LiveCosts:
    """A cost table corrected by the forwards as they run. The table is measured once, quietly, at
    ~200 cached tokens; inside a batch of long requests, or with another process on the other core,
    the forward costs more, and its extra rows more again (~1.5x the table's, measured inside
    serving steps): a planner priced by the table takes rows that do not pay. So each forward's
    measured ms y over `rows` is fitted as

        y = a * table(1) + b * (table(rows) - table(1))

    (a: the one-row forward's factor, b: the extra rows'), by least squares over the forwards with
    weight LIVE_MEMORY on the past, one fit per context bucket (mean cached tokens per row) and one
    over all. While the forwards seen have (nearly) one row count, b follows a. `target(rows,
    context)` is the fitted ms: non-decreasing in rows, so a chain's rows never look free."""

    def __init__(self, table: CostTable, memory: float = LIVE_MEMORY):
        self.table, self.memory = table, memory
        self.fits: dict[object, list[float]] = {}      # bucket -> [n, s00, s01, s11, s0y, s1y]

    def _parts(self, rows: float) -> tuple[float, float]:
        one = self.table.target(1)
        return one, max(self.table.target(rows) - one, 0.0)

    @staticmethod
    def bucket(context: Optional[float]) -> Optional[int]:
        if context is None:
            return None
        return next((i for i, x in enumerate(CONTEXT_BUCKETS) if context <= x), len(CONTEXT_BUCKETS))

    def observe(self, rows: float, ms: float, context: Optional[float] = None) -> None:
        """A forward over `rows` rows at `context` mean cached tokens took `ms`."""
        if rows < 1 or ms <= 0:
            return
        x0, x1 = self._parts(rows)
        for key in {"all", self.bucket(context)} - {None}:
            f = self.fits.setdefault(key, [0.0] * 6)
            m = self.memory
            for i, v in enumerate((1.0, x0 * x0, x0 * x1, x1 * x1, x0 * ms, x1 * ms)):
                f[i] = m * f[i] + v

    def factors(self, context: Optional[float] = None) -> tuple[float, float]:
        """(a, b) of the fit for `context` (1, 1 before any forward)."""
        f = self.fits.get(self.bucket(context))
        if f is None or f[0] < LIVE_MIN_FORWARDS * (1 - self.memory ** LIVE_MIN_FORWARDS) / (1 - self.memory) * 0.99:
            f = self.fits.get("all")
        if f is None:
            return 1.0, 1.0
        _, s00, s01, s11, s0y, s1y = f
        det = s00 * s11 - s01 * s01
        if s11 <= 0 or det <= 1e-6 * s00 * s11:        # one row count seen: one factor for both
            a = (s0y + s1y) / (s00 + 2 * s01 + s11)
            return a, a
        a = min(max((s0y * s11 - s1y * s01) / det, ONE_ROW_BOUNDS[0]), ONE_ROW_BOUNDS[1])
        b = (s1y * s00 - s0y * s01) / det
        lo, hi = MARGINAL_BOUNDS
        b = min(max(b, lo * a), hi * a)
        return a, b

    def target(self, rows: float, context: Optional[float] = None) -> float:
        a, b = self.factors(context)
        x0, x1 = self._parts(rows)
        return a * x0 + b * x1
