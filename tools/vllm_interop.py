"""vLLM as the proof of our export (not a CI test).

Exports the shipped draft in both layouts vLLM loads (speculators, SpecForge), serves each in vLLM
(the vLLM venv of bash scripts/vllm_env.sh, through the bench's vllm child process) with a chain of
--chain draft tokens on N MT-bench first turns (the bench's own prompt ids, greedy), runs our engine
with the same chain on the same prompts (eagle3.api, draft in the same precision), and compares:
  - acceptance per draft position and tau, vLLM's own per-request counts against ours;
  - greedy outputs token for token: fp32 (vLLM dtype float32 vs our fp32 weights; expected identical)
    and bf16 (vLLM bfloat16 vs our --weights bf16; informational: other kernels, other rounding).
Prints a table and writes interop.json under --out. A few minutes with the defaults on 2 cores.

    .venv/bin/python tools/vllm_interop.py --out runs/vllm-interop [--prompts 8 --max-new-tokens 64]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from eagle3.api import default_draft_path, load_engine
from eagle3.config import RunConfig
from eagle3.bench.stats import first_divergence
from eagle3.bench.systems import GenParams, OursSystem
from eagle3.bench.vllm_peer import INSTALL, VllmSettings, default_python, model_dir_for_vllm, start
from eagle3.bench.workload import make_prompts, workload_questions
from eagle3.draft.formats import load_draft
from eagle3.export.writer import export_draft, resolve_target
from eagle3.runtime.loader import load_tokenizer
from eagle3.speculative.step import acceptance_stats
from eagle3.speculative.tree import SpecParams

PRECISIONS = {"fp32": "float32", "bf16": "bfloat16"}     # ours --weights -> vLLM dtype
RUNS = (("speculators", "fp32"), ("specforge", "fp32"), ("speculators", "bf16"))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for the exports, vLLM's files and interop.json")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--chain", type=int, default=3, help="draft tokens per step (vLLM num_speculative_tokens)")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--vllm-python", default=None,
                   help="default: $EAGLE3_VLLM_PYTHON or .venv-vllm/bin/python")
    p.add_argument("--compiled", action="store_true", help="vLLM compiled (default enforce_eager: the "
                   "outputs and acceptance are compared, not the speed; compiling takes minutes)")
    return p.parse_args()


def exports(out: Path, chain: int) -> dict[str, Path]:
    target = resolve_target(None)
    draft, _ = load_draft(default_draft_path(None), target.config)
    return {fmt: export_draft(draft, out / "drafts" / fmt, fmt, target.config, target_path=target.path,
                              speculative_tokens=chain).path for fmt in ("speculators", "specforge")}


def run_all(system, prompts, params_of) -> list[dict]:
    out = []
    for p in prompts:
        res = system.run(p, params_of(p))
        out.append({"question_id": p.question_id, "tokens": res.tokens, "accept_lens": res.accept_lens,
                    "seconds": res.seconds})
    return out


def ours(prompts, chain: int, weights: str, max_new_tokens: int) -> tuple[list[dict], tuple[int, ...]]:
    engine = load_engine(None, "default", spec=SpecParams.chain(chain),
                         config=RunConfig(weights=weights, draft_weights=weights),
                         max_model_len=2048)
    stop_ids = tuple(sorted(engine.eos_ids))
    system = OursSystem(f"ours-chain{chain}", engine, speculative=True)
    params = lambda p: GenParams(0.0, max_new_tokens, p.seed, stop_ids)   # noqa: E731
    system.run(prompts[0], GenParams(0.0, 8, 0, stop_ids))                   # warm-up
    return run_all(system, prompts, params), stop_ids


def in_vllm(name: str, settings: VllmSettings, hf_dir: Path, draft_dir: Path, prompts, stop_ids,
            max_new_tokens: int) -> tuple[list[dict], float]:
    system, why = start(name, settings, hf_dir, draft_dir)
    if system is None:
        raise SystemExit(f"{name}: {why}")
    try:
        params = lambda p: GenParams(0.0, max_new_tokens, p.seed, stop_ids)   # noqa: E731
        return run_all(system, prompts, params), system.startup_s
    finally:
        system.child.close()


def summary(runs: list[dict], reference: list[dict], chain: int) -> dict:
    stats = acceptance_stats([n for r in runs for n in r["accept_lens"] or []], chain)
    same, divergences = 0, []
    for r, ref in zip(runs, reference):
        at = first_divergence(r["tokens"], ref["tokens"])
        same += at is None
        if at is not None:
            divergences.append((r["question_id"], at))
    return {"tau": stats.tau, "per_position": stats.per_position, "steps": stats.steps,
            "identical": same, "compared": len(runs), "divergences": divergences,
            "tokens": sum(len(r["tokens"]) for r in runs)}


def table(rows: list[dict], chain: int) -> str:
    head = f"{'system':<30} {'prec':>4} {'tau':>5} " + " ".join(f"{'p' + str(k):>5}" for k in
                                                              range(1, chain + 1)) \
        + f" {'steps':>5} {'greedy = ours':>14}  first divergence"
    lines = [head, "-" * len(head)]
    for r in rows:
        s = r["summary"]
        pos = " ".join(f"{a:>5.2f}" for a in s["per_position"])
        same = "-" if r["system"].startswith("ours") else f"{s['identical']}/{s['compared']}"
        div = ", ".join(f"q{q}@{at}" for q, at in s["divergences"][:6])
        lines.append(f"{r['system']:<30} {r['precision']:>4} {s['tau']:>5.2f} {pos} {s['steps']:>5} "
                     f"{same:>14}  {div}")
    return "\n".join(lines)


def main() -> int:
    args = parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    python = Path(args.vllm_python) if args.vllm_python else default_python()
    if not python.is_file():
        raise SystemExit(f"no vLLM python at {python}: {INSTALL}")
    torch.set_num_threads(args.threads)
    target = resolve_target(None)
    prompts = make_prompts(load_tokenizer(target.path), workload_questions("mtbench", args.prompts))
    drafts = exports(out, args.chain)
    model_dir = model_dir_for_vllm(Path(target.path), out / "vllm")
    rows, ours_runs, stop_ids = [], {}, ()
    for weights in PRECISIONS:
        t0 = time.perf_counter()
        ours_runs[weights], stop_ids = ours(prompts, args.chain, weights, args.max_new_tokens)
        print(f"ours-chain{args.chain} {weights}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        rows.append({"system": f"ours-chain{args.chain}", "precision": weights, "runs": ours_runs[weights]})
    for layout, weights in RUNS:
        name = f"vllm-eagle3-{layout}"
        settings = VllmSettings(python, out / "vllm" / weights, args.threads, PRECISIONS[weights],
                                not args.compiled, 2048, args.chain)
        runs, startup_s = in_vllm(name, settings, model_dir, drafts[layout], prompts, stop_ids,
                                  args.max_new_tokens)
        print(f"{name} {weights}: start-up {startup_s:.0f} s", file=sys.stderr)
        rows.append({"system": name, "precision": weights, "runs": runs, "startup_s": startup_s})
    for r in rows:
        r["summary"] = summary(r["runs"], ours_runs[r["precision"]], args.chain)
    print(f"{len(prompts)} MT-bench prompts, {args.max_new_tokens} new tokens, greedy, chain {args.chain}; "
          f"vLLM {'compiled' if args.compiled else 'enforce_eager'}")
    print(table(rows, args.chain))
    print("p_k: share of verify steps accepting >= k draft tokens; greedy = ours: prompts whose output is "
          "token-identical to ours-chain at the same precision (fp32 expected identical; bf16 informational)")
    (out / "interop.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1) + "\n")
    fp32 = [r for r in rows if r["precision"] == "fp32" and not r["system"].startswith("ours")]
    return 0 if all(r["summary"]["identical"] == r["summary"]["compared"] for r in fp32) else 1


if __name__ == "__main__":
    sys.exit(main())
