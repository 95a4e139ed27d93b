"""`eagle3 bench serve`: serving throughput and latency of `eagle3 serve` (and vLLM's OpenAI server)
under concurrent streaming clients.

    eagle3 bench serve [--model M] [--weights auto|gguf|gguf-exact|fp32|bf16] [--max-batch 16]
        [--systems ours,ours-eagle3,vllm,vllm-eagle3] [--clients 1,4,16] [--tokens 128]
        [--temperatures 0,1] [--prompts 32] [--rounds 1] [--out DIR] [--url http://host:port]
        [--vllm-python PY] [--vllm-eager] [--chain-depth 3] [--workload mtbench|copy]

Systems, each a server in a child process: `ours` = `eagle3 serve --draft none --max-batch B` for
each --max-batch value (continuous batching of plain decoding); `ours-eagle3` = `eagle3 serve` with
the default draft, for each --max-batch value (a greedy request alone decodes speculatively; in a
batch every request appends the tokens its suffix index guesses where the rows pay, greedy and
sampled; --max-batch 1: one sequence at a time, all speculative); `vllm` = vLLM's OpenAI server (its
api_server module, from the vLLM venv of scripts/vllm_env.sh) on the same weights, --max-num-seqs = the
largest --max-batch, bf16 unless --weights fp32 (it has no kernels for GGUF codes), compiled unless
--vllm-eager; `vllm-eagle3` = the same with our draft exported in the speculators layout, a chain
of --chain-depth tokens. vLLM's threads are pinned to this process's cores, its caches and sockets
kept under --out/vllm-serve (eagle3.bench.vllm_peer). A missing vLLM venv skips its systems with
the install line. Or --url benches one running server, once.

Our servers run at once and the cells are interleaved (each (temperature, clients) cell on each
server back to back: a machine whose speed drifts shifts every system alike); vLLM's run after,
one at a time. Each server is warmed up, then for each client count N and temperature
sends the first --prompts questions of --workload (MT-bench, or the copy workload of prompts whose
answers quote them; eagle3.bench.workload, round-robin over categories)
over the OpenAI chat API, streamed, at most N in flight (each client takes the next prompt when its
last one ends), --tokens new tokens each (ignore_eos, so every request is the same length; T > 0
seeded per prompt). Prints one table per run: aggregate tokens/s (all completion tokens / wall
time), TTFT and inter-token latency p50/p99 (gaps between streamed content chunks), end-to-end p50,
tokens/s against the same server with one client ("x 1 client"), against `ours --max-batch 1`
at the same clients and temperature ("x ours b1") and, for ours-eagle3, against `ours` at the same
max-batch, clients and temperature ("x plain": what speculation adds) where they ran; saves serving.json and
serving.png under --out (default runs/bench-serve). The defaults are the product's: the server's
own --weights default (auto: a GGUF target's own codes), --max-batch 16. Run it on a quiet machine:
the clients share the cores. (scripts/bench_serving.py is the same command.)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import functools
import math
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import httpx

from ..cli_args import MODEL_HELP
from ..config import WEIGHT_CHOICES

ROOT = Path(__file__).resolve().parents[2]      # the checkout: the child servers run from it
MODEL_NAME = "bench"


@dataclass(frozen=True)
class RequestTiming:
    prompt: int
    tokens: int                  # completion tokens (the usage block)
    ttft_s: float                # sent -> first content chunk
    gaps_s: list[float]          # between successive content chunks
    e2e_s: float


SYSTEMS = ("ours", "ours-eagle3", "vllm", "vllm-eagle3")


@dataclass(frozen=True)
class Result:
    max_batch: Optional[int]     # None: an external server (--url)
    clients: int
    temperature: float
    requests: int
    tokens: int
    wall_s: float
    tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    e2e_p50_s: float
    vs_batch1: Optional[float] = None        # over ours --max-batch 1, same clients and temperature
    system: str = "ours"                     # SYSTEMS, or "url"
    vs_one_client: Optional[float] = None    # over the same server with one client, same temperature
                                             # and round
    round: int = 0                           # --rounds: which pass over the cells
    vs_plain: Optional[float] = None         # ours-eagle3 over ours at the same max_batch, clients,
                                             # temperature and round


# ---------------------------------------------------------------------------- one request
@functools.lru_cache(maxsize=None)
def served_model(url: str) -> str:
    """The model name a server answers to: the first of its /v1/models (a server of ours started
    here serves MODEL_NAME; one given by --url, whatever it was started with)."""
    r = httpx.get(url + "/v1/models", timeout=30)
    models = r.json().get("data") if r.status_code == 200 else None
    if not models or not isinstance(models[0], dict) or "id" not in models[0]:
        raise SystemExit(f"{url}/v1/models (HTTP {r.status_code}) lists no model id: {r.text[:200]!r}; "
                         "bench an OpenAI-compatible server")
    return models[0]["id"]


async def stream_request(client: httpx.AsyncClient, url: str, text: str, tokens: int,
                         temperature: float, seed: int, index: int) -> RequestTiming:
    body = {"model": served_model(url), "messages": [{"role": "user", "content": text}], "stream": True,
            "max_tokens": tokens, "temperature": temperature, "seed": seed, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    stamps: list[float] = []
    used = 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"request {index}: HTTP {resp.status_code}: {await resp.aread()!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if event.get("usage"):
                used = event["usage"]["completion_tokens"]
            if any((c.get("delta") or {}).get("content") for c in event.get("choices", [])):
                stamps.append(time.perf_counter())
    end = time.perf_counter()
    if not stamps:
        raise RuntimeError(f"request {index}: no content streamed")
    return RequestTiming(index, used, stamps[0] - t0, [b - a for a, b in zip(stamps, stamps[1:])],
                         end - t0)


async def run_clients(url: str, prompts: list[str], clients: int, tokens: int,
                      temperature: float) -> tuple[list[RequestTiming], float]:
    """All prompts, at most `clients` in flight; (timings, wall seconds)."""
    queue: asyncio.Queue = asyncio.Queue()
    for i, text in enumerate(prompts):
        queue.put_nowait((i, text))
    timings: list[RequestTiming] = []
    limits = httpx.Limits(max_connections=clients + 1)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def worker() -> None:
            while not queue.empty():
                i, text = queue.get_nowait()
                timings.append(await stream_request(client, url, text, tokens, temperature, i, i))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        wall = time.perf_counter() - t0
    return sorted(timings, key=lambda t: t.prompt), wall


# ---------------------------------------------------------------------------- statistics
def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); nan for no data."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def summarize(timings: list[RequestTiming], wall: float, max_batch: Optional[int], clients: int,
              temperature: float, system: str = "ours", rnd: int = 0) -> Result:
    tokens = sum(t.tokens for t in timings)
    ttft = [t.ttft_s * 1000 for t in timings]
    gaps = [g * 1000 for t in timings for g in t.gaps_s]
    return Result(max_batch, clients, temperature, len(timings), tokens, round(wall, 3),
                  round(tokens / wall, 2), round(percentile(ttft, 50), 1), round(percentile(ttft, 99), 1),
                  round(percentile(gaps, 50), 1), round(percentile(gaps, 99), 1),
                  round(statistics.median(t.e2e_s for t in timings), 3), system=system, round=rnd)


def with_baseline(results: list[Result]) -> list[Result]:
    """tokens/s over ours --max-batch 1 at the same clients and temperature, and over the same
    server (system and max_batch) with one client at the same temperature, where they ran; both
    within the same round."""
    base = {(r.clients, r.temperature, r.round): r.tokens_per_s for r in results
            if r.system == "ours" and r.max_batch == 1}
    one = {(r.system, r.max_batch, r.temperature, r.round): r.tokens_per_s for r in results if r.clients == 1}
    plain = {(r.max_batch, r.clients, r.temperature, r.round): r.tokens_per_s for r in results
             if r.system == "ours"}
    out = []
    for r in results:
        b = base.get((r.clients, r.temperature, r.round))
        o = one.get((r.system, r.max_batch, r.temperature, r.round))
        p = plain.get((r.max_batch, r.clients, r.temperature, r.round)) if r.system == "ours-eagle3" else None
        out.append(Result(**{**asdict(r), "vs_batch1": round(r.tokens_per_s / b, 2) if b else None,
                             "vs_one_client": round(r.tokens_per_s / o, 2) if o else None,
                             "vs_plain": round(r.tokens_per_s / p, 2) if p else None}))
    return out


def medians(results: list[Result]) -> list[Result]:
    """One row per cell (system, max_batch, clients, temperature): the median over rounds of each
    figure (the ratios are medians of each round's own ratio)."""
    cells: dict[tuple, list[Result]] = {}
    for r in results:
        cells.setdefault((r.system, r.max_batch, r.clients, r.temperature), []).append(r)
    out = []
    for rs in cells.values():
        mid = {k: statistics.median(getattr(r, k) for r in rs)
               for k in ("wall_s", "tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms",
                         "itl_p99_ms", "e2e_p50_s")}
        ratio = {k: (statistics.median(getattr(r, k) for r in rs) if getattr(rs[0], k) is not None else None)
                 for k in ("vs_batch1", "vs_one_client", "vs_plain")}
        out.append(Result(**{**asdict(rs[0]), **mid, **ratio, "round": -1}))
    return out


def table(results: list[Result]) -> str:
    head = (f"{'system':>11} {'batch':>5} {'clients':>7} {'T':>3} {'reqs':>4} {'tok/s':>8} "
            f"{'x 1 client':>10} {'x ours b1':>9} {'x plain':>7} "
            f"{'TTFT p50':>9} {'p99':>7} {'ITL p50':>8} {'p99':>7} {'e2e p50':>8}")
    lines = [head, "-" * len(head)]
    for r in results:
        vs = f"{r.vs_batch1:.2f}x" if r.vs_batch1 is not None else "-"
        one = f"{r.vs_one_client:.2f}x" if r.vs_one_client is not None else "-"
        spec = f"{r.vs_plain:.2f}x" if r.vs_plain is not None else "-"
        lines.append(f"{r.system:>11} {r.max_batch if r.max_batch is not None else 'url':>5} {r.clients:>7} "
                     f"{r.temperature:>3g} {r.requests:>4} {r.tokens_per_s:>8.1f} {one:>10} {vs:>9} {spec:>7} "
                     f"{r.ttft_p50_ms:>7.0f}ms {r.ttft_p99_ms:>5.0f}ms {r.itl_p50_ms:>6.1f}ms "
                     f"{r.itl_p99_ms:>5.1f}ms {r.e2e_p50_s:>7.2f}s")
    return "\n".join(lines)


def save_plot(results: list[Result], path: Path) -> Path:
    """tokens/s, TTFT p50 and ITL p50 against clients: one line per (max_batch, temperature)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    series = sorted({(r.system, r.max_batch or 0, r.temperature) for r in results})
    for system, batch, temp in series:
        rs = sorted((r for r in results if (r.system, r.max_batch or 0, r.temperature) == (system, batch, temp)),
                    key=lambda r: r.clients)
        label = f"{system} {'max-batch ' + str(batch) if batch else ''} T={temp:g}"
        x = [r.clients for r in rs]
        for ax, ys in zip(axes, ([r.tokens_per_s for r in rs], [r.ttft_p50_ms for r in rs],
                                 [r.itl_p50_ms for r in rs])):
            ax.plot(x, ys, marker="o", label=label)
    for ax, name in zip(axes, ("aggregate tokens/s", "TTFT p50 (ms)", "inter-token latency p50 (ms)")):
        ax.set(xlabel="concurrent streaming clients", ylabel=name, title=name)
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------- the server
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ours_command(args, port: int, max_batch: int, speculative: bool) -> list[str]:
    """`eagle3 serve` from this checkout, batching up to max_batch: plain decoding, or with the
    default draft (speculative for a greedy request that runs alone)."""
    cmd = [sys.executable, "-c", "import sys; from eagle3.cli import main; sys.exit(main())", "serve",
           "--draft", "default" if speculative else "none", "--max-batch", str(max_batch),
           "--port", str(port), "--weights", args.weights, "--max-model-len", str(args.max_model_len),
           "--served-model-name", MODEL_NAME, "--max-queue", str(max(64, args.prompts)),
           "--log-level", "warning"]
    return cmd + (["--model", args.model] if args.model else [])


def vllm_settings(args):
    from .vllm_peer import DTYPES, VllmSettings, default_python
    python = Path(args.vllm_python) if args.vllm_python else default_python()
    return VllmSettings(python, (args.out / "vllm-serve").resolve(), args.threads, DTYPES[args.weights],
                        args.vllm_eager, args.max_model_len, args.chain_depth)


def vllm_missing(args) -> Optional[str]:
    """Why the vLLM systems cannot run here (with the install line), or None."""
    from .vllm_peer import INSTALL, PYTHON_ENV
    s = vllm_settings(args)
    if not s.python.is_file():
        return (f"no vLLM venv at {s.python} (install: {INSTALL}; elsewhere pass --vllm-python or set "
                f"{PYTHON_ENV})")
    return None


def vllm_command(args, port: int, max_batch: int, speculative: bool) -> tuple[list[str], dict, Path]:
    """(command, environment, log file) of vLLM's OpenAI server on our weights (and draft)."""
    from .vllm_peer import (child_env, export_for_vllm, model_dir_for_vllm,
                                        server_command)
    from ..runtime.loader import resolve_model
    s = vllm_settings(args)
    name = "vllm-eagle3" if speculative else "vllm"
    s.work_dir.mkdir(parents=True, exist_ok=True)
    src = resolve_model(args.model)
    draft_dir = None
    if speculative:
        from ..api import load_engine
        from ..config import REFERENCE, RunConfig
        engine = load_engine(args.model, draft="default",        # the modules as loaded
                             config=RunConfig(weights=REFERENCE, draft_weights=REFERENCE))
        draft_dir = export_for_vllm(engine.draft, engine.target.config, src.hf_dir, s.work_dir,
                                    args.chain_depth)
    model_dir = model_dir_for_vllm(src.hf_dir, s.work_dir)
    cmd = server_command(s, model_dir, draft_dir, port, max_batch, MODEL_NAME)
    return cmd, child_env(s, name), s.work_dir / name / "server.log"


def start_server(args, system: str, max_batch: int) -> tuple[subprocess.Popen, str]:
    """The system's server as a child process; (process, url) once /health answers."""
    port = free_port()
    if system.startswith("vllm"):
        cmd, env, log_path = vllm_command(args, port, max_batch, system == "vllm-eagle3")
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, cwd=log_path.parent, env=env, stdout=log, stderr=subprocess.STDOUT)
        where = f" (log {log_path})"
    else:
        proc = subprocess.Popen(ours_command(args, port, max_batch, system == "ours-eagle3"), cwd=ROOT)
        where = ""
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.start_timeout
    t0 = time.monotonic()
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{system} server exited with status {proc.returncode}{where}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                print(f"{system} (max batch {max_batch}) up in {time.monotonic() - t0:.0f} s", flush=True)
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(proc)
    raise SystemExit(f"{system} server did not answer /health within {args.start_timeout} s{where}")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def warm_up(args, url: str, prompts: list[str]) -> None:
    # a compiled server (vLLM) compiles its batch sizes on first use
    asyncio.run(run_clients(url, prompts[:1], 1, min(16, args.tokens), 0.0))
    asyncio.run(run_clients(url, prompts[:max(args.clients)], max(args.clients), 8, 0.0))


def reset_prefix_cache(url: str) -> bool:
    """Empty our server's prefix cache (POST /reset_prefix_cache): every cell sends the same
    prompts, so a cache kept from the cell before would skip their prefill; within a cell, prompts
    share what a server may legitimately reuse (the chat template's opening). vLLM's server runs
    with its prefix caching off (vllm_peer.server_command). False where the route is refused."""
    try:
        return httpx.post(url + "/reset_prefix_cache", timeout=30).status_code == 200
    except httpx.HTTPError:
        return False


def in_turn(servers: list, rnd: int) -> list:
    """The order the servers run a cell in round `rnd`: as given, reversed in odd rounds."""
    return list(servers) if rnd % 2 == 0 else list(reversed(servers))


def bench_servers(args, servers: list[tuple[str, Optional[int], str]], prompts: list[str]) -> list[Result]:
    """Every (temperature, clients) cell on each of `servers` ((system, max_batch, url)) back to
    back, so that a machine whose speed drifts over the run shifts every system alike, the
    servers' order reversed every other round (two identical plain servers, the second always
    after the first: the second 1.01-1.05x the first in 7 of 8 cells, 2026-12-06); each of our
    servers' prefix caches emptied before each of its cells."""
    for _, _, url in servers:
        warm_up(args, url, prompts)
    results = []
    for rnd in range(args.rounds):
        for temp in args.temperatures:
            for clients in args.clients:
                for system, max_batch, url in in_turn(servers, rnd):
                    if system.startswith("ours") and not reset_prefix_cache(url):
                        raise SystemExit(f"{system}: POST /reset_prefix_cache refused: its prefix "
                                         "cache would carry the previous cell's prompts")
                    timings, wall = asyncio.run(run_clients(url, prompts, clients, args.tokens, temp))
                    results.append(summarize(timings, wall, max_batch, clients, temp, system, rnd))
                    print(table(results[-1:]).splitlines()[-1], flush=True)
    return results


# ---------------------------------------------------------------------------- main
def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="eagle3 bench serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument("--weights", choices=WEIGHT_CHOICES, default="auto",
                   help="the server's --weights (default auto: a GGUF target's own codes, else fp32)")
    p.add_argument("--systems", type=lambda t: [x for x in t.split(",") if x], default=["ours"],
                   help=f"comma-separated, of {', '.join(SYSTEMS)} (default ours)")
    p.add_argument("--max-batch", type=int_list, default=[16],
                   help="our server's --max-batch values, one server each (default 16; with 1 among "
                        "them, 'x ours b1' compares against it); vLLM batches up to the largest "
                        "(--max-num-seqs)")
    p.add_argument("--clients", type=int_list, default=[1, 4, 16])
    p.add_argument("--temperatures", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 1.0])
    p.add_argument("--tokens", type=int, default=128, help="new tokens per request")
    p.add_argument("--prompts", type=int, default=32, help="questions of the workload per run")
    p.add_argument("--workload", choices=["mtbench", "copy"], default="mtbench",
                   help="MT-bench questions, or the copy workload (answers that quote their prompt)")
    p.add_argument("--rounds", type=int, default=1,
                   help="passes over every cell (the machine's speed drifts: each ratio is taken "
                        "within a round, and the summary is the median over rounds)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--url", default=None, help="bench this running server instead (the first model "
                                               "its /v1/models lists)")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="vLLM's pinned cores (default: all this process may use; ours uses them all)")
    p.add_argument("--chain-depth", type=int, default=3, help="vllm-eagle3's draft chain (default 3)")
    p.add_argument("--vllm-python", default=None,
                   help="python of the vLLM venv (default: $EAGLE3_VLLM_PYTHON, else .venv-vllm)")
    p.add_argument("--vllm-eager", action="store_true", help="vLLM with --enforce-eager")
    p.add_argument("--out", type=Path, default=Path("runs") / "bench-serve")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    unknown = [x for x in args.systems if x not in SYSTEMS]
    if unknown:
        raise SystemExit(f"--systems: unknown {unknown}; choose from {', '.join(SYSTEMS)}")
    from .workload import workload_questions
    prompts = [q.text for q in workload_questions(args.workload, args.prompts)]
    results: list[Result] = []
    skipped: dict[str, str] = {}
    if args.url:
        results = bench_servers(args, [("url", None, args.url.rstrip("/"))], prompts)
    # ours: every server up at once (an idle one waits on a condition, using no CPU), the cells
    # interleaved; vLLM's after, one server at a time (its idle engine process shares the cores)
    ours = [] if args.url else ([("ours", b) for b in args.max_batch if "ours" in args.systems]
                                + [("ours-eagle3", b) for b in args.max_batch if "ours-eagle3" in args.systems])
    peers = [] if args.url else [(x, max(args.max_batch)) for x in ("vllm", "vllm-eagle3")
                                 if x in args.systems]
    procs = []
    try:
        servers = []
        for system, batch in ours:
            proc, url = start_server(args, system, batch)
            procs.append(proc)
            servers.append((system, batch, url))
        results += bench_servers(args, servers, prompts) if servers else []
    finally:
        for proc in procs:
            stop_server(proc)
    missing = vllm_missing(args) if peers else None
    for system, batch in peers:
        if missing:
            skipped[system] = missing
            print(f"{system}: skipped: {missing}", flush=True)
            continue
        try:
            proc, url = start_server(args, system, batch)
        except (SystemExit, Exception) as e:     # a peer that does not start is said, not fatal
            skipped[system] = f"{type(e).__name__}: {e}"
            print(f"{system}: skipped: {skipped[system]}", flush=True)
            continue
        try:
            results += bench_servers(args, [(system, batch, url)], prompts)
        finally:
            stop_server(proc)
    results = with_baseline(results)
    summary = medians(results) if args.rounds > 1 else results
    print(f"\n{len(prompts)} {args.workload} prompts x {args.tokens} tokens, {args.weights} weights, "
          f"{os.cpu_count()} CPUs" + (f", median of {args.rounds} rounds" if args.rounds > 1 else "")
          + "\n" + table(summary))
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    (args.out / "serving.json").write_text(json.dumps(
        {"meta": meta, "skipped": skipped, "results": [asdict(r) for r in results],
         "medians": [asdict(r) for r in summary]}, indent=1) + "\n")
    plot = save_plot(summary, args.out / "serving.png")
    print(f"saved {args.out / 'serving.json'} and {plot}")
    return 0

