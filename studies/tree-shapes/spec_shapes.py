"""Tree shapes on the real target with an untrained draft: tau, tokens/s, draft/verify split.

    python studies/tree-shapes/spec_shapes.py --threads 1 --clock cpu --prompts 3 --max-new-tokens 64

Drafts: `random` (an untrained EAGLE-3 draft, tau near 1: the pure overhead of speculation) and
`oracle` (the same draft with its logits replaced by the target's own greedy continuation, every
third proposal wrong: what the engine delivers when a draft is good; greedy only).
Workload: the first turns of the first N MT-bench questions, greedy, ignore_eos. Each shape is
checked token-identical to plain greedy. Warm-up excluded. `--clock cpu` reports process CPU
seconds (use with --threads 1 on a shared machine).
"""
from __future__ import annotations

import eagle3

eagle3.tune_process()   # first: the OpenMP wait policy before torch loads, the allocator

import argparse
import json
import time

import torch

from eagle3.generate import Engine, SamplingParams
from eagle3.runtime.assets import mtbench_questions
from eagle3.runtime.loader import load_model, load_tokenizer, resolve_model
from eagle3.draft.model import DraftConfig, DraftOutput, Eagle3Draft
from eagle3.speculative.tree import SpecParams

SHAPES = "1,1,2;1,3,4;1,5,6;2,3,6;3,4,8;4,5,8;4,5,16"


class OracleDraft(Eagle3Draft):
    """Proposes seq[j+2] on a row at position j whose input is seq[j+1] (wrong when j % 3 == 0)."""

    def set_sequence(self, seq: list[int]) -> None:
        """seq: target ids by position. A draft vocabulary (d2t) holding them is built when Vd < V."""
        cfg = self.config
        ids = torch.tensor(seq + [0, 0])
        used = torch.unique(ids)
        rest = torch.ones(cfg.vocab_size, dtype=torch.bool)
        rest[used] = False
        used = torch.cat([used, rest.nonzero().flatten()[:cfg.draft_vocab_size - used.numel()]])
        used = used.sort().values
        self.d2t.copy_(used - torch.arange(cfg.draft_vocab_size))
        to_draft = torch.zeros(cfg.vocab_size, dtype=torch.long)
        to_draft[used] = torch.arange(cfg.draft_vocab_size)
        self.seq, self.seq_draft = ids, to_draft[ids]

    def forward(self, input_ids, positions, cache, **kw) -> DraftOutput:
        rows = kw.pop("logits_rows", None)
        out = super().forward(input_ids, positions, cache, **kw)
        pos = (positions if positions.dim() == 2 else positions[None]).clamp(max=len(self.seq) - 3)
        on_track = (self.seq[pos + 1] == input_ids).float()[..., None]
        right = self.seq_draft[pos + 2][..., None]
        logits = self.head(out.hidden) * 0.01
        logits.scatter_add_(-1, right, on_track * 10.0)
        wrong = (right + 1) % logits.shape[-1]
        logits.scatter_add_(-1, wrong, on_track * ((pos % 3 == 0).float()[..., None] * 12.0))
        return DraftOutput(logits if rows is None else logits[:, rows], out.hidden)


def parse_shapes(text: str) -> list[SpecParams]:
    return [SpecParams(*(int(x) for x in part.split(","))) for part in text.split(";")]


def clock(kind: str) -> float:
    return time.process_time() if kind == "cpu" else time.perf_counter()


def run(engine: Engine, ids: list[list[int]], params: SamplingParams, kind: str, oracle=None,
        refs=None) -> dict:
    tokens = steps = 0
    draft_s = verify_s = elapsed = 0.0
    same = True
    for i, prompt in enumerate(ids):
        if oracle is not None:
            oracle.set_sequence(prompt + refs[i])
        t0 = clock(kind)
        res = engine.generate(prompt_ids=prompt, params=params)
        elapsed += clock(kind) - t0
        tokens += len(res.token_ids)
        steps += len(res.decode_steps)
        draft_s += sum(s.draft_s for s in res.decode_steps)
        verify_s += sum(s.verify_s for s in res.decode_steps)
        same &= refs is None or res.token_ids == refs[i]
    return {"tok_s": tokens / elapsed, "tau": (tokens - len(ids)) / max(steps, 1),
            "draft_ms": 1e3 * draft_s / max(steps, 1), "verify_ms": 1e3 * verify_s / max(steps, 1),
            "identical": same, "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--shapes", default=SHAPES, help="'K,D,N;K,D,N'")
    ap.add_argument("--draft-vocab", type=int, default=0, help="Vd (default: target vocab)")
    ap.add_argument("--drafts", default="random,oracle")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    src = resolve_model(None)
    target, tok = load_model(src.hf_dir), load_tokenizer(src.hf_dir)
    lines = mtbench_questions().read_text().splitlines()
    prompts = [json.loads(line)["turns"][0] for line in lines if line.strip()][:args.prompts]
    plain = Engine(target, tok, max_model_len=1024)
    ids = [plain.encode(p) for p in prompts]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    plain.generate(prompt_ids=ids[0], params=SamplingParams(max_new_tokens=8))       # warm-up
    refs = [plain.generate(prompt_ids=p, params=params).token_ids for p in ids]
    base = run(plain, ids, params, args.clock)
    print(f"threads {torch.get_num_threads()}, clock {args.clock}, {len(ids)} prompts x "
          f"{args.max_new_tokens} tokens; plain {base['tok_s']:.2f} tok/s")
    print(f"{'draft':<7} {'shape (K,D,N)':<14} {'tau':>5} {'tok/s':>6} {'x plain':>7} "
          f"{'draft ms':>8} {'verify ms':>9} same")
    results = {"plain": base, "rows": []}
    for kind in args.drafts.split(","):
        torch.manual_seed(0)
        cfg = DraftConfig.for_target(target.config, draft_vocab_size=args.draft_vocab or None)
        draft = (OracleDraft if kind == "oracle" else Eagle3Draft)(cfg).eval()
        draft.set_embedding(target.embed_tokens.weight)
        for spec in parse_shapes(args.shapes):
            engine = Engine(target, tok, draft=draft, spec=spec, max_model_len=1024)
            oracle = draft if kind == "oracle" else None
            if oracle is not None:
                oracle.set_sequence(ids[0] + refs[0])
            engine.generate(prompt_ids=ids[0], params=SamplingParams(max_new_tokens=8))  # warm-up
            r = run(engine, ids, params, args.clock, oracle, refs)
            results["rows"].append({"draft": kind, "shape": list(spec.__dict__.values()), **r})
            print(f"{kind:<7} {f'{spec.top_k},{spec.depth},{spec.num_draft_tokens}':<14} "
                  f"{r['tau']:>5.2f} {r['tok_s']:>6.2f} {r['tok_s'] / base['tok_s']:>7.2f} "
                  f"{r['draft_ms']:>8.1f} {r['verify_ms']:>9.1f} {r['identical']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
