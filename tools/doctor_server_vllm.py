"""`eagle3 doctor --server` against real vLLM (CPU build): three servers, three verdicts (not a CI test).

| case                  | vLLM started with                                            | expected verdict            |
|-----------------------|--------------------------------------------------------------|-----------------------------|
| speculators           | our shipped draft exported in the speculators layout         | ok (server.offline passes)  |
| specforge-one-early   | a SpecForge-layout export with ids only in eagle_config:     | server.offline fails (or    |
|                       | vLLM reads that list raw, one layer early                    | server.tau on zero)         |
| plain                 | no --speculative-config                                      | server.speculation fails    |

Each server is vLLM's OpenAI server (bench/vllm_peer.server_command: the bench's dtype, seed, no
prefix caching, threads pinned, caches under --out) on 127.0.0.1, waited for on /v1/models, checked
with `run_server_doctor(url, target=packaged SmolLM2, draft=shipped draft, offline=True)` and
stopped. Prints one line per case and exits 1 when a verdict differs from the table. Minutes per
case (vLLM's start-up).

    bash scripts/vllm_env.sh                      # once: the vLLM venv (.venv-vllm)
    .venv/bin/python tools/doctor_server_vllm.py [--vllm-python .venv-vllm/bin/python] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Optional

EXPECTED = {   # case -> (check that decides, its status)
    "speculators": ("server.offline", "pass"),
    "specforge-one-early": ("server.offline", "fail"),
    "plain": ("server.speculation", "fail"),
}


def draft_dirs(root: Path) -> tuple[dict[str, Optional[Path]], Path]:
    """The cases' drafts (None: no draft) and the target directory vLLM serves."""
    from eagle3.api import default_draft_path
    from eagle3.bench.vllm_peer import model_dir_for_vllm
    from eagle3.draft.formats import load_draft, save_draft
    from eagle3.engines import IDS_KEY
    from eagle3.export.writer import resolve_target
    from eagle3.models.target import TargetFacts
    target = resolve_target(None)
    facts = TargetFacts.of(target.config, target.path)
    draft, _ = load_draft(default_draft_path(None), target.config)
    good = save_draft(draft, root / "speculators", "speculators", facts, speculative_tokens=3)
    early = save_draft(draft, root / "specforge-one-early", "specforge", facts)
    config = json.loads((early / "config.json").read_text())
    config.pop(IDS_KEY)                  # ids only in eagle_config (output numbering): vLLM reads raw
    (early / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    model_dir = model_dir_for_vllm(Path(target.path), root)
    return {"speculators": good, "specforge-one-early": early, "plain": None}, model_dir


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with {proc.returncode} before answering")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise TimeoutError(f"vLLM did not answer {url}/v1/models within {timeout_s:g} s")


def run_case(name: str, draft: Optional[Path], model_dir: Path, args: argparse.Namespace) -> dict:
    from eagle3.bench.vllm_peer import VllmSettings, child_env, server_command
    from eagle3.api import default_draft_path
    from eagle3.doctor import run_server_doctor
    from eagle3.doctor.server import ServerSettings
    s = VllmSettings(python=Path(args.vllm_python), work_dir=args.out, threads=args.threads,
                     dtype="float32", enforce_eager=True, max_model_len=1024, chain_depth=3)
    port = free_port()
    log = open(args.out / f"{name}.log", "w")
    proc = subprocess.Popen(server_command(s, model_dir, draft, port, 1, "smollm2"),
                            env=child_env(s, name), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, args.start_timeout)
        report = run_server_doctor(url, target=None, draft=str(default_draft_path(None)),
                                   offline=True, settings=ServerSettings(max_tokens=32))
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
    check, want = EXPECTED[name]
    got = next((c.status for c in report.checks if c.name == check), "missing")
    return {"case": name, "check": check, "expected": want, "got": got, "agree": got == want,
            "report": report.to_dict()}


def main(argv: Optional[list[str]] = None) -> int:
    from eagle3.bench.vllm_peer import default_python
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vllm-python", default=str(default_python()))
    p.add_argument("--out", type=Path, default=None, help="logs, exports and caches (default: a temp dir)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--start-timeout", type=float, default=900.0, help="seconds for vLLM to start")
    args = p.parse_args(argv)
    if not Path(args.vllm_python).is_file():
        print(f"no vLLM python at {args.vllm_python}: run bash scripts/vllm_env.sh", file=sys.stderr)
        return 2
    args.out = Path(args.out or tempfile.mkdtemp(prefix="doctor-vllm-")).resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    drafts, model_dir = draft_dirs(args.out)
    results = [run_case(name, draft, model_dir, args) for name, draft in drafts.items()]
    for r in results:
        print(f"{'agree   ' if r['agree'] else 'DISAGREE'} {r['case']:<22} {r['check']} "
              f"{r['got']} (expected {r['expected']})")
    (args.out / "doctor_server_vllm.json").write_text(json.dumps(results, indent=2, default=str))
    print(f"reports: {args.out / 'doctor_server_vllm.json'}")
    return 0 if all(r["agree"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
