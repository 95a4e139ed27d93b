"""Runtime micro-benchmark: one forward appending k tokens to a 200-token cache, this
runtime vs HF transformers in the same run, and plain greedy tokens/s of both.

    python tools/bench_runtime.py [--threads 2] [--reps 10] [--new-tokens 64] [--clock wall|cpu]
                                    [--weights gguf|fp32|bf16] [--context 200] [--model M]
    python tools/bench_runtime.py --weights gguf --spread 3000     # ours alone, no HF
    python tools/bench_runtime.py --weights gguf --spread 600 --context 1000 --rows 1,8 \
        --kv-cache-dtype fp32,fp16                                  # two caches, alternated
    python tools/bench_runtime.py --weights gguf --spread 600 --layer-path stack,layer,composite

--spread N times N one-token forwards of ours alone and prints their fastest, tenth percentile,
median and ninetieth percentile: on a VM whose speed drifts, the fastest and the tenth percentile
tell two builds apart where the median does not. With --rows, blocks of that many new tokens
(a verify block's rows) instead of one. With several --kv-cache-dtype values, the same layout runs
on one cache of each type, forward for forward in turn, so a drift of the VM hits all alike; so do
several --layer-path values (how a one-row step goes through the layers: all in one parallel
region, a region per layer, or the composite call with a region per op).

--weights bf16 packs our target as load_engine(weights="bf16") does (bf16 GEMM weights, row-stable
attention) and loads HF transformers in bf16 too.

--clock cpu times forwards with process CPU time (use with --threads 1 on a shared machine: other
processes then inflate both systems alike instead of adding their run time to one of them).
"""
from __future__ import annotations

import eagle3

eagle3.tune_process()   # first: the OpenMP wait policy before torch loads, the allocator

import argparse
import json
import statistics
import time

import torch

from eagle3.layouts import build_layouts
from eagle3.generate import Engine, SamplingParams
from eagle3.runtime.loader import load_model, load_tokenizer, resolve_model

KS = (1, 2, 4, 8, 16, 32, 64)
PROMPT = "Explain how a refrigerator works, step by step, for a curious ten-year-old."


CLOCK = time.perf_counter


def time_ours(model, ctx: torch.Tensor, k: int, reps: int) -> float:
    new = torch.randint(0, model.config.vocab_size, (1, k))
    times = []
    cache = model.new_cache(ctx.shape[1] + 64)
    model(ctx, torch.arange(ctx.shape[1]), cache)
    for _ in range(reps + 2):
        cache.truncate(ctx.shape[1])
        t0 = CLOCK()
        model(new, torch.arange(ctx.shape[1], ctx.shape[1] + k), cache)
        times.append(CLOCK() - t0)
    return statistics.median(times[2:])


def time_hf(hf, ctx: torch.Tensor, k: int, reps: int) -> float:
    from transformers import DynamicCache
    new = torch.randint(0, hf.config.vocab_size, (1, k))
    times = []
    for _ in range(reps + 2):
        cache = DynamicCache(config=hf.config)
        with torch.no_grad():
            hf(ctx, past_key_values=cache, use_cache=True)
            t0 = CLOCK()
            hf(new, past_key_values=cache, use_cache=True)
        times.append(CLOCK() - t0)
    return statistics.median(times[2:])


LAYER_PATHS = ("stack", "layer", "composite")


def use_layer_path(model, path: str, stack) -> None:
    """Which path a one-row step takes through the layers: every layer in one parallel region
    (the kernels' LayerStack: the default where it applies), each layer in one (decoder_layer's
    one-row case), or the composite call (a parallel region per op)."""
    model.stack = stack if path == "stack" else None
    if model.backend.kernels is not None:
        model.backend.kernels.set_one_region(path != "composite")


def spread(model, ctx: torch.Tensor, n: int, rows: int = 1, kv_dtypes=(None,), paths=(None,)) -> dict:
    """ms of n forwards of `rows` new tokens on the cached context, on a cache of each of
    kv_dtypes (None: the layout's own) and each layer path of `paths` (None: the default), in
    turn: {"dtype" or "dtype path": fastest, p10, median, p90}."""
    from eagle3.models.kv_cache import KVCache
    cfg, length = model.config, ctx.shape[1]
    new = torch.randint(0, cfg.vocab_size, (1, rows), generator=torch.Generator().manual_seed(1))
    stack = getattr(model, "stack", None)
    caches = {}
    for dt in kv_dtypes:
        dt = dt or model.kv_dtype
        for path in paths:
            caches[(dt, path)] = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, length + rows + 8, 1, dt)
            model(ctx, torch.arange(length), caches[(dt, path)])
    pos = torch.arange(length, length + rows)
    times = {key: [] for key in caches}
    try:
        for i in range(n + 20):
            for (dt, path), cache in caches.items():
                if path is not None:
                    use_layer_path(model, path, stack)
                cache.truncate(length)
                t0 = CLOCK()
                model(new, pos, cache)
                if i >= 20:
                    times[(dt, path)].append(1e3 * (CLOCK() - t0))
    finally:
        if paths != (None,):
            use_layer_path(model, "stack", stack)
    out = {}
    for (dt, path), t in times.items():
        t.sort()
        name = str(dt).removeprefix("torch.") + ("" if path is None else f" {path}")
        out[name] = {"min": t[0], "p10": t[n // 10], "median": t[n // 2],
                                                "p90": t[9 * n // 10]}
    return out


def greedy_tps(engine: Engine, hf, ids: list[int], new_tokens: int) -> tuple[float, float, bool]:
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    engine.generate(prompt_ids=ids, params=SamplingParams(max_new_tokens=8))  # warm-up
    t0 = CLOCK()
    ours = engine.generate(prompt_ids=ids, params=params)
    ours_s = CLOCK() - t0
    x = torch.tensor([ids])
    with torch.no_grad():
        hf.generate(x, max_new_tokens=8, do_sample=False)
        t0 = CLOCK()
        ref = hf.generate(x, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        hf_s = CLOCK() - t0
    n = ref.shape[1] - len(ids)
    same = ours.token_ids[:10] == ref[0, len(ids):len(ids) + 10].tolist()
    return len(ours.token_ids) / ours_s, n / hf_s, same


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--json", default=None)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    ap.add_argument("--weights", choices=["gguf", "fp32", "bf16"], default="fp32",
                    help="gguf: the GGUF's own codes on the kernels (HF runs fp32 then)")
    ap.add_argument("--model", default=None, help="target (default: the packaged SmolLM2 GGUF)")
    ap.add_argument("--context", type=int, default=200, help="cached tokens before the timed forward")
    ap.add_argument("--spread", type=int, default=0, metavar="N",
                    help="time N one-token forwards of ours alone (no HF): fastest, p10, median, p90")
    ap.add_argument("--rows", default="1", help="--spread: new tokens a forward, comma-separated")
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="--spread: the KV cache, or several comma-separated (fp32,fp16) run in turn")
    ap.add_argument("--layer-path", default=None,
                    help="--spread: one-row steps through " + " / ".join(LAYER_PATHS) + ", or several "
                         "comma-separated run in turn (default: the layout's own)")
    args = ap.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM
    src = resolve_model(args.model)
    model, _ = build_layouts(load_model(src.hf_dir), None, args.weights, source=src)
    tok = load_tokenizer(src.hf_dir)
    ctx = torch.randint(0, model.config.vocab_size, (1, args.context),
                        generator=torch.Generator().manual_seed(0))
    if args.spread:
        kinds = {"auto": None, "fp32": torch.float32, "fp16": torch.float16}
        dtypes = [kinds[k] for k in args.kv_cache_dtype.split(",")]
        paths = tuple(args.layer_path.split(",")) if args.layer_path else (None,)
        if any(p not in LAYER_PATHS for p in paths):
            ap.error(f"--layer-path {args.layer_path}: choose from {', '.join(LAYER_PATHS)}")
        for rows in (int(r) for r in args.rows.split(",")):
            with torch.inference_mode():
                by_kv = spread(model, ctx, args.spread, rows, dtypes, paths)
            for kv, ms in by_kv.items():
                print(f"{args.spread} forwards of {rows} rows ({args.weights}, {kv} cache, {args.context} "
                      f"cached, {args.threads} threads): " + ", ".join(f"{k} {v:.2f} ms" for k, v in ms.items()))
        return
    dtype = torch.bfloat16 if args.weights == "bf16" else torch.float32
    hf = AutoModelForCausalLM.from_pretrained(str(src.hf_dir), dtype=dtype).eval()
    rows = []
    print(f"{'k':>4} {'ours ms':>9} {'HF ms':>9} {'ours/HF':>8} {'ours k/1':>9}")
    for k in KS:
        ours, ref = time_ours(model, ctx, k, args.reps), time_hf(hf, ctx, k, args.reps)
        rows.append({"k": k, "ours_ms": ours * 1e3, "hf_ms": ref * 1e3})
        print(f"{k:>4} {ours * 1e3:>9.1f} {ref * 1e3:>9.1f} {ours / ref:>8.2f} "
              f"{ours / (rows[0]['ours_ms'] / 1e3):>9.2f}")
    engine = Engine(model, tok, max_model_len=1024)
    ours_tps, hf_tps, same = greedy_tps(engine, hf, engine.encode(PROMPT), args.new_tokens)
    print(f"plain greedy: ours {ours_tps:.1f} tok/s, HF generate {hf_tps:.1f} tok/s, "
          f"ratio {ours_tps / hf_tps:.2f}x, first tokens identical: {same}")
    bars = {"1-token forward <= 0.6x HF": rows[0]["ours_ms"] / rows[0]["hf_ms"],
            "greedy tok/s >= 1.6x HF": ours_tps / hf_tps,
            "8-token forward <= 1.6x 1-token": rows[3]["ours_ms"] / rows[0]["ours_ms"]}
    for name, value in bars.items():
        print(f"  {name}: {value:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "clock": args.clock, "weights": args.weights,
                       "context": args.context, "forward": rows, "ours_tps": ours_tps,
                       "hf_tps": hf_tps, "bars": bars}, f, indent=2)


if __name__ == "__main__":
    main()
