"""Build (or extend) the offline feature store for conversation files, e.g. beside a running regen.

    nohup python scripts/cache_features.py --data runs/data/conversations.jsonl --root runs/features &
One store part per file (<root>/<stem>-<path hash>, as `eagle3 train --set features_dir=<root>`
reads them). With --follow, only complete shards are written while the file grows; rerun without
--follow for the tail. Prints the part's size per million tokens and the build rate.

The target's states can come from vLLM instead of this process (docs/training.md):
    python scripts/cache_features.py --data F --root R --from-vllm [--vllm-dtype bfloat16]
runs vLLM (scripts/vllm_env.sh's venv) with `extract_hidden_states` and our connector
(eagle3/train/vllm_connector.py) at the draft's ids + L; the files land in <root>/<part>/vllm/.
    python scripts/cache_features.py --data F --root R --captures DIR [--layer-ids 2 15 27 30]
reads files captured elsewhere (a GPU server with our connector: DIR/index.json; vLLM's example
connector or speculators: DIR/<i>.safetensors or DIR/hs_<i>.safetensors, one per conversation of F
in order, with the --layer-ids vLLM ran with). Either way the target here adds the teacher (final
norm, lm_head argmax), and the first conversation is checked against its own capture.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from eagle3.errors import LoadError
from eagle3.runtime.loader import load_model, resolve_model
from eagle3.train.features import load_conversations
from eagle3.train.pipeline import STORE_DTYPE
from eagle3.train.store import PartKey, build_part, part_name, target_fingerprint
from eagle3.train.vllm_features import capture_source, read_index, run_vllm_capture, vllm_layer_ids


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", type=Path, nargs="+", required=True)
    ap.add_argument("--root", type=Path, required=True, help="the store root (features_dir)")
    ap.add_argument("--target", default=None)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--shard-size", type=int, default=64)
    ap.add_argument("--follow", type=float, default=0.0, help="re-scan every N seconds (complete shards only)")
    ap.add_argument("--threads", type=int, default=None)
    v = ap.add_argument_group("states from vLLM")
    v.add_argument("--from-vllm", action="store_true", help="run the target in vLLM (our connector)")
    v.add_argument("--vllm-python", type=Path, default=None, help="the vLLM venv's python "
                   "(default $EAGLE3_VLLM_PYTHON, else .venv-vllm)")
    v.add_argument("--vllm-dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    v.add_argument("--vllm-threads", type=int, default=2)
    v.add_argument("--captures", type=Path, default=None, help="capture files written elsewhere (one data file)")
    v.add_argument("--layer-ids", type=int, nargs="+", default=None,
                   help="the eagle_aux_hidden_state_layer_ids vLLM ran with (files of vLLM's example connector)")
    args = ap.parse_args(argv)
    if args.captures and (len(args.data) != 1 or args.follow or args.from_vllm):
        ap.error("--captures goes with exactly one --data file, without --follow or --from-vllm")
    if args.from_vllm and args.follow:
        ap.error("--from-vllm captures whole files: run it without --follow")
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_model(resolve_model(args.target).hf_dir)
    key = PartKey(target_fingerprint(target), tuple(target.config.default_aux_layer_ids), STORE_DTYPE)
    while True:
        for path in args.data:
            samples = load_conversations(path, args.max_len)
            if args.follow:
                samples = samples[:len(samples) // args.shard_size * args.shard_size]
            if not samples:
                continue
            t0 = time.time()
            root = args.root / part_name(path)
            features, source = vllm_features(args, target, key, samples, root)
            part = build_part(target, samples, key, root, args.shard_size, features=features, source=source,
                              progress=lambda **kw: tqdm(desc=path.stem, mininterval=10, **kw))
            m, dt = part.manifest, time.time() - t0
            print(json.dumps({"part": str(part.root), "samples": m["num_samples"], "tokens": m["tokens"],
                              "GB_per_M_tokens": round(m["bytes_per_token"] / 1000, 3), "seconds": round(dt, 1),
                              "tokens_per_s": round(m["tokens"] / max(dt, 1e-9), 1)}), flush=True)
        if not args.follow:
            return 0
        time.sleep(args.follow)


def vllm_features(args, target, key: PartKey, samples, root: Path):
    """(features=, source=) for build_part: None for this process, else vLLM's capture files."""
    if not (args.from_vllm or args.captures):
        return None, "this process"
    if args.captures:
        return capture_source(target, capture_files(args.captures, len(samples)), key.aux_layer_ids,
                              args.layer_ids), f"vLLM captures {args.captures}"
    from eagle3.bench.vllm_peer import VllmSettings, child_env, default_python
    ids = vllm_layer_ids(key.aux_layer_ids, target.config.num_layers)
    s = VllmSettings(python=args.vllm_python or default_python(), work_dir=(root / "vllm").resolve(),
                     threads=args.vllm_threads, dtype=args.vllm_dtype, enforce_eager=True,
                     max_model_len=args.max_len + 16, chain_depth=1)
    files = run_vllm_capture(s.python, child_env(s, "env"), resolve_model(args.target).hf_dir,
                             [x.ids.tolist() for x in samples], ids, root / "vllm" / "captures",
                             dtype=args.vllm_dtype, max_model_len=s.max_model_len)
    return capture_source(target, files, key.aux_layer_ids), f"vLLM {args.vllm_dtype}, ids {ids}"


def capture_files(folder: Path, count: int) -> list[Path]:
    """index.json (our capture run), else <i>.safetensors / hs_<i>.safetensors per conversation."""
    if (folder / "index.json").is_file():
        return read_index(folder)
    for pattern in ("hs_{}.safetensors", "{}.safetensors"):
        files = [folder / pattern.format(i) for i in range(count)]
        if all(f.is_file() for f in files):
            return files
    raise LoadError(f"{folder}: no index.json and no hs_<i>.safetensors / <i>.safetensors for all "
                     f"{count} conversations")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
