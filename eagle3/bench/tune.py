"""`eagle3 bench --tune`: measure a few tree shapes on a handful of prompts, print the best.

On a CPU the verify forward grows with the tree much sooner than on a GPU, so the best
depth/top_k/num_draft_tokens is measured on the machine, interleaved with plain decoding
(greedy unless --temperatures says otherwise, same prompts), and ranked by the median per-prompt
speedup over plain.
"""
from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from typing import Optional

from ..errors import InputError
from ..speculative.tree import SpecParams
from .runner import BenchConfig, Setup, gen_params, on_cpu_clock, rotate
from .systems import OursSystem, build_ours

DEFAULT_SHAPES = (SpecParams.chain(2), SpecParams.chain(3), SpecParams.chain(4), SpecParams.chain(5),
                  SpecParams(2, 4, 6, 0.0), SpecParams(3, 4, 6, 0.0), SpecParams(4, 5, 8, 0.0),
                  SpecParams(4, 6, 16, 0.0), SpecParams(2, 3, 4, 0.05), SpecParams(3, 4, 6, 0.05),
                  SpecParams(4, 5, 8, 0.05), SpecParams(4, 6, 12, 0.05))


@dataclass(frozen=True)
class TuneRow:
    spec: SpecParams
    tokens_per_s: float        # median over prompts
    speedup: float             # median per-prompt ratio over plain decoding
    tau: float                 # pooled tokens per target forward
    step_ms: float             # mean wall time per decode step (draft + verify + other)

    @property
    def label(self) -> str:
        return shape_label(self.spec)


def parse_shapes(text: Optional[str]) -> tuple[SpecParams, ...]:
    """'K,D,N[,P];K,D,N[,P]' (K = 1 makes a chain and N is ignored; P = min_prob, default 0)."""
    if not text:
        return DEFAULT_SHAPES
    return tuple(parse_shape(part) for part in text.split(";"))


def parse_shape(text: str) -> SpecParams:
    """'K,D,N' or 'K,D,N,P' -> SpecParams (K = 1: a chain of depth D)."""
    parts = text.split(",")
    try:
        if len(parts) not in (3, 4):
            raise ValueError
        k, d, n = (int(x) for x in parts[:3])
        p = float(parts[3]) if len(parts) == 4 else 0.0
    except ValueError:
        raise InputError(f"a tree shape is TOP_K,DEPTH,NUM_DRAFT_TOKENS[,MIN_PROB] (e.g. 4,5,8 or "
                         f"4,5,8,0.05), got {text!r}")
    return SpecParams.chain(d, p) if k == 1 else SpecParams(k, d, n, p)


def shape_label(s: SpecParams) -> str:
    base = f"chain depth {s.depth}" if s.is_chain else \
        f"top_k {s.top_k} depth {s.depth} tokens {s.num_draft_tokens}"
    return base + (f" p>={s.min_prob:g}" if s.min_prob else "")


def tune(cfg: BenchConfig, setup: Setup, shapes: tuple[SpecParams, ...], progress: bool = True
         ) -> list[TuneRow]:
    from tqdm import tqdm
    base = next(s for s in setup.systems if isinstance(s, OursSystem) and s.speculative)
    named = {f"shape{i}": spec for i, spec in enumerate(shapes)}
    e = base.engine
    systems = build_ours(e.target, e.draft, e.tokenizer, e.max_model_len, named)
    for s in systems:
        s.warmup(setup.warm, gen_params(cfg, setup, 0.0, setup.warm, 16))
    runs: dict[str, list] = {s.name: [] for s in systems}
    bar = tqdm(total=len(setup.prompts) * len(systems), disable=not progress, file=sys.stderr)
    for i, prompt in enumerate(setup.prompts):
        for s in rotate(systems, i):
            cpu0 = time.process_time()
            res = s.run(prompt, gen_params(cfg, setup, cfg.temperatures[0], prompt))
            if cfg.clock == "cpu":
                res = on_cpu_clock(res, time.process_time() - cpu0)
            runs[s.name].append(res)
            bar.update(1)
    bar.close()
    plain = runs["ours-plain"]
    rows = [row(spec, runs[name], plain) for name, spec in named.items()]
    return sorted(rows, key=lambda r: r.speedup, reverse=True)


def row(spec: SpecParams, runs: list, plain: list) -> TuneRow:
    ratios = [r.tokens_per_s / p.tokens_per_s for r, p in zip(runs, plain) if p.tokens_per_s > 0]
    lens = [n for r in runs for n in r.accept_lens]
    steps = max(len(lens), 1)
    return TuneRow(spec, statistics.median(r.tokens_per_s for r in runs), statistics.median(ratios),
                   1 + sum(lens) / steps, 1e3 * sum(r.seconds for r in runs) / steps)


def costs_text(costs: dict[int, float]) -> str:
    one = costs[min(costs)]
    cells = "  ".join(f"{n}: {ms:.1f} ({ms / one:.2f}x)" for n, ms in costs.items())
    return f"target forward ms by verified tokens (x one token): {cells}"


def tune_text(rows: list[TuneRow]) -> str:
    lines = [f"{'shape':<34} {'tok/s':>7} {'x plain':>8} {'tau':>5} {'ms/step':>8}"]
    lines += [f"{r.label:<34} {r.tokens_per_s:>7.1f} {r.speedup:>8.2f} {r.tau:>5.2f} "
              f"{r.step_ms:>8.1f}" for r in rows]
    best = rows[0].spec
    lines.append(f"best on this machine: {shape_label(best)}\n  eagle3 generate --top-k {best.top_k} "
                 f"--depth {best.depth} --num-draft-tokens {best.num_draft_tokens} "
                 f"--min-prob {best.min_prob:g} ...")
    return "\n".join(lines)
