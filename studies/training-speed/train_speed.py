"""Training-step tokens/s, same batches, same code: features from the store vs online, bf16 vs fp32.

    python studies/training-speed/train_speed.py --data runs/study/regen_train.jsonl --features-dir runs/study/features
Each variant is a fresh `python -m eagle3.train` run of --steps steps (same seed, so the same
batches); tokens/s counts the steps after the first (warm-up; compilation happens there, and
recompilation for a new shape would count). Run it on quiet cores.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

VARIANTS = {"store, bf16 autocast": {"features": "store", "autocast": "bf16"},
            "online, bf16 autocast": {"features": "online", "autocast": "bf16"},
            "store, fp32": {"features": "store", "autocast": "none"},
            "store, bf16 autocast, torch.compile": {"features": "store", "autocast": "bf16", "compile": True}}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True)
    ap.add_argument("--features-dir", required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    rows = {}
    for name, over in VARIANTS.items():
        out = Path(tempfile.mkdtemp(prefix="eagle3-speed-"))
        cfg = {"target": "smollm2", "data": [args.data], "features_dir": args.features_dir, "out": str(out),
               "draft_vocab_size": 12288, "batch_size": args.batch_size, "max_steps": args.steps,
               "eval_fraction": 0.0, "eval_every": 0, "checkpoint_every_s": 1e9, "threads": args.threads,
               "fc_precondition": True, "seed": 6, **over}
        (out / "cfg.json").write_text(json.dumps(cfg))
        subprocess.run([sys.executable, "-m", "eagle3.train", "--config", str(out / "cfg.json")],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        recs = [json.loads(l) for l in (out / "train_log.jsonl").read_text().splitlines()][1:]
        rows[name] = round(sum(r["tokens"] for r in recs) / sum(r["step_s"] for r in recs), 1)
        shutil.rmtree(out, ignore_errors=True)
        print(f"{name}: {rows[name]} tokens/s", flush=True)
    print(json.dumps({"tokens_per_s": rows, "steps": args.steps, "batch_size": args.batch_size,
                      "threads": args.threads}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
