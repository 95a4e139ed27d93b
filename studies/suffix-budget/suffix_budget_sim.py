"""Replay suffix-only steps on the copy workload's greedy outputs under several block-size rules.

How large should a suffix-only block be? Too small and a copy under way takes many steps; too
large and a wrong guess pays for rows it never uses. This script decodes the copy-heavy prompts
plainly once (greedy, cached in --outputs), then replays them: at every step the suffix index
(eagle3.speculative.suffix) proposes, the block is merged as the decoder merges it, the accepted
length is the longest path of the block that matches the real output, and the step costs the
verify time of that many rows (--costs: ms by rows, measured with the decoder at ~1000 cached
tokens; 1 row = a plain step where the index has no match). It prints tokens per ms against plain
decoding for each rule, over all steps and for the median prompt (decode only, no prefill).

    python studies/suffix-budget/suffix_budget_sim.py --prompts 40 --outputs /tmp/copy_outputs.json

The rules' figures and what they decided: studies/suffix-budget/README.md.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Callable, Optional

from eagle3.speculative.decoder import first_cut
from eagle3.speculative.merge import merge_suffix
from eagle3.speculative.suffix import SuffixIndex

Rule = Callable[[Optional[int], int], int]  # (last block's accepted nodes, match length) -> block
                                            # size; 0: a plain step


def greedy_outputs(n: int, path: Path, workload: str = "copy", weights: str = "bf16") -> list[dict]:
    if path.is_file():
        data = json.loads(path.read_text())
        if len(data) >= n:
            return data[:n]
    import torch
    from eagle3.api import load_engine
    from eagle3.config import RunConfig
    from eagle3.bench.workload import make_prompts, workload_questions
    from eagle3.generate import SamplingParams
    torch.set_num_threads(2)
    engine = load_engine(draft="none", config=RunConfig(weights=weights))
    data = []
    for p in make_prompts(engine.tokenizer, workload_questions(workload, n)):
        r = engine.generate(prompt_ids=list(p.ids),
                            params=SamplingParams(max_new_tokens=256, ignore_eos=workload == "copy"))
        data.append({"qid": p.question_id, "prompt": list(p.ids), "output": r.token_ids})
    path.write_text(json.dumps(data))
    return data


def cost_of(table: list[tuple[int, float]]) -> Callable[[int], float]:
    def cost(rows: int) -> float:
        for (r0, m0), (r1, m1) in zip(table, table[1:]):
            if rows <= r1:
                return m0 + (m1 - m0) * (rows - r0) / (r1 - r0)
        (r0, m0), (r1, m1) = table[-2:]
        return m1 + (m1 - m0) * (rows - r1) / (r1 - r0)
    return cost


def accepted(conts: list[list[int]], budget: int, truth: list[int]) -> tuple[int, int]:
    """(accepted nodes, block nodes) of the merged suffix block against the real continuation."""
    m = merge_suffix([0], [-1], conts, budget)
    node, n = 0, 0
    while n < len(truth):
        nxt = [i for i, p in enumerate(m.parents) if p == node and m.tokens[i] == truth[n]]
        if not nxt:
            break
        node, n = nxt[0], n + 1
    return n, len(m.tokens) - 1


def replay(data: list[dict], rule: Rule, cost: Callable[[int], float]) -> tuple[float, float]:
    """(tokens per ms over all prompts, median prompt's tokens per ms) of suffix-only steps."""
    tok = ms = 0.0
    per = []
    for r in data:
        out, index = r["output"], SuffixIndex()
        index.extend(list(r["prompt"]) + out[:1])
        i, last, ptok, pms = 1, None, 0.0, 0.0
        while i < len(out):
            cands = index.propose(64)
            budget = rule(last, max((c.match_len for c in cands), default=0)) if cands else 0
            conts = first_cut([c.tokens[:budget] for c in cands], budget) if budget else []
            a, rows = accepted(conts, budget, out[i:]) if conts else (0, 0)
            emit = min(a + 1, len(out) - i)
            ptok, pms = ptok + emit, pms + cost(rows + 1)
            index.extend(out[i:i + emit])
            i += emit
            last = a if conts else last
        tok, ms = tok + ptok, ms + pms
        per.append(ptok / pms)
    return tok / ms, statistics.median(per)


def grow(lo: int, hi: int, factor: float = 2.0, shortest: int = 2) -> Rule:
    return lambda last, match: 0 if match < shortest else (
        lo if last is None else max(lo, min(hi, int(factor * (last + 1)))))


def by_match(short: int, mid: int, long: int) -> Rule:
    """A fixed block size per class of match: shorter than 4 tokens, 4-7, 8 and more (0: plain)."""
    return lambda last, match: short if match < 4 else (mid if match < 8 else long)


def short_fixed(short: int, mid: int, lo: int, hi: int) -> Rule:
    """Fixed sizes below a match of 8 tokens (as by_match), 2 x (accepted + 1) within lo..hi at 8+."""
    long = grow(lo, hi, shortest=8)
    return lambda last, match: short if match < 4 else (mid if match < 8 else long(last, match))


def doubling(base: int, times: int) -> Rule:
    state = {"run": 0, "budget": base}

    def rule(last: Optional[int], match: int) -> int:
        if last is not None:
            whole = last >= state["budget"] - state["budget"] // 4
            state["run"] = min(state["run"] + 1, times) if whole else 0
        state["budget"] = base << state["run"]
        return state["budget"]
    return rule


RULES = {"fixed 8": lambda last, match: 8, "fixed 15": lambda last, match: 15,
         "fixed 30": lambda last, match: 30,
         "doubling 15..60": None, "2 x (accepted + 1), 8..64": grow(8, 64),
         "2 x (accepted + 1), 4..64": grow(4, 64), "2 x (accepted + 1), 8..32": grow(8, 32),
         "3 x (accepted + 1), 4..64": grow(4, 64, 3.0),
         "2 x (accepted + 1), 8..64, match 8+": grow(8, 64, shortest=8),
         "by match 3 / 6 / 16": by_match(3, 6, 16), "by match - / 6 / 16": by_match(0, 6, 16),
         "by match - / - / 16": by_match(0, 0, 16),
         "by match 3 / 6 / 2 x (accepted + 1), 8..64": short_fixed(3, 6, 8, 64),
         "by match 3 / 6 / 2 x (accepted + 1), 16..64": short_fixed(3, 6, 16, 64),
         "by match 3 / 6 / 2 x (accepted + 1), 8..32": short_fixed(3, 6, 8, 32)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--outputs", type=Path, default=Path("copy_outputs.json"),
                    help="greedy outputs (made here with plain decoding when missing)")
    ap.add_argument("--costs", default="1:15.9,16:26.1,31:38.6,61:60.3",
                    help="verify ms by rows, rows:ms,... (1 row: a plain step)")
    ap.add_argument("--workload", choices=("copy", "mtbench"), default="copy")
    ap.add_argument("--weights", default="bf16", help="the target's weights for the outputs")
    args = ap.parse_args()
    table = sorted((int(r), float(m)) for r, m in (x.split(":") for x in args.costs.split(",")))
    cost, plain = cost_of(table), 1.0 / table[0][1]
    data = greedy_outputs(args.prompts, args.outputs, args.workload, args.weights)
    for name, rule in RULES.items():
        rate, median = replay(data, rule or doubling(15, 2), cost)
        print(f"{name:28s} {rate / plain:5.2f}x plain (median prompt {median / plain:5.2f}x)")


if __name__ == "__main__":
    main()
