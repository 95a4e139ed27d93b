"""`eagle3 bench`: this project against HF transformers and llama.cpp, in one interleaved run.

Workload: MT-bench first turns (or --workload copy: prompts whose answers quote their input), chat
template, 256 new tokens, temperature 0 and 1, a fixed seed per prompt, warm-up excluded. Prints one
table (tokens/s, per-prompt speedups with their spread, tau, time split, peak memory), acceptance per
draft position, the greedy identity check and the decode-forward-vs-memory-bound ratio; writes
bench.json and PNG plots to --out.

    eagle3 bench                       # the full run (80 prompts x 2 temperatures x every system)
    eagle3 bench --quick               # 3 prompts, 32 tokens
    eagle3 bench --workload copy       # the 40 copy-heavy prompts (suffix-match territory)
    eagle3 bench --tune                # measure tree shapes on this machine, print the best
    eagle3 bench serve                 # the server under concurrent streaming clients (serving.py)
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path

from ..cli_args import DRAFT_HELP, MODEL_HELP, add_run_args, run_config_from_args
from ..config import available_cores
from ..errors import InputError
from ..speculative.tree import SpecParams
from .report import (acceptance_text, identities, identity_text, policy_time_text, save_json, save_plots,
                     summarize, table, to_jsonable, tree_vs_chain_text)
from .runner import BenchConfig, build, machine_info, run
from .roofline import Roofline, RowRoof, measure_rows
from .stats import Record
from .tune import parse_shape
from .workload import DESCRIPTIONS, WORKLOADS

QUICK = dict(prompts=3, max_new_tokens=32)
TUNE = dict(prompts=4, max_new_tokens=64)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="eagle3 bench", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument("--draft", default="default", help=DRAFT_HELP)
    p.add_argument("--workload", choices=list(WORKLOADS), default="mtbench",
                   help="mtbench: MT-bench first turns (80); copy: ShareGPT prompts whose answers "
                        "quote their input (40; see docs/benchmarks.md)")
    p.add_argument("--prompts", type=int, default=None, help="prompts, round-robin over the "
                   "workload's categories (default 80: all of either workload)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 256")
    p.add_argument("--temperatures", default=None, help="comma-separated (default 0,1; --tune: 0, "
                   "or the first one given)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="cpu = process CPU seconds instead of wall (with --threads 1, on a machine "
                        "shared with other jobs; llama.cpp-eagle3 keeps its own wall timers)")
    add_run_args(p)                 # --weights, --draft-weights (the identity check reports bf16 drift),
                                    # --device, --threads
    p.add_argument("--chain-depth", type=int, default=5,
                   help="ours-chain, llama.cpp-eagle3 and vllm-eagle3 depth")
    p.add_argument("--tree", default=None, help="ours-tree shape TOP_K,DEPTH,NUM_DRAFT_TOKENS[,MIN_PROB] "
                   "(default: the engine's default tree)")
    p.add_argument("--prompt-lookup", type=int, default=10, help="prompt-lookup tokens (HF, llama.cpp)")
    p.add_argument("--systems", default=None, help="comma-separated names, '*' suffix = prefix "
                   "(e.g. ours-*,hf-generate); default: all available")
    p.add_argument("--ignore-eos", action="store_true", help="always generate max-new-tokens")
    p.add_argument("--vllm-python", default=None, help="python of the vLLM venv for vllm-plain and "
                   "vllm-eagle3 (default: $EAGLE3_VLLM_PYTHON, else .venv-vllm/bin/python from "
                   "bash scripts/vllm_env.sh)")
    p.add_argument("--vllm-eager", action="store_true", help="vLLM with enforce_eager (default: "
                   "compiled; compilation is start-up time, reported apart)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--quick", action="store_true", help="3 prompts, 32 new tokens")
    p.add_argument("--tune", action="store_true", help="measure tree shapes, print the best")
    p.add_argument("--tune-shapes", default=None, help="'K,D,N[,P];K,D,N[,P]' for --tune (K=1: chain, "
                   "P: min_prob)")
    p.add_argument("--no-roofline", action="store_true", help="skip the memory-bound comparison")
    p.add_argument("--out", default="runs/bench", help="directory for bench.json and the plots")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--from-json", default=None, metavar="BENCH_JSON",
                   help="print the table and redraw the plots of a saved run (into --out)")
    return p.parse_args(argv)


def config_from(args: argparse.Namespace) -> BenchConfig:
    preset = TUNE if args.tune else QUICK if args.quick else {}
    temps = tuple(float(t) for t in (args.temperatures or "0,1").split(",") if t.strip())
    run = replace(run_config_from_args(args), threads=args.threads or available_cores())
    systems = tuple(s.strip() for s in args.systems.split(",")) if args.systems else None
    if args.tune:
        systems, temps = ("ours-*",), temps[:1] if args.temperatures else (0.0,)
    return BenchConfig(model=args.model, draft=args.draft,
                       prompts=args.prompts or preset.get("prompts", 80),
                       max_new_tokens=args.max_new_tokens or preset.get("max_new_tokens", 256),
                       temperatures=temps, seed=args.seed, run=run,
                       chain_depth=args.chain_depth, tree=parse_shape(args.tree) if args.tree else SpecParams(),
                       prompt_lookup=args.prompt_lookup, systems=systems,
                       ignore_eos=args.ignore_eos, max_model_len=args.max_model_len,
                       clock=args.clock,
                       workload=args.workload, vllm_python=args.vllm_python, vllm_eager=args.vllm_eager,
                       out_dir=args.out)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def bench_main(argv: list[str]) -> int:
    if argv[:1] == ["serve"]:
        from .serving import main as serve_bench_main
        return serve_bench_main(argv[1:])
    args = parse_args(argv)
    if args.from_json:
        return replay(Path(args.from_json), Path(args.out), plots=not args.no_plots)
    cfg = config_from(args)
    setup = build(cfg, log=log)
    if args.tune:
        return tune_main(args, cfg, setup)
    if not setup.systems:
        raise InputError("no system to run: " + "; ".join(f"{n}: {r}" for n, r in setup.skipped))
    log(f"{len(setup.prompts)} prompts x {len(cfg.temperatures)} temperatures x "
        f"{len(setup.systems)} systems ({', '.join(s.name for s in setup.systems)}), "
        f"{cfg.max_new_tokens} new tokens, {cfg.threads} threads")
    load_before = busy_warning(cfg.threads)
    t0 = time.time()
    records, peaks, failed = run(cfg, setup, progress=not args.no_progress)
    peak_dict = {"rss": peaks.rss, "child_rss": peaks.child_rss, "gpu": peaks.gpu,
                 "load_mb": setup.load_rss_mb}
    rows = summarize(records, setup.depths, peak_dict)
    ids = identities(records)
    roof = None if args.no_roofline else measure_roofline(setup, cfg)
    row_roof = None if args.no_roofline else measure_rows(setup.target, clock=clock_of(cfg))
    print(f"workload: {workload_text(cfg, len(setup.prompts))}")
    print_report(setup.skipped, rows, records, ids, failed, roof)
    if row_roof is not None:
        print(row_roof.text())
    if setup.startup:
        print(startup_text(setup.startup))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = run_meta(argv, cfg, setup, time.time() - t0, load_before)
    extra = {"skipped": setup.skipped, "failed": failed, "startup": setup.startup,
             "peaks_bytes": peak_dict, "roofline": roof, "row_roofline": row_roof}
    save_json(out / "bench.json", meta, rows, records, ids, extra)
    plots = [] if args.no_plots else save_plots(out, rows, records)
    log(f"wrote {out / 'bench.json'}" + "".join(f", {p}" for p in plots))
    broken = [i for i in ids if i.reference == "ours-plain" and i.system.startswith("ours-")
              and i.identical != i.compared]
    for i in broken:
        print(f"MISMATCH: {i.system} greedy output differs from plain decoding on "
              f"{i.compared - i.identical}/{i.compared} prompts")
    return 1 if broken else 0


def startup_text(startup: dict[str, dict]) -> str:
    """Start-up of the child-process systems (loading, compilation): never in their tokens/s."""
    return "\n".join(f"start-up {name}: {s['startup_s']:.1f} s ({s['version']}; not counted)"
                     for name, s in startup.items())


def replay(path: Path, out: Path, plots: bool = True) -> int:
    """Table and plots from a saved bench.json (the identity check is the one saved)."""
    from .stats import Identity
    doc = json.loads(path.read_text())
    records = [Record.from_json(r) for r in doc["records"]]
    depths = {r["system"]: len(r["acceptance"]) for r in doc["summary"] if r.get("acceptance")}
    rows = summarize(records, depths, doc.get("peaks_bytes", {}))
    print(f"# {doc['meta']['command']}  ({doc['meta']['date']}, {doc['meta']['machine']['cpu']})")
    print(f"workload: {doc['meta'].get('workload', 'not recorded')}")
    skipped = [tuple(x) for x in doc.get("skipped", [])]
    print_report(skipped, rows, records, [Identity(**i) for i in doc["identity"]],
                 doc.get("failed", {}), None)
    if doc.get("roofline"):
        print(Roofline(**doc["roofline"]).text())
    if doc.get("row_roofline"):
        print(RowRoof(**doc["row_roofline"]).text())
    if plots:
        out.mkdir(parents=True, exist_ok=True)
        log("wrote " + ", ".join(str(p) for p in save_plots(out, rows, records)))
    return 0


def run_meta(argv: list[str], cfg: BenchConfig, setup, elapsed_s: float, load_before: float) -> dict:
    return {"command": "eagle3 bench " + shlex.join(argv), "config": to_jsonable(cfg),
            "elapsed_s": elapsed_s, "date": time.strftime("%Y-%m-%d %H:%M"),
            "machine": machine_info(setup.systems[0].device),
            "load_avg_1min": {"before": load_before, "after": os.getloadavg()[0]},
            "workload": workload_text(cfg, len(setup.prompts)), "layouts": layouts(setup.systems)}


def layouts(systems) -> dict:
    """What our target's and draft's linears ran ("gguf:Q4_1+Q8_0, int8 dot", "q4", ...) and the target's
    KV cache elements."""
    out = {}
    for system in systems:
        engine = getattr(system, "engine", None)
        for role in ("target", "draft"):
            name = getattr(getattr(engine, role, None), "weights_name", None)
            if name is not None:
                out.setdefault(role, name)
        kv = getattr(getattr(engine, "target", None), "kv_dtype", None)
        if kv is not None:
            out.setdefault("target_kv_cache", str(kv).removeprefix("torch."))
    return out


def workload_text(cfg: BenchConfig, num_prompts: int) -> str:
    return (f"{DESCRIPTIONS[cfg.workload]}, {num_prompts} prompts, chat template, "
            f"{cfg.max_new_tokens} new tokens, temperatures {list(cfg.temperatures)}")


def busy_warning(threads: int) -> float:
    """Warn when other jobs hold the CPUs: figures get noisy, and llama.cpp's spinning thread
    pool slows down sharply when it has more threads than there are free cores."""
    load, cores = os.getloadavg()[0], available_cores()
    if load > 0.5 * cores:
        log(f"WARNING: load average {load:.1f} on {cores} cores: other jobs are running; figures "
            f"will be noisy" + (f" and --threads {threads} > free cores penalises llama.cpp most "
                                f"(try --threads 1)" if threads > 1 else ""))
    return load


def clock_of(cfg: BenchConfig):
    return time.process_time if cfg.clock == "cpu" else time.perf_counter


def measure_roofline(setup, cfg: BenchConfig):
    from .roofline import measure
    return measure(setup.target, setup.weight_bytes, clock=clock_of(cfg))


def print_report(skipped, rows, records, ids, failed, roof) -> None:
    print(table(rows))
    print("tok/s: median over prompts [IQR], agg = all tokens / all seconds; x B: per-prompt "
          "tokens/s ratio to B at the same temperature, median [IQR]")
    text = acceptance_text(rows)
    if text:
        print(text)
    text = tree_vs_chain_text(rows, records)
    if text:
        print(text)
    text = policy_time_text(records)
    if text:
        print(text)
    if ids:
        print(identity_text(ids))
    for name, reason in skipped:
        print(f"skipped {name}: {reason}")
    for name, reason in failed.items():
        print(f"FAILED {name}: {reason}")
    if roof is not None:
        print(roof.text())


def tune_main(args: argparse.Namespace, cfg: BenchConfig, setup) -> int:
    from .roofline import verify_costs
    from .tune import costs_text, parse_shapes, tune, tune_text
    if not any(getattr(s, "speculative", False) for s in setup.systems):
        raise InputError("--tune needs a draft: " + "; ".join(r for _, r in setup.skipped))
    shapes = parse_shapes(args.tune_shapes)
    log(f"tuning {len(shapes)} shapes on {len(setup.prompts)} prompts, {cfg.max_new_tokens} "
        f"tokens, temperature {cfg.temperatures[0]:g}")
    costs = verify_costs(setup.target, clock=clock_of(cfg))
    print(costs_text(costs))
    rows = tune(cfg, setup, shapes, progress=not args.no_progress)
    print(tune_text(rows))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"config": to_jsonable(cfg), "verify_ms": costs,
           "rows": [{**to_jsonable(r), "label": r.label} for r in rows]}
    (out / "tune.json").write_text(json.dumps(doc, indent=1) + "\n")
    return 0
