"""How the CPU threads wait: set for every entry point before torch (and OpenMP) loads.

Why: at a barrier, OpenMP threads spin by default. With a core taken by another process, plain
bf16 decoding on 2 threads fell from 86 to 24 tok/s (threads spinning for a thread that is not
running); OMP_WAIT_POLICY=PASSIVE (waiting threads sleep) gave 58 tok/s, about a core's share.
libgomp reads the variable once, when it loads at `import torch`, so eagle3/__init__.py calls
configure() before anything imports torch. The kernels' extension needs libgomp.so.1 too and
gets torch's copy (its rpath names torch/lib; the loader reuses the library already loaded), so
torch, oneDNN and the kernels share one runtime and this one setting. A user's OMP_WAIT_POLICY
wins; GOMP_SPINCOUNT (spins before sleeping) still tunes PASSIVE.
"""
from __future__ import annotations

import os
import sys
from typing import MutableMapping, NamedTuple, Optional

DEFAULT_WAIT_POLICY = "PASSIVE"


class ThreadSetup(NamedTuple):
    wait_policy: str        # what OpenMP in this process uses
    source: str             # who chose it


_SETUP: Optional[ThreadSetup] = None     # what configure() found at import; read by describe()


def configure(environ: MutableMapping[str, str] = os.environ,
              torch_loaded: Optional[bool] = None) -> ThreadSetup:
    """Set OMP_WAIT_POLICY=PASSIVE unless the user set it; say what is in effect."""
    loaded = "torch" in sys.modules if torch_loaded is None else torch_loaded
    user = environ.get("OMP_WAIT_POLICY")
    if user:
        return ThreadSetup(user.upper(), "set by the user")
    environ["OMP_WAIT_POLICY"] = DEFAULT_WAIT_POLICY      # also for child processes
    if loaded:
        return ThreadSetup("OpenMP's default (spin, then sleep)",
                           "torch was imported before eagle3, so OpenMP had already read its settings")
    return ThreadSetup(DEFAULT_WAIT_POLICY, "eagle3 default")


def describe() -> str:
    """One line for `eagle3 info`: thread count and wait policy."""
    import torch
    setup = _SETUP or ThreadSetup(os.environ.get("OMP_WAIT_POLICY", "?"), "unknown")
    return (f"{torch.get_num_threads()} (torch.get_num_threads), "
            f"OMP_WAIT_POLICY={setup.wait_policy} ({setup.source})")


def install() -> None:
    """Called once from eagle3/__init__.py."""
    global _SETUP
    if _SETUP is None:
        _SETUP = configure()
