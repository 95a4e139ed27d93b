"""Micro-benchmark of eagle3.kernels against what they replace: the small-M linear
(oneDNN prepacked, fp32 and bf16) on SmolLM2's shapes, the fused RMSNorm (F.rms_norm) and the
row-stable attention (fp64 row_stable_attention, SDPA for reference).

    python tools/bench_kernels.py [--threads 2] [--reps 5] [--json out.json]

Each linear is timed over 120 distinct weights (so every call reads its weight from memory, as in
a forward) and reported as us/call and GB/s of weight read.
"""
from __future__ import annotations

import eagle3

eagle3.tune_process()   # first: the OpenMP wait policy before torch loads, the allocator

import argparse
import json
import time

import torch

from eagle3 import kernels
from eagle3.runtime.backend import row_stable_attention

SHAPES = {"qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
ROWS = (1, 2, 4, 8, 16, 32)
NUM_WEIGHTS = 120


def timed(fn, reps: int) -> float:
    for _ in range(2):
        fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def linear_rows(reps: int) -> list[dict]:
    out = []
    for name, (o, i) in SHAPES.items():
        weights = [torch.randn(o, i) * 0.02 for _ in range(NUM_WEIGHTS)]
        for dtype in (torch.float32, torch.bfloat16):
            kernel = kernels.small_linear(dtype)
            dnn = [torch.ops.mkldnn._reorder_linear_weight(w.to(dtype), 8) for w in weights]
            ours = [kernels.pack_weight(w, dtype) for w in weights] if kernel else []
            nbytes = o * i * (4 if dtype == torch.float32 else 2)
            for m in ROWS:
                x = torch.randn(m, i).to(dtype)
                rec = {"layer": name, "dtype": str(dtype).split(".")[-1], "rows": m}
                t = timed(lambda: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in dnn], reps)
                rec["onednn_us"], rec["onednn_gb_s"] = t / NUM_WEIGHTS * 1e6, NUM_WEIGHTS * nbytes / t / 1e9
                if kernel:
                    t = timed(lambda: [kernel(x, p, None, o) for p in ours], reps)
                    rec["ours_us"], rec["ours_gb_s"] = t / NUM_WEIGHTS * 1e6, NUM_WEIGHTS * nbytes / t / 1e9
                out.append(rec)
    return out


def fused_rows(reps: int) -> list[dict]:
    ops = kernels.fused_ops()
    out = []
    x, w = torch.randn(1, 576), torch.rand(576)
    torch_s = timed(lambda: torch.nn.functional.rms_norm(x, (576,), w, 1e-5), reps * 200)
    rec = {"op": "rms_norm 1x576", "torch_us": torch_s * 1e6}
    if ops:
        rec["ours_us"] = timed(lambda: ops[0](x, w, 1e-5), reps * 200) * 1e6
    out.append(rec)
    k, v = torch.randn(1, 3, 600, 64)[:, :, :208], torch.randn(1, 3, 600, 64)[:, :, :208]
    for t in (1, 8):
        q = torch.randn(1, 9, t, 64)
        mask = torch.ones(1, 1, t, 208, dtype=torch.bool)
        rec = {"op": f"attention {t} queries, 208 keys, 9/3 heads",
               "fp64_us": timed(lambda: row_stable_attention(q, k, v, mask), reps * 40) * 1e6,
               "sdpa_us": timed(lambda: torch.nn.functional.scaled_dot_product_attention(
                   q, k, v, attn_mask=mask, enable_gqa=True), reps * 40) * 1e6}
        if ops:
            rec["ours_us"] = timed(lambda: ops[1](q, k, v, mask), reps * 40) * 1e6
        out.append(rec)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"kernels: {kernels.why()}; {args.threads} threads")
    lin = linear_rows(args.reps)
    print(f"{'layer':8s} {'dtype':8s} {'rows':>4s} {'oneDNN us':>10s} {'GB/s':>6s} {'ours us':>9s} {'GB/s':>6s}")
    for r in lin:
        ours = f"{r['ours_us']:9.1f} {r['ours_gb_s']:6.1f}" if "ours_us" in r else "        -      -"
        print(f"{r['layer']:8s} {r['dtype']:8s} {r['rows']:4d} {r['onednn_us']:10.1f} {r['onednn_gb_s']:6.1f} {ours}")
    fused = fused_rows(args.reps)
    for r in fused:
        print("  ".join(f"{k}: {v:.1f}" if isinstance(v, float) else str(v) for k, v in r.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "kernels": kernels.why(), "linear": lin, "fused": fused}, f, indent=1)


if __name__ == "__main__":
    main()
