"""Stream benchmark of learning from traffic: replay a domain stream through `eagle3 serve --learn`,
let the server learn by itself, then measure every draft version on held-out requests of the stream.

    python scripts/bench_learning.py --stream code --out runs/learn-code            # all phases
    python scripts/bench_learning.py --stream code --out runs/learn-code --phase eval

Phases (each skips what its outputs already hold): `prompts` (the stream's prompts: 120 learned,
20 held out), `serve` (a server with --learn: replay data regenerated through it with
"learn": false, then the stream, each prompt at T=0 and T=1, then waiting until the learner is idle),
`eval` (per version: EAGLE-only tau on the held-out prompts with a fixed tree, the default step's
tokens/s against plain decoding with greedy outputs compared, MT-bench tau; results.json + a table).

Streams: `code` (ShareGPT first turns the training selection drops (too long or not text) that
look like code, each cut to its first and last characters), `json` (a fixed instruction, JSON out,
over ShareGPT requests), `mtbench-CATEGORY` (both turns of one MT-bench category's questions as
single-turn prompts, the last questions held out).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CODE = re.compile(r"```|^\s*(def |class |import |from \S+ import|function |const |let |var |public |"
                  r"private |#include|SELECT |for \(|if \(|return )", re.M)
JSON_INSTRUCTION = ("Turn the request below into a JSON object with the keys \"intent\" (a short "
                    "string), \"entities\" (a list of strings) and \"language\" (a string). Reply "
                    "with the JSON object only.\n\nRequest: ")
TREE = "4,5,8,0.05"


# ---------------------------------------------------------------------------- prompts
def code_prompts(n: int, head: int = 700, tail: int = 300) -> list[str]:
    from eagle3.runtime.assets import sharegpt_json
    from eagle3.train.data import PromptFilter, clean, first_human_turns, iter_json_array, junk_reason, text_hash
    out, seen, filt = [], set(), PromptFilter()
    for p in first_human_turns(iter_json_array(sharegpt_json())):
        text = clean(p.text)
        if junk_reason(text, filt) not in ("too_long", "non_text") or len(text) > 8000:
            continue
        if len(CODE.findall(text)) < 3 or text_hash(text) in seen:
            continue
        seen.add(text_hash(text))
        out.append(text if len(text) <= head + tail else text[:head] + "\n...\n" + text[-tail:])
        if len(out) == n:
            break
    return out


def json_prompts(n: int) -> list[str]:
    from eagle3.runtime.assets import mtbench_questions, sharegpt_json
    from eagle3.train.data import PromptFilter, select_prompts
    prompts, _ = select_prompts(sharegpt_json(), mtbench_questions(), PromptFilter(max_chars=400), 6000)
    return [JSON_INSTRUCTION + p.text for p in prompts[-n:]]      # the end of the file: far from training


def mtbench_prompts(category: str) -> list[str]:
    from eagle3.runtime.assets import mtbench_questions
    qs = [json.loads(x) for x in mtbench_questions().read_text().splitlines() if x.strip()]
    qs = [q for q in qs if q["category"] == category]
    return [t for q in qs for t in q["turns"]]


def stream_prompts(stream: str, n_learn: int, n_held: int) -> tuple[list[str], list[str]]:
    if stream == "code":
        ps = code_prompts(n_learn + n_held)
    elif stream == "json":
        ps = json_prompts(n_learn + n_held)
    elif stream.startswith("mtbench-"):
        ps = mtbench_prompts(stream.split("-", 1)[1])
        n_held = max(2, len(ps) // 5)
        return ps[:-n_held], ps[-n_held:]
    else:
        raise SystemExit(f"--stream {stream}: choose code, json or mtbench-CATEGORY")
    if len(ps) < n_learn + n_held:
        raise SystemExit(f"only {len(ps)} prompts for the {stream} stream")
    return ps[:n_learn], ps[n_learn:]


# ---------------------------------------------------------------------------- serving
def start_server(args, learn_dir: Path, replay: Path, log: Path) -> subprocess.Popen:
    cmd = ["nice", "-n", "19", str(ROOT / ".venv/bin/eagle3"), "serve", "--port", str(args.port),
           "--threads", str(args.threads), "--max-batch", str(args.max_batch), "--learn", str(learn_dir),
           "--learn-min-tokens", str(args.min_tokens), "--learn-replay", str(replay)]
    if args.model:
        cmd += ["--model", args.model, "--draft", args.draft or "suffix"]
    proc = subprocess.Popen(cmd, stdout=open(log, "ab"), stderr=subprocess.STDOUT)
    import httpx
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{args.port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(1)
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode}); see {log}")
    raise SystemExit("the server did not come up in 10 minutes")


def ask(port: int, prompt: str, temperature: float, seed: int, max_tokens: int, learn: bool = True) -> dict:
    import httpx
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": temperature, "seed": seed, "return_token_ids": True, "learn": learn}
    t0 = time.time()
    r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    choice = r.json()["choices"][0]
    return {"prompt_ids": choice["prompt_token_ids"], "response_ids": choice["token_ids"],
            "temperature": temperature, "seconds": round(time.time() - t0, 2)}


def gauges(port: int) -> dict:
    import httpx
    out = {}
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text.splitlines():
        if line.startswith("eagle3:learn_"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def serve_phase(args, out: Path, learn_prompts: list[str]) -> None:
    from eagle3.runtime.assets import mtbench_questions, sharegpt_json
    from eagle3.train.data import PromptFilter, select_prompts
    learn_dir, replay = out / "learn", out / "replay.jsonl"
    proc = start_server(args, learn_dir, replay, out / "server.log")
    log = open(out / "stream.jsonl", "a")
    try:
        if not replay.is_file():
            general, _ = select_prompts(sharegpt_json(), mtbench_questions(), PromptFilter(), args.replay_prompts)
            with ThreadPoolExecutor(args.clients) as pool:
                recs = list(pool.map(lambda ip: ask(args.port, ip[1].text, float(ip[0] % 2), ip[0],
                                                    args.max_tokens, learn=False), enumerate(general)))
            replay.write_text("".join(json.dumps(r) + "\n" for r in recs))
        t0 = time.time()
        jobs = [(r * len(learn_prompts) + i, p, float(t)) for r in range(args.repeat)
                for i, p in enumerate(learn_prompts) for t in (0, 1)]
        with ThreadPoolExecutor(args.clients) as pool:
            for rec in pool.map(lambda j: ask(args.port, j[1], j[2], j[0], args.max_tokens), jobs):
                log.write(json.dumps({"reply_tokens": len(rec["response_ids"]), "seconds": rec["seconds"]}) + "\n")
        stream_s = time.time() - t0
        print(f"stream: {len(jobs)} requests in {stream_s:.0f} s", flush=True)
        wait_learning(args, out, t0)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)


def wait_learning(args, out: Path, t0: float) -> None:
    """Until the learner has run and is idle again with nothing pending, and the server serves the
    current version (a published version loads and swaps in after the learner exits: stopped
    then, the server never served it), or the deadline."""
    from eagle3.learn import versions
    from eagle3.learn.learner import pending_tokens
    deadline, ran = time.time() + args.learn_timeout_s, False
    while time.time() < deadline:
        g = gauges(args.port)
        state = next((k for k, v in g.items() if "learner_state" in k and v == 1.0), "")
        ran = ran or "idle" not in state
        served = g.get("eagle3:learn_draft_version") == versions.current(out / "learn")
        if ran and "idle" in state and served and pending_tokens(out / "learn") < args.min_tokens:
            break
        if "failed" in state:
            print("the learner failed: see", out / "learn" / "learner" / "learner.log")
            break
        time.sleep(10)
    g = gauges(args.port)
    print(f"learning done {time.time() - t0:.0f} s after the stream began: {g}", flush=True)
    (out / "learning.json").write_text(json.dumps({"gauges": g, "seconds_after_stream_start": round(time.time() - t0)}))


# ---------------------------------------------------------------------------- the curve
def prefix_phase(args, out: Path, counts: list[int]) -> None:
    """Candidates learned from the first N requests of the stream (the same round, offline, in
    this process, ungated: margin -1), for tau against requests learned. Their traffic shards link
    to the server's, so the feature store's parts are reused; the held-out shards are the server's."""
    import torch
    from eagle3.learn import versions
    from eagle3.learn.capture import traffic_shards
    from eagle3.learn.learner import LearnConfig, learn_round, read_state, write_state
    from eagle3.learn.process import load_reference
    from eagle3.learn.traffic import read_shard
    torch.set_num_threads(args.threads)
    main = out / "learn"
    state = read_state(main)
    held = set(state["heldout"])
    target, _ = load_reference(args.model)
    for n in counts:
        root = out / f"prefix-{n}"
        if (root / "drafts" / "current").is_file() and versions.current(root) > 0:
            continue
        (root / "traffic").mkdir(parents=True, exist_ok=True)
        seen = 0
        for shard in traffic_shards(main):
            if shard.name in held or seen < n:
                link = root / "traffic" / shard.name
                if not link.exists():
                    link.symlink_to(shard.resolve())
                seen += 0 if shard.name in held else len(read_shard(shard).records)
        if not (root / "features").exists():
            (root / "features").symlink_to((main / "features").resolve())
        (root / "learn.json").write_text((main / "learn.json").read_text())
        versions.ensure_v0(root, versions.draft_path(main, 0))
        if not (root / "learner" / "state.json").is_file():
            write_state(root, {"round": 0, "heldout": sorted(held), "trained": []})
        replay = str(out / "replay.jsonl")
        card = learn_round(LearnConfig(str(root), args.model, replay=replay, margin=-1.0), target)
        print(f"prefix {n} ({seen} requests): v{card['version']} {card['gate']['reason']}", flush=True)


# ---------------------------------------------------------------------------- eval
def version_dirs(learn_dir: Path) -> dict[str, str | None]:
    from eagle3.learn import versions
    out = {}
    for v in versions.versions(learn_dir):
        path = versions.draft_path(learn_dir, v)          # rejected candidates too, when kept
        if v == 0 or path is not None:
            out[f"v{v}"] = str(path) if path else None
    return out


def eagle_tau(model, draft: str, prompts: list[str], max_new: int, threads: int) -> dict:
    from eagle3.api import load_engine
    from eagle3.bench.tune import parse_shape
    from eagle3.config import RunConfig
    from eagle3.generate import SamplingParams
    engine = load_engine(model, draft, parse_shape(TREE), config=RunConfig(threads=threads), adaptive=False)
    tokens = steps = 0
    for p in prompts:
        res = engine.generate(p, SamplingParams(temperature=0.0, max_new_tokens=max_new))
        tokens += sum(len(s.tokens) for s in res.decode_steps)
        steps += len(res.decode_steps)
    return {"tau": round(tokens / max(steps, 1), 3), "tokens": tokens}


def default_step(model, draft, prompts: list[str], max_new: int, threads: int) -> dict:
    """The default (adaptive) step with this draft; tokens/s over all prompts; the outputs."""
    from eagle3.api import load_engine
    from eagle3.config import RunConfig
    from eagle3.generate import SamplingParams
    engine = load_engine(model, draft, config=RunConfig(threads=threads))
    engine.generate(prompts[0], SamplingParams(temperature=0.0, max_new_tokens=16))    # warm-up
    tokens, secs, outs, steps = 0, 0.0, [], 0
    for p in prompts:
        t0 = time.perf_counter()
        res = engine.generate(p, SamplingParams(temperature=0.0, max_new_tokens=max_new))
        secs += time.perf_counter() - t0
        tokens += len(res.token_ids)
        steps += len(res.decode_steps)
        outs.append(list(res.token_ids))
    return {"tok_s": round(tokens / secs, 1), "tau": round(tokens / max(steps, 1), 3), "outputs": outs}


def speed_phase(args, out: Path, held: list[str]) -> dict:
    """The default step against plain decoding, the two alternated prompt by prompt (load on a
    shared machine moves both alike), T=0, greedy outputs compared."""
    import torch
    from eagle3.api import load_engine
    from eagle3.config import RunConfig
    from eagle3.generate import SamplingParams
    torch.set_num_threads(args.threads)
    held = held[:args.eval_prompts]
    results = json.loads((out / "results.json").read_text())
    speed = results.setdefault("speed", {})
    params = SamplingParams(temperature=0.0, max_new_tokens=args.eval_tokens)
    plain = load_engine(args.model, "none", config=RunConfig(threads=args.threads))
    found = version_dirs(out / "learn")
    for name, draft in found.items():
        if name in speed:
            continue
        spec = load_engine(args.model, draft or "suffix", config=RunConfig(threads=args.threads))
        spec.generate(held[0], SamplingParams(temperature=0.0, max_new_tokens=16))
        t = {"plain": 0.0, "spec": 0.0}
        n = {"plain": 0, "spec": 0}
        same = 0
        for p in held:
            outs = {}
            for key, engine in (("plain", plain), ("spec", spec)):
                t0 = time.perf_counter()
                res = engine.generate(p, params)
                t[key] += time.perf_counter() - t0
                n[key] += len(res.token_ids)
                outs[key] = list(res.token_ids)
            same += outs["plain"] == outs["spec"]
        speed[name] = {"plain_tok_s": round(n["plain"] / t["plain"], 1), "default_tok_s": round(n["spec"] / t["spec"], 1),
                       "vs_plain": round((n["spec"] / t["spec"]) / (n["plain"] / t["plain"]), 3),
                       "identical": same, "of": len(held)}
        (out / "results.json").write_text(json.dumps(results))
        print(name, speed[name], flush=True)
    return speed


def eval_phase(args, out: Path, held: list[str]) -> dict:
    import torch
    from scripts_measure import first_turns
    torch.set_num_threads(args.threads)
    held = held[:args.eval_prompts]
    results = json.loads((out / "results.json").read_text()) if (out / "results.json").is_file() else {}
    model = args.model
    if "plain" not in results:
        plain = default_step(model, "none", held, args.eval_tokens, args.threads)
        results["plain"] = plain
    mt = first_turns(args.mtbench_prompts)
    found = version_dirs(out / "learn")
    for pre in sorted(out.glob("prefix-*")):
        from eagle3.learn import versions
        if versions.current(pre):
            found[pre.name] = str(versions.draft_path(pre, versions.current(pre)))
    for name, draft in found.items():
        if name in results:
            continue
        draft_arg = draft or "suffix"
        r = {"draft": draft_arg}
        if draft is not None:
            r["eagle_tau_heldout"] = eagle_tau(model, draft, held, args.eval_tokens, args.threads)["tau"]
            r["mtbench_tau"] = eagle_tau(model, draft, mt, args.mtbench_tokens, args.threads)["tau"]
        d = default_step(model, draft_arg, held, args.eval_tokens, args.threads)
        r.update(default_tok_s=d["tok_s"], default_tau=d["tau"],
                 vs_plain=round(d["tok_s"] / results["plain"]["tok_s"], 3),
                 identical=sum(a == b for a, b in zip(d["outputs"], results["plain"]["outputs"])),
                 of=len(held))
        results[name] = r
        (out / "results.json").write_text(json.dumps(results))
        print(name, {k: v for k, v in r.items()}, flush=True)
    return results


def requests_learned(out: Path, name: str) -> int:
    """Requests a version trained on: 0 for v0, N for prefix-N, else its rounds' training shards'."""
    from eagle3.learn.learner import read_state
    from eagle3.learn.traffic import read_shard
    if name == "v0":
        return 0
    if name.startswith("prefix-"):
        return int(name.split("-")[1])
    learn = out / "learn"
    return sum(len(read_shard(learn / "traffic" / n).records) for n in read_state(learn)["trained"]
               if (learn / "traffic" / n).is_file())


def plot(out: Path, results: dict) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    pts = sorted((requests_learned(out, n), r["eagle_tau_heldout"], r.get("mtbench_tau"))
                 for n, r in results.items() if n not in ("plain", "speed") and "eagle_tau_heldout" in r)
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label="held-out requests of the stream")
    ax.plot([p[0] for p in pts], [p[2] for p in pts], "s--", label="MT-bench")
    ax.set_xlabel("requests learned")
    ax.set_ylabel("EAGLE-only tau (tree 4/5/8, T=0)")
    ax.legend()
    fig.tight_layout()
    path = out / "tau_vs_requests.png"
    fig.savefig(path, dpi=120)
    return path


def table(results: dict) -> str:
    rows = ["| version | EAGLE-only tau, held-out | default step vs plain (tok/s) | greedy identical | MT-bench tau |",
            "|---|---|---|---|---|"]
    plain = results.get("plain", {}).get("tok_s")
    for name, r in results.items():
        if name in ("plain", "speed"):
            continue
        rows.append(f"| {name} | {r.get('eagle_tau_heldout', '-')} | {r['vs_plain']}x ({r['default_tok_s']} vs {plain}) "
                    f"| {r['identical']}/{r['of']} | {r.get('mtbench_tau', '-')} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stream", default="code")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--phase", choices=["all", "prompts", "serve", "prefixes", "eval", "speed"], default="all")
    ap.add_argument("--prefixes", default="", help="with --phase prefixes: request counts, e.g. 50,100")
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--learn-prompts", type=int, default=120)
    ap.add_argument("--heldout-prompts", type=int, default=20)
    ap.add_argument("--replay-prompts", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=1, help="stream passes (seeds differ): a small stream served again")
    ap.add_argument("--min-tokens", type=int, default=20000)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--learn-timeout-s", type=float, default=3600)
    ap.add_argument("--eval-prompts", type=int, default=20)
    ap.add_argument("--eval-tokens", type=int, default=128)
    ap.add_argument("--mtbench-prompts", type=int, default=40)
    ap.add_argument("--mtbench-tokens", type=int, default=128)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    ppath = args.out / "prompts.json"
    if not ppath.is_file():
        learn, held = stream_prompts(args.stream, args.learn_prompts, args.heldout_prompts)
        ppath.write_text(json.dumps({"stream": args.stream, "learn": learn, "heldout": held}))
    prompts = json.loads(ppath.read_text())
    if args.phase in ("all", "serve") and not (args.out / "learning.json").is_file():
        serve_phase(args, args.out, prompts["learn"])
    if args.phase == "prefixes":
        prefix_phase(args, args.out, [int(x) for x in args.prefixes.split(",") if x])
    if args.phase == "speed":
        speed_phase(args, args.out, prompts["heldout"])
    if args.phase in ("all", "eval"):
        results = eval_phase(args, args.out, prompts["heldout"])
        print(table(results))
        print("plot:", plot(args.out, results))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "scripts"))
    sys.modules.setdefault("scripts_measure", __import__("measure_tau"))
    sys.exit(main())
