"""How the CPU threads wait, and how many run: set before torch (and OpenMP) loads, then governed.

The wait policies measured against each other, quiet and with a core taken: docs/configuration.md.

No wait policy serves both: a decode step is ~200 short parallel regions, so sleeping threads cost
much on a quiet machine, and with a core taken every barrier waits for a thread that is not
running. So eagle3 spins briefly (GOMP_SPINCOUNT=30000 unless the user set it or
OMP_WAIT_POLICY) and the ThreadGovernor below drops to one thread while two run slower than one
(a core is taken), probing two again with exponential back-off. libgomp reads its settings once,
when it loads at `import torch`, so eagle3.tune_process() calls install() before anything imports
torch (the `eagle3` command and the server call it first); the kernels' extension uses torch's
libgomp (one runtime, one setting). `import eagle3` alone sets nothing.
"""
from __future__ import annotations

import ctypes
import os
import sys
import time
from pathlib import Path
from typing import MutableMapping, NamedTuple, Optional

from . import settings

DEFAULT_SPINCOUNT = "30000"


class ThreadSetup(NamedTuple):
    wait_policy: str        # what OpenMP in this process uses
    source: str             # who chose it


_SETUP: Optional[ThreadSetup] = None     # what install() found; read by describe()


def configure(environ: MutableMapping[str, str] = os.environ,
              torch_loaded: Optional[bool] = None) -> ThreadSetup:
    """Set GOMP_SPINCOUNT=30000 unless the user chose a wait policy or spin count; say what is in
    effect."""
    loaded = "torch" in sys.modules if torch_loaded is None else torch_loaded
    for key in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        if environ.get(key):
            return ThreadSetup(f"{key}={environ[key].upper()}", "set by the user")
    environ["GOMP_SPINCOUNT"] = DEFAULT_SPINCOUNT      # also for child processes
    if loaded:
        return ThreadSetup("OpenMP's default (spin 300000, then sleep)",
                           "torch was imported before eagle3, so OpenMP had already read its settings")
    return ThreadSetup(f"GOMP_SPINCOUNT={DEFAULT_SPINCOUNT}", "eagle3 default: spin briefly, then sleep")


def describe() -> str:
    """One line for `eagle3 info`: thread count, wait policy, the governor."""
    import torch
    setup = _SETUP or untuned()
    governed = "on" if governor_enabled() else "off (EAGLE3_THREAD_GOVERNOR=0)"
    return (f"{torch.get_num_threads()} (torch.get_num_threads), {setup.wait_policy} ({setup.source}); "
            f"governor {governed}: 1 thread while a busy core makes {torch.get_num_threads()} slower")


def install() -> str:
    """Once a process (eagle3.tune_process); what is in effect, in words."""
    global _SETUP
    if _SETUP is None:
        _SETUP = configure()
    return f"{_SETUP.wait_policy} ({_SETUP.source})"


def untuned() -> ThreadSetup:
    """What describe() says where install() has not run."""
    for key in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        if os.environ.get(key):
            return ThreadSetup(f"{key}={os.environ[key].upper()}", "set in the environment")
    return ThreadSetup("OpenMP's default (spin 300000, then sleep)",
                       "eagle3.tune_process() was not called")


def governor_enabled() -> bool:
    return settings.enabled("EAGLE3_THREAD_GOVERNOR")


# ---------------------------------------------------------------------------- one thread computes
# libgomp spins at a barrier only while the threads it manages are no more than the CPUs it may use
# (do_spin: gomp_managed_threads > gomp_available_cpus -> a spin of 100 or 1000 instead of
# GOMP_SPINCOUNT). Each thread that has run a parallel region keeps a pool of worker threads for the
# rest of its life: once the main thread has loaded the model (2 threads: itself and a worker) and an
# engine thread starts its own team, libgomp manages 3 threads on 2 CPUs and every one of the ~200
# barriers of a decode step becomes a futex sleep and wake: a token on a second thread took over
# twice as long as on the main thread, until the main thread's pool was handed back first.
OMP_PAUSE_SOFT = 1          # omp_pause_resource_t: omp_pause_soft


def torch_openmp() -> Optional[ctypes.CDLL]:
    """torch's OpenMP runtime (libgomp) as loaded in this process, or None (another runtime, or not
    found). Other packages may load their own libgomp (sentencepiece does): only torch's counts."""
    import torch
    here = Path(torch.__file__).resolve().parent
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        path = line.split()[-1] if line.split() else ""
        if "libgomp" in Path(path).name and str(here) in path:     # torch/lib or torch.libs
            return ctypes.CDLL(path)
    return None


def hand_over_cores() -> bool:
    """The calling thread gives its OpenMP worker threads back and runs any later parallel region
    on itself alone, so that the thread it hands the model to is the one thread with a team (see
    above). Call it on the thread that loaded the model, before another thread takes the model
    over (the server's engine thread). Threads started later still get torch.get_num_threads().
    False where torch's runtime is not libgomp (nothing to hand back)."""
    gomp = torch_openmp()
    if gomp is None:
        return False
    if gomp.omp_pause_resource_all(OMP_PAUSE_SOFT) != 0:     # inside a parallel region: refused
        return False
    gomp.omp_set_num_threads(1)                              # this thread's own ICV only
    return True


class ThreadGovernor:
    """Runs decode steps on the thread count that runs more steps per second right now.

    Two counts: the process's (`high`, torch.get_num_threads() when made) and 1. For each it keeps an
    exponential average of steps/s over the steps it ran (steps, not tokens: the thread count changes
    what a step costs, not what it accepts, and tokens per step swing 1-5 under speculation), a step
    weighed by its expected work where the decoder says it (`after_step(work)`: the adaptive step's
    table cost of the arm it ran; a tree step costs 3-4 plain ones, and unweighed, a stretch of trees
    after plain steps read as a slowdown past `suspect`, a one-thread probe that fell on a plain step
    won, and decoding ran on one thread, slower than plain decoding). It
    runs `high` until that average falls below `suspect` x the best seen with it (a core may have
    been taken: the slowdown is severalfold), then tries 1 thread;
    it stays on whichever count is faster and probes the other for one step after `probe` steps,
    doubling `probe` (up to `max_probe`) each time the probe loses, so a lost probe costs little.
    """

    def __init__(self, high: Optional[int] = None, memory: float = 0.8, suspect: float = 0.5,
                 probe: int = 16, max_probe: int = 256):
        import torch
        self.high = high or torch.get_num_threads()
        self.memory, self.suspect = memory, suspect
        self.first_probe, self.max_probe = probe, max_probe
        self.rate = {self.high: 0.0, 1: 0.0}       # EMA steps/s per count (0: not measured)
        self.best_high = 0.0
        self.current = self.high
        self.chosen = self.high                    # the count we stay on between probes
        self.probe_every, self.since_probe = probe, 0
        self.t0 = 0.0

    @property
    def active(self) -> bool:
        return self.high > 1

    def before_step(self, hold: bool = False) -> bool:
        """Set the step's thread count; True when the step runs on the probed count (its time then
        speaks for the other count). hold: a probe due now waits for the next step (the adaptive
        step's own probe is due: both start at 16 steps and double, so they fell on the same steps
        and every shape the policy probed ran on one thread, ~2x slow, and lost to plain decoding)."""
        import torch
        if not self.active:
            return False
        self.since_probe += 1
        want = self.chosen
        if self.since_probe >= self.probe_every and not hold:
            want, self.since_probe = self.other(self.chosen), 0
        if want != self.current:
            torch.set_num_threads(want)
            self.current = want
        self.t0 = time.perf_counter()
        return want != self.chosen

    def after_step(self, work: Optional[float] = None) -> None:
        """work: the step's expected cost in any fixed unit (None: every step alike)."""
        if not self.active:
            return
        rate = (work or 1.0) / max(time.perf_counter() - self.t0, 1e-9)
        n = self.current
        old = self.rate[n]
        self.rate[n] = rate if old == 0 else self.memory * old + (1 - self.memory) * rate
        if n == self.high:
            self.best_high = max(self.best_high, self.rate[n])
            if self.rate[1] == 0 and self.rate[n] < self.suspect * self.best_high:
                self.since_probe = self.probe_every          # suspected contention: try 1 next
        better = max(self.rate, key=self.rate.get)
        if n != self.chosen:                                  # this was a probe
            self.probe_every = (self.first_probe if better == n
                                else min(2 * self.probe_every, self.max_probe))
        self.chosen = better

    def other(self, n: int) -> int:
        return 1 if n == self.high else self.high

    def restore(self) -> None:
        """Back to the process's thread count (after a generation)."""
        import torch
        if self.current != self.high:
            torch.set_num_threads(self.high)
            self.current = self.high
