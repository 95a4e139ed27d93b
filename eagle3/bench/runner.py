"""Build every system on the same weights and prompts, warm them up, run them interleaved.

Per prompt and temperature every system runs once; the system order rotates from prompt to prompt
so that no system always runs first (or right after a given neighbour) on a shared machine.
"""
from __future__ import annotations

import platform
import sys
import time
from dataclasses import replace, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from ..config import REFERENCE, RunConfig, available_cores, use
from ..draft.names import resolve_draft_name
from ..errors import InputError
from ..speculative.policy import DEFAULT_SHAPES, name_of
from ..speculative.tree import SpecParams
from ..runtime.costs import cpu_name
from .memory import PeakMemory, rss_bytes
from .stats import Record
from .systems import ADAPTIVE, GenParams, System, build_hf, build_ours
from .workload import WORKLOADS, BenchPrompt, make_prompts, warmup_prompt, workload_questions

WARMUP_TOKENS = 16


@dataclass(frozen=True)
class BenchConfig:
    model: Optional[str] = None
    draft: str = "default"
    prompts: int = 80
    max_new_tokens: int = 256
    temperatures: tuple[float, ...] = (0.0, 1.0)
    seed: int = 0
    # our engine's weights, draft weights, device, and every system's threads (None: all cores)
    run: RunConfig = field(default_factory=lambda: RunConfig(threads=2))
    chain_depth: int = 5
    tree: SpecParams = SpecParams()
    prompt_lookup: int = 10
    systems: Optional[tuple[str, ...]] = None      # None = all available
    ignore_eos: bool = False
    max_model_len: int = 2048
    clock: str = "wall"                            # "cpu": process CPU time (needs threads == 1)
    workload: str = "mtbench"                      # a key of workload.WORKLOADS
    vllm_python: Optional[str] = None              # None: $EAGLE3_VLLM_PYTHON or .venv-vllm/bin/python
    vllm_eager: bool = False                       # vLLM enforce_eager (default: compiled)
    out_dir: str = "runs/bench"                    # the bench's directory (vLLM's draft, caches, logs)

    def __post_init__(self):
        if self.workload not in WORKLOADS:
            raise InputError(f"--workload must be one of {', '.join(WORKLOADS)}, got {self.workload!r}")
        if self.clock not in ("wall", "cpu"):
            raise InputError(f"--clock must be wall or cpu, got {self.clock!r}")
        if self.clock == "cpu" and self.threads != 1:
            raise InputError(f"--clock cpu needs --threads 1 (got {self.threads}): with more threads "
                             "CPU time counts every thread, spin-waits included")

    @property
    def threads(self) -> int:
        return self.run.threads or available_cores()

    @property
    def weights(self) -> str:
        """Our target's weights (RunConfig.weights; the peers' dtype follows it)."""
        return self.run.weights

    @property
    def draft_weights(self) -> str:
        return self.run.draft_weights

    @property
    def device(self) -> Optional[str]:
        return self.run.device


@dataclass
class Setup:
    systems: list[System]
    skipped: list[tuple[str, str]]
    prompts: list[BenchPrompt]
    warm: BenchPrompt
    stop_ids: tuple[int, ...]
    depths: dict[str, int]                  # speculative system -> draft depth
    target: object                          # our (packed) target, for the roofline
    weight_bytes: int
    load_rss_mb: dict[str, float] = field(default_factory=dict)
    startup: dict[str, dict] = field(default_factory=dict)   # child-process systems: start-up s, version


# ---------------------------------------------------------------------------- setup
def resolve_draft(cfg: BenchConfig) -> tuple[Optional[str], Optional[str]]:
    """(draft argument for load_engine, reason when there is none)."""
    choice = resolve_draft_name(cfg.draft, cfg.model)
    return (str(choice.path) if choice.path is not None else None), choice.reason


def spec_shapes(cfg: BenchConfig) -> dict[str, SpecParams]:
    chain = SpecParams.chain(cfg.chain_depth)
    t = cfg.tree
    hybrid = replace(t, suffix_tokens=t.suffix_tokens or HYBRID_SUFFIX_TOKENS)
    return {f"ours-chain{cfg.chain_depth}": chain, "ours-" + name_of(t): t,
            "ours-hybrid-" + name_of(hybrid): hybrid}


HYBRID_SUFFIX_TOKENS = 8    # ours-hybrid: the tree shape plus up to this many suffix nodes


def wanted(cfg: BenchConfig, name: str) -> bool:
    if cfg.systems is None:
        return True
    return any(name == s or (s.endswith("*") and name.startswith(s[:-1])) for s in cfg.systems)


def context_len(cfg: BenchConfig, prompts: list[BenchPrompt]) -> int:
    """Cache length for the longest prompt plus the budget (each engine preallocates it)."""
    need = max(len(p.ids) for p in prompts) + max(cfg.max_new_tokens, WARMUP_TOKENS) + 8
    if need > cfg.max_model_len:
        raise InputError(f"the longest prompt needs {need} tokens of context; raise --max-model-len "
                         f"(now {cfg.max_model_len}) or lower --max-new-tokens")
    return need


class Builder:
    """Builds system groups, recording the RSS each group added and what was skipped."""

    def __init__(self) -> None:
        self.systems: list[System] = []
        self.skipped: list[tuple[str, str]] = []
        self.load_rss_mb: dict[str, float] = {}

    def add(self, group: str, build: Callable[[], tuple[list, list]]) -> None:
        before = rss_bytes()
        systems, skipped = build()
        self.systems += systems
        self.skipped += skipped
        if systems:
            self.load_rss_mb[group] = (rss_bytes() - before) / 2**20


def build(cfg: BenchConfig, log: Callable[[str], None] = print) -> Setup:
    """Every wanted system on the same weights; the prompts; what was skipped and why."""
    from ..runtime.loader import load_tokenizer, resolve_model
    from .roofline import read_bytes_per_forward
    use(replace(cfg.run, threads=cfg.threads))
    src = resolve_model(cfg.model)
    tokenizer = load_tokenizer(src.hf_dir)
    prompts = make_prompts(tokenizer, workload_questions(cfg.workload, cfg.prompts), cfg.seed)
    warm = warmup_prompt(tokenizer)
    b = Builder()
    engine, no_draft = load_ours(cfg, b, context_len(cfg, prompts + [warm]))
    device = str(engine.target.device)
    log(f"target {src.name} on {device}, draft: {no_draft or 'loaded'}")
    if wanted(cfg, "llama.cpp-native") and src.gguf is not None:
        from .llamacpp import build_native
        b.add("llama.cpp-native", lambda: build_native(src.gguf, cfg.threads, cfg.max_model_len))
    if wanted(cfg, "llama.cpp-eagle3") and src.gguf is not None and engine.draft is not None:
        from .llamacpp import build_eagle3                       # converts the unpacked draft
        b.add("llama.cpp-eagle3", lambda: build_eagle3(
            engine.draft, engine.target.config, src.hf_dir, src.gguf, cfg.chain_depth,
            cfg.threads, cfg.max_model_len))
    shapes, target = add_ours(cfg, b, engine, no_draft, src)
    weight_bytes = read_bytes_per_forward(target)                # as laid out (fp32 or bf16)
    add_peers(cfg, b, src, device)
    add_vllm(cfg, b, src, engine)
    systems = sorted((s for s in b.systems if wanted(cfg, s.name)), key=lambda s: ORDER.index(
        "ours-spec" if s.name.startswith("ours-") and s.name != "ours-plain" else s.name))
    depths = {name: spec.depth for name, spec in shapes.items()}
    depths[ADAPTIVE] = max(s.depth for s in DEFAULT_SHAPES)
    depths.update({s.name: cfg.chain_depth for s in systems if s.name in CHAINED_PEERS})
    startup = {s.name: {"startup_s": s.startup_s, "version": s.version} for s in systems
               if getattr(s, "startup_s", None) is not None}
    return Setup(systems, b.skipped, prompts, warm, stop_ids_of(engine), depths, target,
                 weight_bytes, b.load_rss_mb, startup)


ORDER = ("ours-plain", "ours-spec", "hf-generate", "hf-generate-bf16", "hf-prompt-lookup", "llama.cpp",
         "llama.cpp-native", "llama.cpp-prompt-lookup", "llama.cpp-eagle3", "vllm-plain", "vllm-eagle3")
CHAINED_PEERS = ("llama.cpp-eagle3", "vllm-eagle3")      # draft a chain of --chain-depth tokens


def load_ours(cfg: BenchConfig, b: Builder, max_model_len: int):
    """Our engine, unpacked (the EAGLE-3 peer converts the plain draft); (engine, no-draft reason)."""
    from ..api import load_engine
    draft_arg, no_draft = resolve_draft(cfg)
    before = rss_bytes()
    engine = load_engine(cfg.model, draft_arg or "none", spec=cfg.tree, max_model_len=max_model_len,
                         config=replace(cfg.run, weights=REFERENCE, draft_weights=REFERENCE))
    b.load_rss_mb["ours"] = (rss_bytes() - before) / 2**20
    return engine, no_draft


def stop_ids_of(engine) -> tuple[int, ...]:
    if not engine.eos_ids:
        raise InputError("the target has no eos token id; the bench needs one to stop generations")
    return tuple(sorted(engine.eos_ids))


def add_ours(cfg: BenchConfig, b: Builder, engine, no_draft: Optional[str], src):
    """The inference layouts (as load_engine builds them), then ours-plain and the chain and tree
    shapes; (shapes, the target's layout)."""
    from ..layouts import build_layouts
    before = rss_bytes()
    target, draft = build_layouts(engine.target, engine.draft, cfg.weights, cfg.draft_weights, src)
    shapes = spec_shapes(cfg) if engine.speculative else {}
    policy = None
    # without a draft (none shipped for this model, or --draft suffix) ours-adaptive runs suffix-only
    # blocks, as load_engine does
    if wanted(cfg, ADAPTIVE) and (draft is not None or resolve_draft_name(cfg.draft, cfg.model).suffix_only):
        from ..api import adaptive_policy
        policy = adaptive_policy(target, draft)                  # cost table: measured once, cached
    b.systems += build_ours(target, draft, engine.tokenizer, engine.max_model_len, shapes, policy)
    b.load_rss_mb["ours"] += (rss_bytes() - before) / 2**20
    b.skipped += [(n, no_draft) for n in spec_shapes(cfg) if not engine.speculative]
    return shapes, target


def add_peers(cfg: BenchConfig, b: Builder, src, device: str) -> None:
    if any(wanted(cfg, n) for n in ("hf-generate", "hf-prompt-lookup", "hf-generate-bf16")):
        b.add("hf", lambda: build_hf(src.hf_dir, device, cfg.prompt_lookup,
                                     bf16=cfg.weights == "bf16" and wanted(cfg, "hf-generate-bf16")))
    if src.gguf is None:
        b.skipped.append(("llama.cpp", f"{cfg.model} is not a GGUF target"))
    elif any(wanted(cfg, n) for n in ("llama.cpp", "llama.cpp-prompt-lookup")):
        from .llamacpp import build_binding
        b.add("llama.cpp", lambda: build_binding(src.gguf, cfg.threads, cfg.max_model_len,
                                                 cfg.prompt_lookup))


def add_vllm(cfg: BenchConfig, b: Builder, src, engine) -> None:
    """vllm-plain / vllm-eagle3 in child processes (our unpacked draft, exported for vLLM)."""
    from .vllm_peer import DTYPES, NAMES, VllmSettings, build_vllm, default_python
    names = tuple(n for n in NAMES if wanted(cfg, n))
    if not names:
        return
    python = Path(cfg.vllm_python) if cfg.vllm_python else default_python()
    settings = VllmSettings(python, Path(cfg.out_dir).resolve() / "vllm", cfg.threads, DTYPES[cfg.weights],
                            cfg.vllm_eager, cfg.max_model_len, cfg.chain_depth, cfg.seed)
    draft = engine.draft if engine.speculative else None
    b.add("vllm", lambda: build_vllm(names, settings, src.hf_dir, draft, engine.target.config))


# ---------------------------------------------------------------------------- run
def gen_params(cfg: BenchConfig, setup: Setup, temp: float, prompt: BenchPrompt,
               max_new_tokens: Optional[int] = None) -> GenParams:
    return GenParams(temp, max_new_tokens or cfg.max_new_tokens, prompt.seed, setup.stop_ids,
                     cfg.ignore_eos)


def rotate(items: list, k: int) -> list:
    k %= max(len(items), 1)
    return items[k:] + items[:k]


WALL_ONLY = ("llama.cpp-native", "llama.cpp-eagle3", "vllm-plain", "vllm-eagle3")   # child processes: own timers


def on_cpu_clock(res, cpu_s: float):
    """Replace wall seconds by this process's CPU seconds; scale the split to keep its fractions."""
    scale = cpu_s / res.seconds if res.seconds > 0 else 1.0
    res.seconds = cpu_s
    if res.draft_s is not None:
        res.draft_s, res.verify_s = res.draft_s * scale, res.verify_s * scale
    return res


def record(system: System, prompt: BenchPrompt, temp: float, res) -> Record:
    return Record(system.name, system.family, system.device, prompt.question_id, prompt.category,
                  temp, len(prompt.ids), len(res.tokens), res.seconds, res.tau, res.accept_lens,
                  res.draft_s, res.verify_s, res.other_s,
                  res.tokens if system.family in ("ours", "hf", "vllm") or system.name == "llama.cpp"
                  else None, res.extra)


class Failures:
    """A peer that crashes is dropped with its error; our own systems are never caught."""

    def __init__(self) -> None:
        self.failed: dict[str, str] = {}

    def call(self, system: System, fn: Callable):
        if system.name in self.failed:
            return None
        if system.family == "ours":
            return fn()
        try:
            return fn()
        except Exception as e:  # noqa: BLE001  peers: report and go on
            self.failed[system.name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            return None


def warmup(cfg: BenchConfig, setup: Setup, failures: Failures) -> None:
    """Untimed generations; the RSS they add (lazily mapped weights, caches) is charged to the
    system's group in load_rss_mb, next to what loading it added."""
    for system in setup.systems:
        before = rss_bytes()
        for temp in cfg.temperatures:
            params = gen_params(cfg, setup, temp, setup.warm, WARMUP_TOKENS)
            failures.call(system, lambda: system.warmup(setup.warm, params))
        if system.family in setup.load_rss_mb:
            setup.load_rss_mb[system.family] += max(rss_bytes() - before, 0) / 2**20


def run(cfg: BenchConfig, setup: Setup, progress: bool = True) -> tuple[list[Record], PeakMemory,
                                                                        dict[str, str]]:
    from tqdm import tqdm
    failures, peaks, records = Failures(), PeakMemory(), []
    warmup(cfg, setup, failures)
    total = len(setup.prompts) * len(cfg.temperatures) * len(setup.systems)
    bar = tqdm(total=total, disable=not progress, unit="run", file=sys.stderr, dynamic_ncols=True)
    for i, prompt in enumerate(setup.prompts):
        for temp in cfg.temperatures:
            for system in rotate(setup.systems, i):
                bar.set_postfix_str(f"q{prompt.question_id} T={temp:g} {system.name}")
                params = gen_params(cfg, setup, temp, prompt)
                with peaks.track(system.name, lambda s=system: getattr(s, "pid", None),
                                 system.device):
                    cpu0 = time.process_time()
                    res = failures.call(system, lambda: system.run(prompt, params))
                if res is not None and cfg.clock == "cpu" and system.name not in WALL_ONLY:
                    res = on_cpu_clock(res, time.process_time() - cpu0)
                if res is not None:
                    records.append(record(system, prompt, temp, res))
                bar.update(1)
    bar.close()
    return records, peaks, failures.failed


def machine_info(device: str) -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "cpu": cpu_name(), "logical_cpus": _cpus(),
            "torch_threads": torch.get_num_threads(), "device": device}
    if device.startswith("cpu"):
        from ..kernels import why
        info["small_m_kernels"] = why()
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
    for mod in ("transformers", "llama_cpp"):
        try:
            info[mod] = __import__(mod).__version__
        except ImportError:
            info[mod] = None
    return info



def _cpus() -> int:
    import os
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()

