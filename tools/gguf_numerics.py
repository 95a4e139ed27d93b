"""How far `--weights gguf` (the codes against inputs rounded to one byte per block of 32, as
llama.cpp runs a GGUF) is from the file's exact model (`--weights gguf-exact`, within 1e-4 of the
dequantised model in fp64).

    python tools/gguf_numerics.py [--model M] [--prompts 80] [--max-new-tokens 128] [--json out.json]

Prints, for the same target file:
- logits over a held-out paragraph (and ShareGPT text): the largest and mean distance of the one-byte
  path's logits to the exact path's, the KL divergence exact || one-byte per token, and how often the
  two agree on the most likely next token;
- the perplexity of each path on that text;
- greedy outputs on MT-bench first turns, plain decoding on each path: how many are token for token
  the same and the mean length of their common prefix.
"""
from __future__ import annotations

import eagle3

eagle3.tune_process()   # first: the OpenMP wait policy before torch loads, the allocator

import argparse
import json
import time

import torch

from eagle3.api import load_engine
from eagle3.config import RunConfig
from eagle3.bench.workload import workload_questions
from eagle3.generate import SamplingParams

# A held-out paragraph in the style of an encyclopedia (written for this check, in no training set
# of ours).
PARAGRAPH = (
    "The lighthouse at the northern end of the harbour was built in 1852 from granite quarried on "
    "the island itself. Its first lamp burned whale oil and was visible for about twelve nautical "
    "miles; in 1891 it was replaced by a paraffin burner behind a rotating Fresnel lens, which gave "
    "the light its characteristic pattern of two white flashes every fifteen seconds. The keepers "
    "and their families lived in a row of cottages at the foot of the tower, and supplies arrived by "
    "boat once a fortnight, weather permitting. During the storms of the winter of 1903 the island "
    "was cut off for almost seven weeks, and the keepers' logbook records that they rationed flour "
    "and lamp fuel until the relief vessel could land. The light was automated in 1978, the cottages "
    "were sold, and the tower itself is now maintained by a local trust that opens it to visitors on "
    "summer weekends.")


@torch.inference_mode()
def text_logits(engine, ids: list[int]) -> torch.Tensor:
    """Logits [T, V] at every position of `ids` (one prefill, in the layout's row-stable pieces)."""
    target = engine.target
    cache = target.new_cache(len(ids) + 8)
    out = target(torch.tensor([ids]), torch.arange(len(ids))[None], cache, logits_rows=slice(None))
    return out.logits[0].double()


def compare_logits(exact: torch.Tensor, ours: torch.Tensor, ids: list[int]) -> dict:
    lp_e, lp_o = exact.log_softmax(-1), ours.log_softmax(-1)
    kl = (lp_e.exp() * (lp_e - lp_o)).sum(-1)
    nxt = torch.tensor(ids[1:])
    nll = lambda lp: -lp[:-1].gather(1, nxt[:, None]).mean().item()
    return {"tokens": len(ids), "max_abs_logit_diff": round((exact - ours).abs().max().item(), 4),
            "mean_abs_logit_diff": round((exact - ours).abs().mean().item(), 5),
            "mean_kl_exact_to_int8": float(f"{kl.mean().item():.3g}"),
            "top1_agreement": round((exact.argmax(-1) == ours.argmax(-1)).double().mean().item(), 4),
            "perplexity_exact": round(float(torch.tensor(nll(lp_e)).exp()), 3),
            "perplexity_int8": round(float(torch.tensor(nll(lp_o)).exp()), 3)}


def greedy_outputs(engine, prompts: list[str], max_new: int) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=max_new)
    return [engine.generate(p, params, speculative=False).token_ids for p in prompts]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", type=int, default=80)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    exact = load_engine(args.model, draft="none", config=RunConfig(weights="gguf-exact"))
    ours = load_engine(args.model, draft="none", config=RunConfig(weights="gguf"))
    print(f"exact: {exact.target.weights_name}; one byte: {ours.target.weights_name}")
    tok = exact.tokenizer
    report = {"model": args.model or "default", "exact": exact.target.weights_name,
              "int8": ours.target.weights_name}
    texts = {"paragraph": PARAGRAPH}
    questions = workload_questions("copy", 4)
    texts["sharegpt"] = "\n\n".join(q.text for q in questions)[:6000]
    for name, text in texts.items():
        ids = tok.encode(text)[:1024]
        report[name] = compare_logits(text_logits(exact, ids), text_logits(ours, ids), ids)
        print(name, json.dumps(report[name]))
    prompts = [q.text for q in workload_questions("mtbench", args.prompts)]   # generate applies the template
    t0 = time.time()
    a, b = greedy_outputs(exact, prompts, args.max_new_tokens), greedy_outputs(ours, prompts, args.max_new_tokens)
    same = sum(x == y for x, y in zip(a, b))
    prefix = sum(common_prefix(x, y) for x, y in zip(a, b)) / len(a)
    report["mtbench_greedy"] = {"prompts": len(a), "max_new_tokens": args.max_new_tokens,
                                "identical": same, "mean_common_prefix": round(prefix, 1),
                                "mean_length": round(sum(map(len, a)) / len(a), 1),
                                "wall_s": round(time.time() - t0, 1)}
    print("mtbench_greedy", json.dumps(report["mtbench_greedy"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
