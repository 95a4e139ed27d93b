"""Every EAGLE3_* environment variable: its meaning, its default and who reads it (a leaf module).

eagle3 reads these variables only through `env()` / `enabled()` below, and a name missing from
`VARIABLES` raises `UnknownSetting`, so a new variable is listed here (and in docs/configuration.md,
which tests/test_settings.py checks against this table) before it can be read. The run-level
choices among them (the kernels, VNNI, AMX, the thread governor, re-measuring the cost table) are
also fields of `eagle3.config.RunConfig`, whose defaults come from here; the others are
process-wide (the cache directory, the allocator) or belong to a tool (the bench's peers, the
server's key, the tests).

Nothing here writes the environment, except `set_for_process`, which `eagle3.config.use`
calls when a run asks for a switch the environment does not say.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, MutableMapping, Optional

ON, OFF = "1", "0"


class UnknownSetting(KeyError):
    """An EAGLE3_* name that is not in `VARIABLES` (add it there, with its meaning, first)."""


@dataclass(frozen=True)
class Variable:
    name: str
    default: str          # the value when unset ("" = unset: the meaning says what happens)
    meaning: str
    readers: tuple[str, ...]
    switch: bool = False  # on/off: read with enabled() (default "1": "0" turns it off; default
                          # "0": "1" turns it on)
    secret: bool = False  # `eagle3 info` says whether it is set, never its value

    @property
    def scope(self) -> str:
        """Who reads it: "eagle3" (the package), "scripts" or "tests" (outside the package)."""
        return "eagle3" if any(r.startswith("eagle3") for r in self.readers) else (
            "scripts" if any(r.startswith("scripts") for r in self.readers) else "tests")


VARIABLES: dict[str, Variable] = {v.name: v for v in (
    Variable("EAGLE3_KERNELS", ON, "the AVX-512 small-M kernels (0: off, oneDNN serves every linear); "
             "RunConfig.kernels", ("eagle3.kernels", "eagle3.config"), switch=True),
    Variable("EAGLE3_VNNI", ON, "4-bit GGUF codes and q4 drafts on AVX512-VNNI integer dot products "
             "(0: fp32 FMA); RunConfig.vnni", ("eagle3.kernels", "eagle3.config"), switch=True),
    Variable("EAGLE3_AMX", ON, "bf16 weights and 8+ row blocks of 4-bit codes on AMX tiles where the "
             "CPU has them (0: the vector path); RunConfig.amx", ("eagle3.kernels", "eagle3.config"),
             switch=True),
    Variable("EAGLE3_THREAD_GOVERNOR", ON, "decode on 1 thread while a busy core makes 2 slower "
             "(0: always torch.get_num_threads()); RunConfig.thread_governor",
             ("eagle3.threads", "eagle3.config"), switch=True),
    Variable("EAGLE3_REMEASURE", OFF, "1: measure the adaptive step's cost table again instead of "
             "reading the cached one; RunConfig.remeasure", ("eagle3.runtime.costs", "eagle3.config"),
             switch=True),
    Variable("EAGLE3_CACHE", "", "directory for converted checkpoints, compiled kernels and cost "
             "tables (unset: ~/.cache/eagle3; without a home directory, a temp dir)",
             ("eagle3.paths",)),
    Variable("EAGLE3_MALLOC", ON, "eagle3.tune_process() raises glibc's mmap and trim thresholds "
             "(0: the C library's defaults)", ("eagle3.memory",), switch=True),
    Variable("EAGLE3_API_KEY", "", "default of --api-key: the key `eagle3 serve` requires and "
             "`eagle3 doctor --server` sends (unset: none)", ("eagle3.serve.cli", "eagle3.doctor"),
             secret=True),
    Variable("EAGLE3_VLLM_PYTHON", "", "python of the vLLM venv for the bench's vLLM peers (unset: "
             ".venv-vllm/bin/python in the repository root)",
             ("eagle3.bench.vllm_peer", "tools/vllm_interop.py", "tools/vllm_specconfig_check.py",
              "eagle3.bench.serving", "scripts/cache_features.py", "tools/vllm_features_check.py")),
    Variable("EAGLE3_LLAMA_CPP", "", "llama.cpp build for the bench's llama.cpp-eagle3 peer (unset: "
             "~/.cache/eagle3/llama.cpp)", ("eagle3.bench.llamacpp", "scripts/build_llama_cpp.sh")),
    Variable("EAGLE3_VLLM_VENV", "", "where scripts/vllm_env.sh makes the vLLM venv (unset: "
             ".venv-vllm)", ("scripts/vllm_env.sh",)),
    Variable("EAGLE3_LLAMA_CPP_DIR", "", "a llama.cpp checkout whose convert_hf_to_gguf.py the export "
             "tests run (unset: those tests are skipped)", ("tests/test_export.py",)),
    Variable("EAGLE3_EXTRA_PYTHONPATH", "", "extra sys.path for that converter (e.g. a venv's "
             "site-packages with its dependencies)", ("tests/test_export.py",)),
    Variable("EAGLE3_SERVE_LOAD_REAL", "", "1: run the real-model load-figure test of the server",
             ("tests/test_serve_real.py",)),
    Variable("EAGLE3_TEST_THREADS", "2", "torch threads of a test run", ("tests/conftest.py",)),
)}


def variable(name: str) -> Variable:
    try:
        return VARIABLES[name]
    except KeyError:
        raise UnknownSetting(f"{name} is not an eagle3 setting; the known ones are in "
                             f"eagle3/settings.py: {', '.join(VARIABLES)}") from None


def env(name: str, environ: Mapping[str, str] = os.environ) -> str:
    """The variable's value, or its default where unset or empty."""
    return environ.get(name) or variable(name).default


def enabled(name: str, environ: Mapping[str, str] = os.environ) -> bool:
    """A switch: on unless "0" where its default is on; on only for "1" where its default is off."""
    var = variable(name)
    if not var.switch:
        raise UnknownSetting(f"{name} is not a switch (read it with env())")
    value = env(name, environ)
    return value != OFF if var.default == ON else value == ON


def set_for_process(values: Mapping[str, bool], environ: MutableMapping[str, str] = os.environ) -> None:
    """Set switches for this process and its children (the readers check them when they first run)."""
    for name, on in values.items():
        variable(name)
        environ[name] = ON if on else OFF


def current(environ: Mapping[str, str] = os.environ) -> list[tuple[str, str]]:
    """(name, the value in effect in words) of every variable, for `eagle3 info`."""
    def shown(v: Variable) -> str:
        if environ.get(v.name):
            return "set (not shown)" if v.secret else environ[v.name]
        return f"{v.default} (default)" if v.default else "unset"
    return [(v.name, shown(v)) for v in VARIABLES.values()]


def markdown(scope: Optional[str] = None) -> str:
    """The table of docs/configuration.md (scope: only the variables read there)."""
    rows = ["| variable | default | meaning | read by |", "|---|---|---|---|"]
    for v in VARIABLES.values():
        if scope is None or v.scope == scope:
            rows.append(f"| `{v.name}` | {f'`{v.default}`' if v.default else 'unset'} | {v.meaning} | "
                        f"{', '.join(f'`{r}`' for r in v.readers)} |")
    return "\n".join(rows)
