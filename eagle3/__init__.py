"""eagle3: EAGLE-3 speculative decoding in plain PyTorch.

`import eagle3` changes nothing in the process. The process-wide tuning eagle3 runs best with is
one call, `tune_process()`, made by the `eagle3` command and the server before anything imports
torch; a program that uses the library calls it first, before its own `import torch`.
"""

__version__ = "0.4.0"


def tune_process() -> list[tuple[str, str]]:
    """Tune this process for decoding, once (later calls change nothing); what is in effect:
    [("CPU threads", ...), ("C allocator", ...)], as `eagle3 info` shows it.

    - OpenMP spins briefly at its barriers (GOMP_SPINCOUNT=30000, set in the environment, so also
      for child processes) unless OMP_WAIT_POLICY or GOMP_SPINCOUNT is set (threads.configure).
      OpenMP reads it when torch loads: call this before `import torch`.
    - glibc keeps freed buffers below 64 MiB in the process (mallopt), so a decode step's
      temporaries stop page-faulting, unless the user chose (MALLOC_*_ variables, another
      allocator in LD_PRELOAD, EAGLE3_MALLOC=0) (memory.tune)."""
    from . import memory, threads
    return [("CPU threads", threads.install()), ("C allocator", memory.tune_once())]
