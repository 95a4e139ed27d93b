"""One decode forward of the target against the memory-bandwidth bound.

A batch-1 decode forward reads every weight once, so it cannot beat weight_bytes / bandwidth.
Bandwidth is measured with a large tensor copy (bytes read + bytes written per second, the STREAM
"copy" convention) and, as a cross-check, a pure read (a sum). ratio = measured / bound: 1.0 means
the forward runs at the memory bound, 2.0 means it takes twice as long as the bound allows.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class Roofline:
    weight_bytes: int
    copy_gb_s: float            # (read + write) bytes / s of a large copy
    read_gb_s: float            # bytes / s of a large sum
    forward_ms: float           # median one-token decode forward, `context` tokens cached
    context: int
    bound_ms: float             # weight_bytes / copy bandwidth
    ratio: float                # forward_ms / bound_ms
    ratio_read: float           # against the pure-read bandwidth
    forward_p10_ms: float = 0.0  # the tenth percentile of `spread` forwards (0: not measured)
    spread: int = 0

    def text(self) -> str:
        p10 = (f"; the tenth percentile of {self.spread} forwards {self.forward_p10_ms:.2f} ms: "
               f"{self.forward_p10_ms / self.bound_ms:.2f}x" if self.spread else "")
        return (f"target decode forward {self.forward_ms:.2f} ms (context {self.context}) vs memory "
                f"bound {self.bound_ms:.2f} ms ({self.weight_bytes / 2**20:.0f} MiB of weights at "
                f"{self.copy_gb_s:.1f} GB/s copy bandwidth): {self.ratio:.2f}x the bound "
                f"({self.ratio_read:.2f}x against {self.read_gb_s:.1f} GB/s pure read{p10})")


def read_bytes_per_forward(model) -> int:
    """Weight bytes a one-token forward reads: every linear (at the dtype it runs in, laid out
    or not; a tied lm_head counts once as a linear) and every norm; embeddings read one row (0).
    `model`: a reference nn.Module or an inference layout (runtime.target)."""
    from ..models.layers import RMSNorm
    if not isinstance(model, torch.nn.Module):   # an inference layout: its linears and norms
        norms = [n for layer in model.layers for n in (layer.norm1, layer.norm2) if n is not None]
        return (sum(l.weight_bytes() for l in model.linears)
                + sum(n.weight.numel() * n.weight.element_size() for n in norms + [model.norm]))
    total = 0
    for m in model.modules():
        if isinstance(m, (torch.nn.Linear, RMSNorm)):
            total += m.weight.numel() * m.weight.element_size()
    return total


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _times(fn, device: torch.device, reps: int, clock=time.perf_counter) -> list[float]:
    fn()
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = clock()
        fn()
        _sync(device)
        times.append(clock() - t0)
    return times


def _median_time(fn, device: torch.device, reps: int, clock=time.perf_counter) -> float:
    return statistics.median(_times(fn, device, reps, clock))


def bandwidth(device: torch.device, mib: int = 256, reps: int = 5,
              clock=time.perf_counter) -> tuple[float, float]:
    """(copy GB/s counting read + write, read-only GB/s) over a `mib` MiB fp32 buffer."""
    n = mib * 2**20 // 4
    src = torch.ones(n, device=device)
    dst = torch.empty_like(src)
    t_copy = _median_time(lambda: dst.copy_(src), device, reps, clock)
    t_read = _median_time(lambda: src.sum(), device, reps, clock)
    nbytes = n * 4
    return 2 * nbytes / t_copy / 1e9, nbytes / t_read / 1e9


def decode_forward_s(target, context: int = 200, reps: int = 20, tokens: int = 1,
                     clock=time.perf_counter) -> float:
    """Median time of one forward of `tokens` new tokens on top of `context` cached tokens
    (tokens > 1: the cost of verifying a tree of that size, causal mask)."""
    return statistics.median(decode_forward_times(target, context, reps, tokens, clock))


@torch.inference_mode()
def decode_forward_times(target, context: int = 200, reps: int = 20, tokens: int = 1,
                         clock=time.perf_counter) -> list[float]:
    """The times (s) of `reps` such forwards."""
    device = target.device
    gen = torch.Generator().manual_seed(0)
    ctx = torch.randint(0, target.config.vocab_size, (1, context + tokens), generator=gen).to(device)
    cache = target.new_cache(context + tokens + 8)
    target(ctx[:, :context], torch.arange(context, device=device), cache)
    new = ctx[:, context:]
    pos = torch.arange(context, context + tokens, device=device)

    def one() -> None:
        cache.truncate(context)
        target(new, pos, cache)
    return _times(one, device, reps, clock)


def verify_costs(target, sizes: tuple[int, ...] = (1, 2, 4, 6, 8, 12, 16), context: int = 200,
                 reps: int = 10, clock=time.perf_counter) -> dict[int, float]:
    """Forward time (ms) per number of verified tokens: what a bigger tree costs on this device."""
    return {n: 1e3 * decode_forward_s(target, context, reps, n, clock) for n in sizes}


def measure(target, weight_bytes: int, context: int = 200, mib: int = 256,
            clock=time.perf_counter, spread: int = 200) -> Roofline:
    """The median of 20 forwards against the bound, and the tenth percentile of `spread` more: on a
    shared machine a slow moment moves a median of 20 by tens of percent (1.15x and 1.66x the bound
    minutes apart on the 2-core EPYC), the tenth percentile of a few hundred much less."""
    device = target.device
    copy_bw, read_bw = bandwidth(device, mib, clock=clock)
    fwd = decode_forward_s(target, context, clock=clock)
    times = sorted(decode_forward_times(target, context, spread, clock=clock)) if spread else [0.0]
    bound = weight_bytes / (copy_bw * 1e9)
    return Roofline(weight_bytes, copy_bw, read_bw, fwd * 1e3, context, bound * 1e3,
                    fwd / bound, fwd / (weight_bytes / (read_bw * 1e9)), 1e3 * times[len(times) // 10], spread)


@dataclass(frozen=True)
class RowRoof:
    """What one more verified row costs against the compute roof of one-digit codes: each row
    needs every linear's in x out byte products, 64 to a vpdpbusd, at the rate this CPU retires
    them over the threads (kernels.integer_dot_peak). The extra row is priced between two blocks
    that are both compute-bound (8 and 16 rows): from 1 row it would hide in the memory stall
    of the one-row forward."""
    dots_g_s: float             # vpdpbusd (zmm) a second, in G, all threads
    dots_per_row: int           # vpdpbusd a row of the forward needs
    bound_ms: float             # dots_per_row / the rate: the least an extra row can cost
    forward_ms: dict            # {rows: measured forward ms}, `context` tokens cached
    extra_row_ms: float         # (forward of the most rows - of the middle block) / their rows apart

    def text(self) -> str:
        ms = {int(k): v for k, v in self.forward_ms.items()}
        blocks = ", ".join(f"{r} rows {ms[r]:.2f}" for r in sorted(ms))
        return (f"extra verify row {self.extra_row_ms:.2f} ms measured (forwards: {blocks} ms; "
                f"{max(ms)} rows = {ms[max(ms)] / ms[min(ms)]:.2f}x one row) vs integer-dot bound "
                f"{self.bound_ms:.2f} ms ({self.dots_per_row / 1e6:.2f} M vpdpbusd a row at "
                f"{self.dots_g_s:.2f} G/s): {self.extra_row_ms / self.bound_ms:.2f}x the bound")


def dots_per_row(model) -> int:
    """vpdpbusd (64 byte products each) one row of a forward needs over every linear."""
    return sum(-(-l.in_features * l.out_features // 64) for l in model.linears)


def measure_rows(target, rows: tuple[int, int, int] = (1, 8, 16), context: int = 200,
                 clock=time.perf_counter) -> Optional[RowRoof]:
    """The row roof of a target whose linears run one-digit codes on integer dot products (the
    default GGUF path where the CPU has AVX512-VNNI), else None. rows: one row, then the two
    compute-bound blocks the extra row is priced between."""
    from .. import kernels
    linears = getattr(target, "linears", None)
    if not linears or not any(getattr(l, "one_digit", False) for l in linears):
        return None
    peak = kernels.integer_dot_peak()
    if peak is None:
        return None
    ms = verify_costs(target, rows, context, clock=clock)
    need = dots_per_row(target)
    return RowRoof(peak / 1e9, need, 1e3 * need / peak, ms, (ms[rows[2]] - ms[rows[1]]) / (rows[2] - rows[1]))
