"""What a forward costs on this machine: the target by rows, the draft by rows, measured once and cached.

The adaptive step (speculative.policy) predicts a step's cost from this table rather than from the
step's own wall time, which is noisy on a shared CPU. Measured at the context the decoder runs at
(~200 cached tokens), median of `reps` forwards; cached per machine and model under
<cache_root>/costs/<key>.json, where the key covers the CPU model, the thread count, the layout's
backend and weight dtype, the kernels' build (sources and flags), and the model's shape.
`remeasure=True` (or EAGLE3_REMEASURE=1) measures again.

    rows      1     2     4     8     12    16    24    32
    target    ms of one target forward appending `rows` tokens (a verify block of that many nodes)
    draft     ms of one draft forward over `rows` rows (a tree level of top_k rows, an extend)
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from ..paths import cache_root

ROWS = (1, 2, 4, 8, 12, 16, 24, 32)


@dataclass(frozen=True)
class CostTable:
    rows: tuple[int, ...]
    target_ms: tuple[float, ...]       # per rows entry
    draft_ms: tuple[float, ...]        # per rows entry (empty without a draft)

    def target(self, rows: float) -> float:
        return _interpolate(self.rows, self.target_ms, rows)

    def draft(self, rows: float) -> float:
        return _interpolate(self.rows, self.draft_ms, rows) if self.draft_ms else 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "CostTable":
        d = json.loads(text)
        return cls(tuple(d["rows"]), tuple(d["target_ms"]), tuple(d["draft_ms"]))


def _interpolate(xs: tuple[int, ...], ys: tuple[float, ...], x: float) -> float:
    """Piecewise linear in rows; past the last point, extrapolated from the last two."""
    if x <= xs[0]:
        return ys[0]
    for i in range(1, len(xs)):
        if x <= xs[i] or i == len(xs) - 1:
            slope = (ys[i] - ys[i - 1]) / (xs[i] - xs[i - 1])
            return ys[i - 1] + slope * (x - xs[i - 1])
    return ys[-1]


def _median_ms(fn: Callable[[], None], reps: int) -> float:
    fn()                                            # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * sorted(times)[len(times) // 2]


@torch.inference_mode()
def target_costs(target, rows: tuple[int, ...] = ROWS, context: int = 200, reps: int = 7) -> list[float]:
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
             f"{cfg.architecture}:{cfg.num_layers}x{cfg.hidden_size}:{cfg.vocab_size}"]
    if getattr(backend, "kernels", None) is not None:      # a changed kernel source costs anew
        parts.append(kernel_build_id())
    if draft is not None:
        dcfg = draft.config
        parts.append(f"draft:{dcfg.hidden_size}:{dcfg.draft_vocab_size}:"
                     f"{getattr(draft, 'weights_name', '')}")
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:16]



def machine_costs(target, draft=None, remeasure: bool = False, reps: int = 7) -> CostTable:
    """The cost table of this target (and draft) on this machine: from the cache, or measured (a few
    seconds) and cached. A cache that cannot be written is skipped (the table is still returned)."""
    path = cache_root() / "costs" / f"{cost_key(target, draft)}.json"
    if not (remeasure or os.environ.get("EAGLE3_REMEASURE") == "1") and path.is_file():
        try:
            return CostTable.from_json(path.read_text())
        except (ValueError, KeyError):
            pass                                    # a damaged entry: measure again
    table = CostTable(ROWS, tuple(target_costs(target, ROWS, reps=reps)),
                      tuple(draft_costs(draft, ROWS, reps=reps)) if draft is not None else ())
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(table.to_json())
        os.replace(tmp, path)
    except OSError:
        pass
    return table
