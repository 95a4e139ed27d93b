"""vLLM's captured features against this process's own, per layer, on real conversations.

    python tools/vllm_features_check.py --data runs/data/conversations.jsonl --n 20 --dtype float32

Runs the target in vLLM (the venv of scripts/vllm_env.sh) under `extract_hidden_states` with our
connector (eagle3/train/vllm_connector.py) at the draft's default ids + L, reads the files back
(train/vllm_features.py), and compares with the target run here in fp32 (train/features.py):
each aux layer, the final normed hidden state (the teacher) and the argmax agreement. Prints one
table: max abs and max rel difference per layer (rel = max |vLLM - ours| / max |ours| per
conversation, then the max over conversations; the residual stream's scale varies by token, so a
plain elementwise ratio is meaningless), and the median over conversations. --json saves it.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from eagle3.bench.vllm_peer import VllmSettings, child_env, default_python
from eagle3.runtime.loader import load_model, resolve_model
from eagle3.train.features import load_conversations, target_features
from eagle3.train.vllm_features import (capture_features, check_layer_ids, check_numbering,
                                        read_capture, read_index, run_vllm_capture, typical_rel, vllm_layer_ids)


def compare(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float, float]:
    """(max abs, max rel, typical rel) of vLLM's rows `a` against ours `b`."""
    a, b = a.float(), b.float()
    diff = (a - b).abs().max()
    return float(diff), float(diff / b.abs().max().clamp_min(1e-12)), typical_rel(a, b)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--target", default=None)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="vLLM's dtype")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("runs/vllm_features_check"))
    ap.add_argument("--python", type=Path, default=None, help="the vLLM venv's python")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--reuse", action="store_true", help="read the captures of an earlier run of the same --out")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    src = resolve_model(args.target)
    target = load_model(src.hf_dir)
    samples = load_conversations(args.data, args.max_len)[:args.n]
    aux_ids = tuple(target.config.default_aux_layer_ids)
    ids = vllm_layer_ids(aux_ids, target.config.num_layers)
    s = VllmSettings(python=args.python or default_python(), work_dir=args.out.resolve(), threads=args.threads,
                     dtype=args.dtype, enforce_eager=True, max_model_len=args.max_len + 16, chain_depth=1)
    t0 = time.time()
    capture_dir = args.out / f"captures-{args.dtype}"
    if args.reuse:
        files = read_index(capture_dir.resolve())[:len(samples)]
    else:
        files = run_vllm_capture(s.python, child_env(s, "capture"), src.hf_dir, [x.ids.tolist() for x in samples],
                                 ids, capture_dir, dtype=args.dtype, max_model_len=s.max_model_len)
    seconds = time.time() - t0
    names = [f"aux layer {i}" for i in aux_ids] + ["final normed hidden"]
    rows: dict[str, list[tuple[float, float, float]]] = {n: [] for n in names}
    agree = total = 0
    numbering = None
    h = target.config.hidden_size
    for sample, path in zip(samples, files):
        cap = read_capture(path, target.config.num_layers)
        check_layer_ids(cap, target, aux_ids)
        numbering = numbering or check_numbering(target, sample, cap, aux_ids)
        theirs = capture_features(target, sample, cap)
        ours = target_features(target, [sample], aux_ids)[0]
        for k, i in enumerate(aux_ids):
            rows[f"aux layer {i}"].append(compare(theirs.aux[:, k * h:(k + 1) * h], ours.aux[:, k * h:(k + 1) * h]))
        rows["final normed hidden"].append(compare(theirs.hidden, ours.hidden))
        agree += int((theirs.next_ids == ours.next_ids).sum())
        total += len(sample.ids)
    table = {n: {"max_abs": max(x[0] for x in v), "max_rel": max(x[1] for x in v),
                 "typical_rel": max(x[2] for x in v)} for n, v in rows.items()}
    print(f"vLLM {args.dtype} (CPU build, eager) vs this process fp32; {len(samples)} conversations, "
          f"{total} tokens, vLLM ids {ids}, capture run {seconds:.0f} s{' (reused)' if args.reuse else ''}")
    print(f"{'layer':<22}{'max abs':>12}{'max rel':>12}{'typical rel':>12}")
    for n, r in table.items():
        print(f"{n:<22}{r['max_abs']:>12.3g}{r['max_rel']:>12.3g}{r['typical_rel']:>12.3g}")
    print(f"argmax (teacher's next token) agreement: {agree}/{total} = {agree / total:.4f}")
    if args.json:
        args.json.write_text(json.dumps({"dtype": args.dtype, "conversations": len(samples), "tokens": total,
                                         "layer_ids": ids, "layers": table, "argmax_agreement": agree / total,
                                         "numbering_check": numbering}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
