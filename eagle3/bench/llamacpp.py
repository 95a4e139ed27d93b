"""llama.cpp systems on the same GGUF: the Python binding (plain, prompt lookup), the vendored
llama.cpp's own plain generator (`llama-completion`, llama.cpp at its fastest: no Python between
tokens) and its EAGLE-3 mode (`llama-speculative-simple --spec-type draft-eagle3`, chain drafting).

The binding comes from `pip install llama-cpp-python==0.3.36`; the binaries and the draft converter
from scripts/build_llama_cpp.sh (cached under ~/.cache/eagle3/llama.cpp). Whatever is missing is
skipped with the reason. llama.cpp runs on the CPU here (the wheel is built without CUDA).
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

from .. import settings
from .systems import GenParams, RunResult
from .workload import BenchPrompt

LLAMA_CPP_HOME = Path(settings.env("EAGLE3_LLAMA_CPP") or Path.home() / ".cache/eagle3/llama.cpp")
SPEC_BINARY = "build/bin/llama-speculative-simple"
PLAIN_BINARY = "build/bin/llama-completion"
CONVERTER = "src/convert_hf_to_gguf.py"


def sampler_kwargs(params: GenParams) -> dict:
    """Plain temperature sampling (llama.cpp's defaults add top-k 40, top-p 0.95, min-p 0.05)."""
    return dict(top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0, repeat_penalty=1.0,
                temp=params.temperature)


# ---------------------------------------------------------------------------- Python binding
class LlamaCppSystem:
    family = "llama.cpp"
    device = "cpu"

    def __init__(self, name: str, llm):
        self.name, self.llm = name, llm

    def warmup(self, prompt: BenchPrompt, params: GenParams) -> None:
        self.run(prompt, params)

    def run(self, prompt: BenchPrompt, params: GenParams) -> RunResult:
        self.llm.reset()                     # no prefix reuse across prompts (fair prefill)
        self.llm.set_seed(params.seed)
        out: list[int] = []
        t0 = time.perf_counter()
        for tok in self.llm.generate(list(prompt.ids), **sampler_kwargs(params)):
            if tok in params.stop_ids and not params.ignore_eos:
                break
            out.append(int(tok))
            if len(out) >= params.max_new_tokens:
                break
        return RunResult(out, time.perf_counter() - t0)


def build_binding(gguf: Path, threads: int, n_ctx: int, prompt_lookup: int
                  ) -> tuple[list[LlamaCppSystem], list[tuple[str, str]]]:
    names = ("llama.cpp", "llama.cpp-prompt-lookup")
    if importlib.util.find_spec("llama_cpp") is None:
        reason = ("llama-cpp-python is not installed (CMAKE_BUILD_PARALLEL_LEVEL=1 nice -n 19 "
                  "pip install llama-cpp-python==0.3.36; builds from source)")
        return [], [(n, reason) for n in names]
    crash = binding_crash(gguf, threads)
    if crash:
        return [], [(n, crash) for n in names]
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    common = dict(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                  verbose=False)
    plain = Llama(**common)
    pld = Llama(**common, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=prompt_lookup))
    return [LlamaCppSystem(names[0], plain), LlamaCppSystem(names[1], pld)], []


# the binding generates two tokens from the GGUF in a child first: a crash there (a native build's
# AMX kernels segfault on the 2-core Sapphire Rapids VM, ggml_backend_amx_mul_mat on Q4_1) would
# otherwise take the whole bench run with it
SMOKE = """
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=64, n_threads=int(sys.argv[2]), verbose=False)
llm.reset()
for i, _ in enumerate(llm.generate([1, 2, 3], temp=0.0)):
    if i == 1:
        break
"""
NO_AMX_BUILD = ('CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON '
                '-DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON" pip install '
                '--force-reinstall --no-deps --no-cache-dir llama-cpp-python==0.3.36')


def binding_crash(gguf: Path, threads: int, timeout: float = 300) -> Optional[str]:
    """None when the binding runs the GGUF in a child process; else why the llama.cpp systems skip."""
    try:
        out = subprocess.run([sys.executable, "-c", SMOKE, str(gguf), str(threads)], capture_output=True,
                             text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"llama-cpp-python did not generate 2 tokens from {gguf.name} in {timeout:.0f} s"
    if out.returncode == 0:
        return None
    how = f"signal {-out.returncode}" if out.returncode < 0 else f"exit {out.returncode}"
    tail = (out.stderr.strip().splitlines() or [""])[-1][:200]
    missing = re.search(r"ModuleNotFoundError: No module named '([\w.]+)'", out.stderr)
    if missing:   # a binding installed with --no-deps (the rebuild line) lacks its dependencies
        module = missing.group(1).split(".")[0]
        return (f"llama-cpp-python cannot import {module!r} (a dependency it was installed without); "
                f"install it: pip install {module}")
    return (f"llama-cpp-python crashed generating from {gguf.name} ({how}{': ' + tail if tail else ''}); "
            f"a native build's AMX kernels do so on some CPUs, rebuild without them: {NO_AMX_BUILD}")


# ---------------------------------------------------------------------------- the binaries
class _BinaryPerPrompt:
    """A llama.cpp binary run once per generation on the chat-templated prompt as text (it
    tokenizes it itself); `pid` while it runs, for the bench's memory watch."""
    family = "llama.cpp"
    device = "cpu"

    def __init__(self, name: str, binary: Path):
        self.name, self.binary = name, binary
        self.tmp = Path(tempfile.mkdtemp(prefix="eagle3-bench-"))
        self.pid: Optional[int] = None

    def command(self, prompt_file: Path, params: GenParams) -> list[str]:
        raise NotImplementedError

    def warmup(self, prompt: BenchPrompt, params: GenParams) -> None:
        self.run(prompt, params)

    def log_of(self, prompt: BenchPrompt, params: GenParams) -> str:
        """The binary's stdout and stderr for one generation; a failed run raises with its tail."""
        prompt_file = self.tmp / "prompt.txt"
        prompt_file.write_text(prompt.chat_text, encoding="utf-8")
        proc = subprocess.Popen(self.command(prompt_file, params), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True)
        self.pid = proc.pid
        log, _ = proc.communicate()
        self.pid = None
        if proc.returncode != 0:
            raise RuntimeError(f"{self.binary.name} exited with {proc.returncode}:\n{log[-2000:]}")
        return log


# ---------------------------------------------------------------------------- EAGLE-3 binary
_ENC = re.compile(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_DEC = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_STAT = re.compile(r"^.*?(n_drafted|n_accept|n_predict)\s*=\s*(\d+)", re.M)


class SpecSimpleOutput(dict):
    """Parsed stderr of llama-speculative-simple."""

    @classmethod
    def parse(cls, log: str) -> "SpecSimpleOutput":
        enc, dec = _ENC.search(log), _DEC.search(log)
        if not enc or not dec:
            raise RuntimeError("llama-speculative-simple printed no timing lines:\n" + log[-2000:])
        out = cls(prompt_tokens=int(enc.group(1)), encode_s=float(enc.group(2)),
                  decoded=int(dec.group(1)), decode_s=float(dec.group(2)))
        out.update({k: int(v) for k, v in _STAT.findall(log)})
        return out

    @property
    def tau(self) -> Optional[float]:
        forwards = self.get("n_predict", 0) - self.get("n_accept", 0)
        return self["n_predict"] / forwards if forwards > 0 else None


class LlamaCppEagle3System(_BinaryPerPrompt):
    """One llama-speculative-simple process per generation; its own timers (prompt + decode) are
    used, so model loading is not counted. Its output text is not token ids: tokens are counted."""

    def __init__(self, name: str, binary: Path, target_gguf: Path, draft_gguf: Path, depth: int,
                 threads: int, n_ctx: int):
        super().__init__(name, binary)
        self.depth, self.target_gguf, self.draft_gguf = depth, target_gguf, draft_gguf
        self.threads, self.n_ctx = threads, n_ctx

    def command(self, prompt_file: Path, params: GenParams) -> list[str]:
        s = sampler_kwargs(params)
        cmd = [str(self.binary), "-m", str(self.target_gguf), "-md", str(self.draft_gguf),
               "--spec-type", "draft-eagle3", "--spec-draft-n-max", str(self.depth),
               "-f", str(prompt_file), "-n", str(params.max_new_tokens), "-c", str(self.n_ctx),
               "-t", str(self.threads), "-tb", str(self.threads), "--seed", str(params.seed),
               "--temp", str(s["temp"]), "--top-k", "0", "--top-p", "1", "--min-p", "0",
               "--repeat-penalty", "1", "-ngl", "0"]
        return cmd + (["--ignore-eos"] if params.ignore_eos else [])

    def run(self, prompt: BenchPrompt, params: GenParams) -> RunResult:
        out = SpecSimpleOutput.parse(self.log_of(prompt, params))
        # the binary may overshoot the budget by part of a draft; its own counts are used as is
        return RunResult([-1] * out["decoded"], out["encode_s"] + out["decode_s"], tau=out.tau,
                         extra=dict(out))


# ---------------------------------------------------------------------------- plain binary
_PERF = {key: re.compile(rf"{pattern}\s*=\s*([\d.]+) ms(?: /\s*(\d+))?") for key, pattern in (
    ("sampling", r"\bsampling time"), ("prompt", r"prompt eval time"),
    ("eval", r"(?<!prompt )\beval time"))}


class CompletionOutput(dict):
    """The timers llama-completion prints at its end (common_perf_print): prompt eval, eval and
    sampling milliseconds. Each emitted token but the last is evaluated once (eval runs); a
    generation that stops at the end-of-text token emits no more than it evaluated."""

    @classmethod
    def parse(cls, log: str) -> "CompletionOutput":
        found = {key: rx.search(log) for key, rx in _PERF.items()}
        missing = [key for key, m in found.items() if m is None]
        if missing:
            raise RuntimeError(f"llama-completion printed no {', '.join(missing)} timers:\n" + log[-2000:])
        runs = int(found["eval"].group(2))
        stopped = "[end of text]" in log
        return cls(prompt_tokens=int(found["prompt"].group(2)), prompt_ms=float(found["prompt"].group(1)),
                   eval_ms=float(found["eval"].group(1)), sampling_ms=float(found["sampling"].group(1)),
                   eval_runs=runs, emitted=runs if stopped else runs + 1, stopped_at_eos=stopped)

    @property
    def seconds(self) -> float:
        """Prompt, decode and sampling by its own timers (model loading and warm-up excluded)."""
        return (self["prompt_ms"] + self["eval_ms"] + self["sampling_ms"]) / 1e3


class LlamaCppNativeSystem(_BinaryPerPrompt):
    """One llama-completion process per generation: plain greedy or sampled decoding with
    llama.cpp's own samplers switched to plain temperature sampling, timed by its own timers."""

    def __init__(self, name: str, binary: Path, gguf: Path, threads: int, n_ctx: int):
        super().__init__(name, binary)
        self.gguf, self.threads, self.n_ctx = gguf, threads, n_ctx

    def command(self, prompt_file: Path, params: GenParams) -> list[str]:
        s = sampler_kwargs(params)
        cmd = [str(self.binary), "-m", str(self.gguf), "-f", str(prompt_file), "-no-cnv",
               "-n", str(params.max_new_tokens), "-c", str(self.n_ctx), "-t", str(self.threads),
               "-tb", str(self.threads), "--seed", str(params.seed), "--temp", str(s["temp"]),
               "--top-k", "0", "--top-p", "1", "--min-p", "0", "--repeat-penalty", "1", "-ngl", "0"]
        return cmd + (["--ignore-eos"] if params.ignore_eos else [])

    def run(self, prompt: BenchPrompt, params: GenParams) -> RunResult:
        out = CompletionOutput.parse(self.log_of(prompt, params))
        return RunResult([-1] * out["emitted"], out.seconds, extra=dict(out))


def build_native(gguf: Path, threads: int, n_ctx: int
                 ) -> tuple[list[LlamaCppNativeSystem], list[tuple[str, str]]]:
    name, binary = "llama.cpp-native", LLAMA_CPP_HOME / PLAIN_BINARY
    if not binary.is_file():
        return [], [(name, f"{binary} not built (optional: bash scripts/build_llama_cpp.sh)")]
    return [LlamaCppNativeSystem(name, binary, gguf, threads, n_ctx)], []


def draft_gguf_for(draft, target_config, hf_dir: Path, converter: Path) -> Path:
    """Write the draft in the SpecForge layout and convert it once (cached by its bytes)."""
    from ..draft.formats import save_draft
    staged = save_draft(draft, LLAMA_CPP_HOME / "drafts" / f"staging-{os.getpid()}", "specforge",
                        target_config, dtype=torch.float32)
    digest = hashlib.sha256()
    for f in sorted(staged.iterdir()):
        digest.update(f.name.encode() + f.read_bytes())
    out = LLAMA_CPP_HOME / "drafts" / f"draft-{digest.hexdigest()[:12]}.gguf"
    try:
        if not out.is_file():
            convert(converter, staged, hf_dir, out)
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    return out


def converter_missing_modules() -> list[str]:
    """Modules convert_hf_to_gguf.py imports before it can fall back to a tokenizer.json vocab.

    Without sentencepiece its Llama path dies on the import instead of reaching the fallback.
    """
    import importlib.util
    return [m for m in ("sentencepiece", "gguf") if importlib.util.find_spec(m) is None]


def convert(converter: Path, draft_dir: Path, hf_dir: Path, out: Path) -> None:
    """llama.cpp's converter, written to a temporary name first (a crash leaves no cached file)."""
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    cmd = [sys.executable, str(converter), str(draft_dir), "--target-model-dir", str(hf_dir),
           "--outtype", "f32", "--outfile", str(tmp)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"draft conversion failed ({' '.join(cmd)}):\n{res.stderr[-2000:]}")
    os.replace(tmp, out)


def build_eagle3(draft, target_config, hf_dir: Path, gguf: Path, depth: int, threads: int,
                 n_ctx: int) -> tuple[list[LlamaCppEagle3System], list[tuple[str, str]]]:
    name = "llama.cpp-eagle3"
    binary, converter = LLAMA_CPP_HOME / SPEC_BINARY, LLAMA_CPP_HOME / CONVERTER
    if draft is None:
        return [], [(name, "no draft")]
    if not binary.is_file() or not converter.is_file():
        return [], [(name, f"{binary} not built (optional: bash scripts/build_llama_cpp.sh)")]
    missing = converter_missing_modules()
    if missing:
        return [], [(name, f"llama.cpp's converter needs {', '.join(missing)}: "
                           f"pip install {' '.join(missing)} (or pip install -e '.[bench]')")]
    try:
        draft_gguf = draft_gguf_for(draft, target_config, hf_dir, converter)
    except RuntimeError as e:
        return [], [(name, str(e).splitlines()[0])]
    return [LlamaCppEagle3System(name, binary, gguf, draft_gguf, depth, threads, n_ctx)], []
