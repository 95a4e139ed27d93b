"""The draft-quality recipe study: one training run per recipe at a fixed token budget, same data
order, same held-out conversations, same seed, all reading one offline feature store.

    nohup python studies/training-recipes/recipe_study.py --out runs/study --budget 150000 > runs/study/study.log 2>&1 &
    python studies/training-recipes/recipe_study.py --out runs/study \
        --report studies/training-recipes/recipe_study.md                       # table only

Rows run in order, one process each (`python -m eagle3.train`), and resume: a finished row is kept, a
stopped one continues from its checkpoint. The table reads each run's log: held-out accuracy per
step and the chain estimate of tau at the end, tokens/s of the training steps.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# today's recipe (the shipped draft's phase-6 settings, from scratch): row (a)
BASE = {
    "target": "smollm2", "data": ["runs/study/regen_train.jsonl"], "eval_data": "runs/study/heldout.jsonl",
    "features": "store", "draft_vocab_size": 12288, "ttt_steps": 7, "step_decay": 0.8, "max_len": 512,
    "batch_size": 4, "lr": 3e-4, "warmup_steps": 10, "min_lr_ratio": 0.05, "schedule": "cosine",
    "optimizer": "adamw", "autocast": "bf16", "fc_precondition": True, "seed": 6, "eval_every": 30,
    "checkpoint_every_s": 120.0, "threads": 2,
}
ROWS: dict[str, tuple[str, dict]] = {
    "a_today": ("today's recipe", {}),
    "b_frozen_head": ("lm_head = target rows, frozen", {"freeze_lm_head": True}),
    "c_eagle31_norms": ("norm before fc + norm_output", {"norm_before_fc": True, "norm_output": True}),
    "d_ttt3_equal": ("TTT length 3, equal step weights", {"ttt_steps": 3, "step_decay": 1.0}),
    "e_lr1e-3": ("peak lr 1e-3", {"lr": 1e-3}),
    "e_muon": ("Muon on 2-D weights (fc, midlayer)", {"optimizer": "muon", "fc_precondition": False}),
    "f_noise": ("feature noise 0.05 x row RMS", {"feature_noise": 0.05}),
    "g_layer_init": ("midlayer from target layer 29", {"init_layer_from": 29}),
    "h_mix": ("regenerated + ShareGPT replies (today's mix)",
              {"data": ["runs/study/regen_train.jsonl", "runs/study/sharegpt/conversations.jsonl"]}),
    "i_vocab8k": ("draft vocabulary 8192", {"draft_vocab_size": 8192}),
    "i_vocab16k": ("draft vocabulary 16384", {"draft_vocab_size": 16384}),
    "j_two_layers": ("two decoder layers (midlayer + a Llama layer)", {"draft_layers": 2}),
    "k_ttt3_lr1e-3": ("TTT 3 equal weights + peak lr 1e-3 (the two best single changes)",
                      {"ttt_steps": 3, "step_decay": 1.0, "lr": 1e-3}),
}


def run_row(name: str, out: Path, budget: int, features: Path) -> int:
    row = out / name
    row.mkdir(parents=True, exist_ok=True)
    cfg = {**BASE, **ROWS[name][1], "out": str(row), "features_dir": str(features), "max_tokens": budget}
    (row / "study_config.json").write_text(json.dumps(cfg, indent=2))
    if (row / "done.json").is_file():
        return 0
    cmd = [sys.executable, "-m", "eagle3.train", "--config", str(row / "study_config.json")]
    t0 = time.time()
    with open(row / "train.out", "a") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if rc == 0:
        (row / "done.json").write_text(json.dumps({"wall_s": round(time.time() - t0, 1), "command": " ".join(cmd)}))
    return rc


def summarize(out: Path, name: str) -> dict | None:
    log = out / name / "train_log.jsonl"
    if not log.is_file():
        return None
    recs = [json.loads(l) for l in log.read_text().splitlines() if l.strip()]
    steps = [r for r in recs if "loss" in r]
    evals = [r for r in recs if "eval" in r]
    if not evals:
        return None
    last = evals[-1]["eval"]
    tokens = sum(r["tokens"] for r in steps)
    return {"row": name, "what": ROWS[name][0], "done": (out / name / "done.json").is_file(),
            "steps": steps[-1]["step"] if steps else 0, "tokens": tokens,
            "tokens_per_s": round(tokens / max(1e-9, sum(r["step_s"] for r in steps)), 1),
            "acc": last["acc"], "est_tau": last["est_tau"],
            "curve": [(e["step"], e["eval"]["acc"][0], e["eval"]["est_tau"]) for e in evals]}


def report(out: Path, budget: int, path: Path) -> str:
    rows = [s for s in (summarize(out, n) for n in ROWS) if s]
    base = next((r for r in rows if r["row"] == "a_today"), None)
    lines = [f"# Draft recipe study: SmolLM2-135M, {budget:,} training tokens per row", "",
             "Same data order (seed 6), same 53 held-out regenerated conversations (every 33rd of "
             "runs/data), features from one offline store (bf16), 2 threads, batch 4, bf16 autocast. "
             "Held-out accuracy per TTT step (teacher-forced; step k = k-th draft token given the "
             "previous ones were right) and est. tau = 1 + sum of chained step accuracies.", "",
             "| row | recipe | steps | tokens | tok/s | step-0 acc | step-1 | step-2 | est. tau | vs (a) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        acc = r["acc"] + [float("nan")] * 3
        delta = f"{r['est_tau'] - base['est_tau']:+.3f}" if base and r is not base else ""
        lines.append(f"| {r['row']}{'' if r['done'] else ' (running)'} | {r['what']} | {r['steps']} | "
                     f"{r['tokens']:,} | {r['tokens_per_s']} | {acc[0]:.4f} | {acc[1]:.4f} | {acc[2]:.4f} | "
                     f"{r['est_tau']:.3f} | {delta} |")
    taus = [(r["row"], json.loads((out / r["row"] / "tau.json").read_text())) for r in rows
            if (out / r["row"] / "tau.json").is_file()]
    if taus:
        lines += ["", "MT-bench tau (scripts/measure_tau.py on the row's exported draft; its command in "
                  "each tau.json):", "", "| row | prompts x tokens | tree | T=0 | T=1 |", "|---|---|---|---|---|"]
        for name, t in taus:
            by = {x["temperature"]: x for x in t["results"]}
            n = t["results"][0]["prompts"]
            lines.append(f"| {name} | {n} x {t['max_new_tokens']} | {t['spec']} | "
                         f"{by.get(0.0, {}).get('tau', '-')} | {by.get(1.0, {}).get('tau', '-')} |")
    lines += ["", "Curves (step, held-out step-0 acc, est. tau):", ""]
    lines += [f"- {r['row']}: " + ", ".join(f"({s}, {a:.3f}, {t:.3f})" for s, a, t in r["curve"]) for r in rows]
    text = "\n".join(lines) + "\n"
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return text


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("runs/study"))
    ap.add_argument("--features", type=Path, default=Path("runs/study/features"))
    ap.add_argument("--budget", type=int, default=150_000, help="training tokens per row")
    ap.add_argument("--rows", default=",".join(ROWS), help="comma list of rows to run, in order")
    ap.add_argument("--report", type=Path, default=None, help="only write the table from the logs")
    args = ap.parse_args(argv)
    if args.report:
        print(report(args.out, args.budget, args.report))
        return 0
    for name in args.rows.split(","):
        if name not in ROWS:
            raise SystemExit(f"unknown row {name!r}; rows: {', '.join(ROWS)}")
        t0 = time.time()
        rc = run_row(name, args.out, args.budget, args.features)
        s = summarize(args.out, name)
        print(f"{time.strftime('%H:%M:%S')} {name}: rc {rc}, {time.time() - t0:.0f} s, "
              f"{json.dumps({k: s[k] for k in ('acc', 'est_tau', 'tokens_per_s')} if s else None)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
