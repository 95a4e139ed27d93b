"""One run's configuration: the precision of the target and of the draft, the device and threads, the
backend switches. Shared by `load_engine`, `eagle3 generate`, `serve`, `bench` and `train`; the
command line builds it in one place (cli_args.run_config_from_args), from the flags and, for the
switches no flag carries, the environment (eagle3.settings). docs/configuration.md lists both.

    RunConfig()                                      # the defaults: what `eagle3 generate` runs
    RunConfig(weights="bf16", draft_weights="q4")    # --weights bf16 --draft-weights q4
    RunConfig(weights="reference")                   # the target's reference modules, no layout

Imports no torch: the command line builds it before torch (and OpenMP) load.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

from . import settings
from .errors import InputError

# the target's weights on the CPU (--weights): the flag's values, then the library's "reference"
WEIGHT_CHOICES = ("auto", "gguf", "gguf-exact", "fp32", "bf16")
GGUF_CHOICES = ("gguf", "gguf-exact")
# the draft's (--draft-weights)
DRAFT_WEIGHT_CHOICES = ("auto", "q4", "bf16", "fp32")
# the target's KV cache elements (--kv-cache-dtype)
KV_CACHE_CHOICES = ("auto", "fp16", "fp32")
REFERENCE = "reference"     # the modules as loaded (fp32), no inference layout
# RunConfig's precision fields -> the names each takes (`checked`: the one check of a name)
PRECISION_CHOICES = {"weights": WEIGHT_CHOICES + (REFERENCE,),
                     "draft_weights": DRAFT_WEIGHT_CHOICES + (REFERENCE,),
                     "kv_cache_dtype": KV_CACHE_CHOICES}

# backend switch field -> the environment variable that gives its default
SWITCHES = {"kernels": "EAGLE3_KERNELS", "vnni": "EAGLE3_VNNI", "amx": "EAGLE3_AMX",
            "thread_governor": "EAGLE3_THREAD_GOVERNOR", "remeasure": "EAGLE3_REMEASURE"}
KERNEL_SWITCHES = ("kernels", "vnni", "amx")     # read once a process, when the kernels are set up
# the switches their readers take from the environment (the kernels, the engine's governor); use()
# sets these for the process. remeasure travels as an argument (load_engine -> adaptive_policy).
PROCESS_SWITCHES = (*KERNEL_SWITCHES, "thread_governor")


def checked(field_name: str, value: str) -> str:
    """`value` when it is a name `field_name` takes (PRECISION_CHOICES), else an InputError listing
    them: the one check of a precision name (RunConfig, and the layouts' entry points for library
    callers who pass names)."""
    choices = PRECISION_CHOICES[field_name]
    if value not in choices:
        raise InputError(f"{field_name}={value!r}: choose one of {', '.join(choices)}")
    return value


def _from_env(name: str):
    return field(default_factory=lambda: settings.enabled(name))


@dataclass(frozen=True)
class RunConfig:
    """How a run executes. Precision changes speed and, for the target, the numbers; speculation
    is lossless against plain decoding on the same target weights whatever the choice.

    weights: the target's weights. "auto" (gguf for a GGUF target run natively on the CPU, else
      fp32), "gguf" (the file's own quantized codes on the kernels; one-byte inputs where the CPU
      has AVX512-VNNI, as llama.cpp runs it), "gguf-exact" (the same codes against exact inputs),
      "fp32" (the dequantised or checkpoint weights: matches HF transformers), "bf16" (bf16 GEMM
      weights, packed row-stable), or "reference" (the modules as loaded, no inference layout).
    draft_weights: the draft's. "auto" (q4 where the kernels run integer dot products, else bf16
      where oneDNN has bf16 kernels, else fp32), "q4", "bf16", "fp32", or "reference".
    kv_cache_dtype: the target's KV cache. "auto" (fp16 where the GGUF codes meet one-byte inputs
      on the kernels, as llama.cpp caches beside its 8-bit activations; else fp32), "fp16" (half
      the bytes attention reads, keys and values rounded once when written), "fp32" (full
      precision). Speculation stays lossless either way: verify and decode read the same cache.
    device: "cpu", "cuda", ... (None: cuda where available, else cpu).
    threads: torch's thread count for the run (None: leave torch's default, the cores this process
      may use).
    kernels, vnni, amx: allow the AVX-512 kernels, their integer dot products, AMX tiles (each still
      needs the CPU's support). A process sets its kernels up once, at their first use.
    thread_governor: drop to one thread while a busy core makes two slower (threads.ThreadGovernor).
    remeasure: measure the adaptive step's cost table again instead of reading the cached one.
    The switches default to their EAGLE3_* variables (SWITCHES), read when the config is made.
    """
    weights: str = "auto"
    draft_weights: str = "auto"
    kv_cache_dtype: str = "auto"
    device: Optional[str] = None
    threads: Optional[int] = None
    kernels: bool = _from_env("EAGLE3_KERNELS")
    vnni: bool = _from_env("EAGLE3_VNNI")
    amx: bool = _from_env("EAGLE3_AMX")
    thread_governor: bool = _from_env("EAGLE3_THREAD_GOVERNOR")
    remeasure: bool = _from_env("EAGLE3_REMEASURE")

    def __post_init__(self):
        for name in PRECISION_CHOICES:
            checked(name, getattr(self, name))
        if self.kv_cache_dtype != "auto" and self.weights == REFERENCE:
            raise InputError(f"kv_cache_dtype={self.kv_cache_dtype!r} needs an inference layout; "
                             "weights='reference' runs the modules as loaded (fp32 cache): "
                             "leave kv_cache_dtype 'auto' or choose other weights")
        if self.threads is not None and self.threads < 1:
            raise InputError(f"threads={self.threads}: at least 1 (None: torch's default)")

    @property
    def packed_target(self) -> bool:
        """The target runs an inference layout built from its weights (runtime.target)."""
        return self.weights != REFERENCE

    @property
    def packed_draft(self) -> bool:
        """The draft runs an inference layout (draft.inference)."""
        return self.draft_weights != REFERENCE

    @property
    def switches(self) -> dict[str, bool]:
        """The backend switches by their environment variable's name."""
        return {env: getattr(self, name) for name, env in SWITCHES.items()}


def available_cores() -> int:
    """The cores this process may use (the bench's default thread count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def use(config: RunConfig) -> None:
    """Make this process run `config`: torch's thread count where it gives one, and the switches
    that differ from the environment set there (the kernels and the engine's governor read them
    when they first run; PROCESS_SWITCHES). The kernels are set up once a process: asking to turn
    off what is already in use is an error, not a silent no-op."""
    changed = {SWITCHES[name]: getattr(config, name) for name in PROCESS_SWITCHES
               if settings.enabled(SWITCHES[name]) != getattr(config, name)}
    settings.set_for_process(changed)
    if {SWITCHES[k] for k in KERNEL_SWITCHES} & changed.keys():
        _check_kernels_agree(config)
    if config.threads is not None:
        import torch
        torch.set_num_threads(config.threads)


def _check_kernels_agree(config: RunConfig) -> None:
    """After the switches were set: the kernels as this process has them (set up now if not yet)."""
    from . import kernels
    st = kernels.state()
    in_use = {"kernels": st.module is not None, "vnni": st.vnni, "amx": st.amx or st.amx_int8}
    for name in KERNEL_SWITCHES:
        if in_use[name] and not getattr(config, name):
            raise InputError(f"{name}=False, but this process already runs them (the kernels are set up "
                             f"once, at their first use). Fix: set {SWITCHES[name]}=0 before the process "
                             "first loads a model")
