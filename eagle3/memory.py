"""The C allocator's settings for decoding: freed buffers stay in the process instead of going back
to the kernel, so a step's large temporaries do not page-fault in again every step.

glibc serves an allocation above its mmap threshold (128 KiB at first, raised as such blocks are
freed) with a fresh mapping, and hands the top of its heap back once more than the trim threshold
is free; every decode step then touches megabytes of new pages (a batch step's logits are
16 x 49152 fp32 = 3 MiB, its fp64 sampling buffers 6 MiB, a prefill chunk's activations more), each
page a fault and a zeroing (tests/test_memory.py checks the faults, docs/configuration.md gives
the measured gain). vLLM's CPU guide asks for tcmalloc through LD_PRELOAD for the same reason; this
needs no install. The cost: up to TRIM_THRESHOLD of freed memory stays mapped.

`tune()` runs once a process from eagle3.tune_process() (the `eagle3` command and the server call
it; `import eagle3` alone does not). It leaves the allocator alone where the user chose
(MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ / MALLOC_TOP_PAD_ set, another
allocator in LD_PRELOAD, EAGLE3_MALLOC=0) or where the C library is not glibc.
"""
from __future__ import annotations

import ctypes
import os
from typing import Mapping, Optional

from . import settings

MMAP_THRESHOLD = 64 << 20     # blocks below this come from the heap (model weights stay mmapped)
TRIM_THRESHOLD = 256 << 20    # free heap kept before returning memory to the kernel
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3     # glibc mallopt parameters
USER_KEYS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")

_STATE: Optional[str] = None


def tune(environ: Mapping[str, str] = os.environ) -> str:
    """Apply the thresholds unless the user chose otherwise; what is in effect, in words."""
    global _STATE
    if not settings.enabled("EAGLE3_MALLOC", environ):
        _STATE = "the C library's defaults (EAGLE3_MALLOC=0)"
    elif any(environ.get(k) for k in USER_KEYS):
        _STATE = "set by the user (" + ", ".join(k for k in USER_KEYS if environ.get(k)) + ")"
    elif any(n in environ.get("LD_PRELOAD", "") for n in ("tcmalloc", "jemalloc", "mimalloc")):
        _STATE = "the allocator in LD_PRELOAD"
    else:
        libc = _glibc()
        if libc is None:
            _STATE = "the C library's defaults (not glibc)"
        elif (libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
              and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1):
            _STATE = (f"glibc, heap below {MMAP_THRESHOLD >> 20} MiB, {TRIM_THRESHOLD >> 20} MiB kept "
                      "(eagle3 default; EAGLE3_MALLOC=0 for glibc's)")
        else:
            _STATE = "the C library's defaults (mallopt refused)"
    return _STATE


def tune_once() -> str:
    """tune() unless it ran already in this process; what is in effect."""
    return _STATE or tune()


def describe() -> str:
    """One line for `eagle3 info`."""
    return _STATE or "the C library's defaults (eagle3.tune_process() was not called)"


def _glibc() -> Optional[ctypes.CDLL]:
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        return libc
    except (OSError, AttributeError):
        return None


def freeze_loaded() -> int:
    """Move every object alive now (a loaded engine: modules, weights' wrappers, tokenizer) out of
    the garbage collector's reach, so its generation-2 passes during decoding walk only what came
    after (Python's gc.freeze, meant for this): a loaded model is hundreds of thousands of objects,
    and a pass over them inside a decode step costs several steps' time. Returns the number
    frozen."""
    import gc
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
