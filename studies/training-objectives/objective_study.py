"""The training-objective study: one run per TTT objective (eagle3/train/objectives.py) at a fixed token
budget, same data order, same held-out conversations, same seed, all reading one offline feature
store; a second seed of the baseline measures the seed noise; then MT-bench tau of each row's draft.

    python studies/training-objectives/objective_study.py --out runs/objective --prepare     # split + store
    nohup python studies/training-objectives/objective_study.py --out runs/objective --budget 100000 \\
        > runs/objective/study.log 2>&1 &
    python studies/training-objectives/objective_study.py --out runs/objective --report \\
        studies/training-objectives/objective_study.md                                       # table only

The data are the recipe study's (studies/training-recipes): of runs/data/conversations.jsonl, every
33rd (index % 33 == 32, 53 conversations) is held out and the first 704 others are the training set;
`--prepare` writes both files and builds their store parts (the manifests' sample hashes equal
studies/training-recipes/store_regen_train-*.json and store_heldout-*.json). Rows run in order, one
process each (`python -m eagle3.train`), then scripts/measure_tau.py on the row's exported draft
(fixed tree 4/5/8/0.05, EAGLE only, no suffix nodes); every stage resumes: a finished row or tau file
is kept, a stopped row continues from its checkpoint.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
TREE = "4,5,8,0.05"

# today's default recipe (TTT 3, equal weights, peak lr 1e-3: the recipe study's row k), from scratch
BASE = {
    "target": "smollm2", "features": "store", "draft_vocab_size": 12288, "ttt_steps": 3, "step_decay": 1.0,
    "max_len": 512, "batch_size": 4, "lr": 1e-3, "warmup_steps": 10, "min_lr_ratio": 0.05,
    "schedule": "cosine", "optimizer": "adamw", "autocast": "bf16", "fc_precondition": True, "seed": 6,
    "eval_every": 30, "checkpoint_every_s": 120.0, "threads": 2, "objective": "kl",
}
# name: (what, overrides); the baseline's second seed runs second so the noise is known early
ROWS: dict[str, tuple[str, dict]] = {
    "a_kl": ("KL / soft cross-entropy (today)", {}),
    "a_kl_seed7": ("KL, seed 7 (seed noise)", {"seed": 7}),
    "b_lk": ("LK: exp(-3 mean alpha) KL + (1 - that) TV", {"objective": "lk"}),
    "c_hass": ("HASS: + top-10 distillation (w 1)", {"objective": "hass"}),
    "d_griffin": ("GRIFFIN: drop rows after a top-4 miss", {"objective": "griffin"}),
    # a second seed of every objective (paired with a_kl_seed7) and a third of the baseline
    "c_hass_seed7": ("HASS, seed 7", {"objective": "hass", "seed": 7}),
    "b_lk_seed7": ("LK, seed 7", {"objective": "lk", "seed": 7}),
    "d_griffin_seed7": ("GRIFFIN, seed 7", {"objective": "griffin", "seed": 7}),
    "a_kl_seed8": ("KL, seed 8 (seed noise)", {"seed": 8}),
    "d_griffin_seed8": ("GRIFFIN, seed 8", {"objective": "griffin", "seed": 8}),
    "c_hass_seed8": ("HASS, seed 8", {"objective": "hass", "seed": 8}),
    "b_lk_seed8": ("LK, seed 8", {"objective": "lk", "seed": 8}),
}
BASELINE, NOISE = "a_kl", "a_kl_seed7"


# ---------------------------------------------------------------------------- data and store
def prepare(out: Path, conversations: Path, threads: int) -> None:
    """Held-out / training split of the recipe study, then their store parts (built once, resumable)."""
    out.mkdir(parents=True, exist_ok=True)
    lines = [l for l in conversations.read_text(encoding="utf-8").splitlines() if l.strip()]
    held = [l for i, l in enumerate(lines) if i % 33 == 32]
    train = [l for i, l in enumerate(lines) if i % 33 != 32][:704]
    for name, rows in (("heldout.jsonl", held), ("regen_train.jsonl", train)):
        if not (out / name).is_file():
            (out / name).write_text("\n".join(rows) + "\n", encoding="utf-8")
    cmd = [sys.executable, str(REPO / "scripts" / "cache_features.py"), "--data", str(out / "regen_train.jsonl"),
           str(out / "heldout.jsonl"), "--root", str(out / "features"), "--threads", str(threads)]
    subprocess.check_call(cmd, cwd=REPO, env=env())


# ---------------------------------------------------------------------------- rows
def env() -> dict[str, str]:
    # this checkout's eagle3 first, whatever the interpreter has installed
    path = os.pathsep.join([str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


def child_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_row(name: str, out: Path, budget: int) -> int:
    row = out / name
    row.mkdir(parents=True, exist_ok=True)
    cfg = {**BASE, "data": [str(out / "regen_train.jsonl")], "eval_data": str(out / "heldout.jsonl"),
           **ROWS[name][1], "out": str(row), "features_dir": str(out / "features"), "max_tokens": budget}
    (row / "study_config.json").write_text(json.dumps(cfg, indent=2))
    if (row / "done.json").is_file():
        return 0
    cmd = [sys.executable, "-m", "eagle3.train", "--config", str(row / "study_config.json")]
    t0, cpu0 = time.time(), child_cpu_s()
    with open(row / "train.out", "a") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env())
    if rc == 0:   # a resumed row's seconds are those of its last process only (the log's step_s are all)
        (row / "done.json").write_text(json.dumps({"wall_s": round(time.time() - t0, 1),
                                                   "cpu_s": round(child_cpu_s() - cpu0, 1),
                                                   "command": " ".join(cmd)}))
    return rc


def tau_row(name: str, out: Path, prompts: int, tokens: int, threads: int, file: str = "tau.json") -> int:
    row = out / name
    if (row / file).is_file() or not (row / "draft").is_dir():
        return 0
    cmd = [sys.executable, str(REPO / "scripts" / "measure_tau.py"), "--draft", str(row / "draft"), "--n",
           str(prompts), "--max-new-tokens", str(tokens), "--temperatures", "0,1", "--tree", TREE,
           "--threads", str(threads), "--out", str(row / f"{file}.part")]
    with open(row / "tau.out", "a") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env())
    if rc == 0:
        (row / f"{file}.part").rename(row / file)
    return rc


# ---------------------------------------------------------------------------- report
def summarize(out: Path, name: str) -> dict | None:
    log = out / name / "train_log.jsonl"
    if not log.is_file():
        return None
    recs = [json.loads(l) for l in log.read_text().splitlines() if l.strip()]
    steps = [r for r in recs if "loss" in r]
    evals = [r for r in recs if "eval" in r]
    if not evals:
        return None
    done = out / name / "done.json"
    tau = out / name / "tau.json"
    by = {x["temperature"]: x for x in json.loads(tau.read_text())["results"]} if tau.is_file() else {}
    return {"row": name, "what": ROWS[name][0], "done": done.is_file(),
            "seed": json.loads((out / name / "study_config.json").read_text())["seed"],
            "objective": json.loads((out / name / "study_config.json").read_text())["objective"],
            "steps": steps[-1]["step"] if steps else 0, "tokens": sum(r["tokens"] for r in steps),
            "step_s": sum(r["step_s"] for r in steps),
            "cpu_s": json.loads(done.read_text()).get("cpu_s") if done.is_file() else None,
            "acc": evals[-1]["eval"]["acc"], "est_tau": evals[-1]["eval"]["est_tau"],
            "tau0": by.get(0.0, {}).get("tau"), "tau1": by.get(1.0, {}).get("tau"),
            "tau_shape": (by[0.0]["prompts"], json.loads(tau.read_text())["max_new_tokens"]) if by else None,
            "curve": [(e["step"], e["eval"]["acc"][0], e["eval"]["est_tau"]) for e in evals]}


def fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def delta(r: dict, base: dict | None, key: str) -> str:
    if not base or r is base or r[key] is None or base[key] is None:
        return ""
    return f"{r[key] - base[key]:+.3f}"


BEGIN, END = "<!-- table: objective_study.py --report; edit outside these marks -->", "<!-- end of table -->"


def splice(doc: str, table: str) -> str:
    """The generated table replaces the one between the marks; written notes around it stay."""
    block = f"{BEGIN}\n{table}{END}\n\n"
    if BEGIN in doc and END in doc:
        head, rest = doc.split(BEGIN, 1)
        return head + block + rest.split(END, 1)[1].lstrip("\n")
    return block + doc


def full_tau(out: Path, rows: list[dict]) -> list[str]:
    found = [(r["row"], json.loads((out / r["row"] / "tau80.json").read_text())) for r in rows
             if (out / r["row"] / "tau80.json").is_file()]
    if not found:
        return []
    lines = ["", "All 80 MT-bench first turns x 256 tokens (`--full-tau`), same tree:", "",
             "| row | T=0 | T=1 | accepted per position T=0 |", "|---|---|---|---|"]
    for name, t in found:
        by = {x["temperature"]: x for x in t["results"]}
        lines.append(f"| {name} | {by[0.0]['tau']:.3f} | {by[1.0]['tau']:.3f} | "
                     f"{' / '.join(str(a) for a in by[0.0]['accept_per_position'][:3])} |")
    return lines


def objective_means(rows: list[dict]) -> list[str]:
    """Per objective, the mean over its seeds against kl's mean over the same seeds (paired: a seed is
    one data order and one set of initial weights); kl's spread over all its seeds is the noise."""
    groups: dict[str, dict[int, dict]] = {}
    for r in rows:
        if r["done"] and r["tau0"] is not None:
            groups.setdefault(r["objective"], {})[r["seed"]] = r
    kl = groups.get("kl", {})
    if len(kl) < 2:
        return []
    keys = ("est_tau", "tau0", "tau1")
    spread = {k: max(r[k] for r in kl.values()) - min(r[k] for r in kl.values()) for k in keys}
    lines = ["", f"Per objective, the mean over its seeds against kl's mean over the same seeds; kl's spread "
             f"(max - min) over its {len(kl)} seeds ({', '.join(map(str, sorted(kl)))}) is the noise: est. tau "
             f"{spread['est_tau']:.3f}, MT-bench T=0 {spread['tau0']:.3f}, T=1 {spread['tau1']:.3f}.", "",
             "| objective | seeds | est. tau | vs kl | MT-bench T=0 | vs kl | T=1 | vs kl "
             "| paired T=0 / T=1 per seed |",
             "|---|---|---|---|---|---|---|---|---|"]
    wins = []
    for obj, by_seed in groups.items():
        seeds = sorted(set(by_seed) & set(kl))
        if len(seeds) < 2:
            continue
        m = {k: sum(by_seed[s][k] for s in seeds) / len(seeds) for k in keys}
        d = {k: m[k] - sum(kl[s][k] for s in seeds) / len(seeds) for k in keys}
        show = {k: "" if obj == "kl" else f"{d[k]:+.3f}" for k in keys}
        paired = "" if obj == "kl" else ", ".join(
            f"{by_seed[s]['tau0'] - kl[s]['tau0']:+.3f} / {by_seed[s]['tau1'] - kl[s]['tau1']:+.3f}" for s in seeds)
        lines.append(f"| {obj} | {', '.join(map(str, seeds))} | {m['est_tau']:.3f} | {show['est_tau']} | "
                     f"{m['tau0']:.3f} | {show['tau0']} | {m['tau1']:.3f} | {show['tau1']} | {paired} |")
        if obj != "kl" and d["tau0"] > spread["tau0"] and d["tau1"] > spread["tau1"]:
            wins.append(obj)
    lines += ["", "Objectives whose mean beats kl's on the same seeds by more than kl's seed spread on MT-bench "
              f"tau at both temperatures: {', '.join(wins) if wins else 'none'}."]
    return lines


def report(out: Path, budget: int, path: Path | None) -> str:
    rows = [s for s in (summarize(out, n) for n in ROWS) if s]
    by = {r["row"]: r for r in rows}
    base, noise = by.get(BASELINE), by.get(NOISE)
    shape = next((r["tau_shape"] for r in rows if r["tau_shape"]), None)
    lines = [f"# Training-objective study: SmolLM2-135M, {budget:,} training tokens per row", "",
             "Today's recipe (TTT 3, equal step weights, peak lr 1e-3, batch 4, Vd 12288, bf16 autocast, "
             "AdamW, fc preconditioned) from scratch, one row per objective (eagle3/train/objectives.py). "
             "Same data order and initial weights (seed 6; the seed rows: 7 and 8, which change both), "
             "704 regenerated training conversations, the same 53 held-out ones (every 33rd of runs/data), "
             "features from one offline store, 2 threads. Held-out accuracy per TTT step is teacher-forced "
             "argmax agreement (the same for every objective); est. tau = 1 + sum of chained step "
             "accuracies. MT-bench tau: scripts/measure_tau.py on the row's exported draft, "
             f"{'%d prompts x %d tokens' % shape if shape else '-'}, fixed tree {TREE} (top-k, depth, "
             "draft tokens, min prob), EAGLE draft alone (no suffix nodes, no adaptive step). "
             "CPU s: user + system seconds of the training process (2 threads, shared cores: both it and "
             "step s, the summed wall time of the training steps, grow when other work takes the cores).", "",
             "| row | objective | seed | tokens | CPU s | step s | step-0 acc | step-1 | step-2 | est. tau | "
             "MT-bench tau T=0 | T=1 | vs kl, same seed, T=0 / T=1 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    kl_of = {r["seed"]: r for r in rows if r["objective"] == "kl"}
    for r in rows:
        acc = r["acc"] + [float("nan")] * 3
        b = kl_of.get(r["seed"])
        vs = f"{delta(r, b, 'tau0')} / {delta(r, b, 'tau1')}" if b and r is not b and r["tau0"] else ""
        lines.append(f"| {r['row']}{'' if r['done'] else ' (running)'} | {r['what']} | {r['seed']} | "
                     f"{r['tokens']:,} | {fmt(r['cpu_s'], '.0f')} | {r['step_s']:.0f} | {acc[0]:.4f} | {acc[1]:.4f} | "
                     f"{acc[2]:.4f} | {r['est_tau']:.3f} | {fmt(r['tau0'], '.3f')} | {fmt(r['tau1'], '.3f')} | "
                     f"{vs} |")
    if base and noise:
        n0 = abs(noise["tau0"] - base["tau0"]) if noise["tau0"] and base["tau0"] else None
        n1 = abs(noise["tau1"] - base["tau1"]) if noise["tau1"] and base["tau1"] else None
        lines += ["", f"Seed noise (|a_kl - a_kl_seed7|): est. tau {abs(noise['est_tau'] - base['est_tau']):.3f}, "
                  f"step-0 acc {abs(noise['acc'][0] - base['acc'][0]):.4f}, MT-bench tau T=0 {fmt(n0, '.3f')}, "
                  f"T=1 {fmt(n1, '.3f')}."]
        beats = [r["row"] for r in rows if r["objective"] != "kl" and r["seed"] in kl_of
                 and None not in (n0, n1, r["tau0"], r["tau1"], kl_of[r["seed"]]["tau0"])
                 and r["tau0"] - kl_of[r["seed"]]["tau0"] > n0 and r["tau1"] - kl_of[r["seed"]]["tau1"] > n1]
        lines.append("Rows above kl at the same seed by more than that noise at both temperatures: "
                     f"{', '.join(beats) if beats else 'none'}.")
    lines += objective_means(rows) + full_tau(out, rows)
    lines += ["", "Curves (step, held-out step-0 acc, est. tau):", ""]
    lines += [f"- {r['row']}: " + ", ".join(f"({s}, {a:.3f}, {t:.3f})" for s, a, t in r["curve"]) for r in rows]
    text = "\n".join(lines) + "\n"
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(splice(path.read_text() if path.is_file() else "", text))
        for r in rows:                       # the small tau files travel with the report
            for file in ("tau.json", "tau80.json"):
                if (out / r["row"] / file).is_file():
                    shutil.copyfile(out / r["row"] / file, path.parent / f"{Path(file).stem}_{r['row']}.json")
    return text


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("runs/objective"))
    ap.add_argument("--conversations", type=Path, default=Path("runs/data/conversations.jsonl"))
    ap.add_argument("--prepare", action="store_true", help="write the split and build the store, then stop")
    ap.add_argument("--budget", type=int, default=100_000, help="training tokens per row")
    ap.add_argument("--rows", default=",".join(ROWS), help="comma list of rows to run, in order")
    ap.add_argument("--tau-prompts", type=int, default=40, help="MT-bench first turns (of 80)")
    ap.add_argument("--tau-tokens", type=int, default=128, help="new tokens per prompt")
    ap.add_argument("--full-tau", default=None, metavar="ROWS",
                    help="only MT-bench tau on all 80 prompts x 256 tokens for these finished rows (tau80.json)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--report", type=Path, default=None, help="only write the table from the logs")
    args = ap.parse_args(argv)
    out = args.out.resolve()
    if args.report:
        print(report(out, args.budget, args.report))
        return 0
    if args.prepare:
        prepare(out, args.conversations.resolve(), args.threads)
        return 0
    if args.full_tau:
        for name in args.full_tau.split(","):
            t0 = time.time()
            rc = tau_row(name, out, 80, 256, args.threads, "tau80.json")
            print(f"{time.strftime('%H:%M:%S')} {name}: tau 80 x 256 rc {rc}, {time.time() - t0:.0f} s", flush=True)
        return 0
    for name in args.rows.split(","):
        if name not in ROWS:
            raise SystemExit(f"unknown row {name!r}; rows: {', '.join(ROWS)}")
        t0 = time.time()
        rc = run_row(name, out, args.budget)
        s = summarize(out, name)
        print(f"{time.strftime('%H:%M:%S')} {name}: train rc {rc}, {time.time() - t0:.0f} s, "
              f"{json.dumps({k: s[k] for k in ('acc', 'est_tau', 'tokens')} if s else None)}", flush=True)
        if rc:
            continue
        t0 = time.time()
        rc = tau_row(name, out, args.tau_prompts, args.tau_tokens, args.threads)
        s = summarize(out, name)
        print(f"{time.strftime('%H:%M:%S')} {name}: tau rc {rc}, {time.time() - t0:.0f} s, "
              f"T=0 {s and s['tau0']}, T=1 {s and s['tau1']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
