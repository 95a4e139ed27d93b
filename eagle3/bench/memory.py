"""Peak memory per system: a sampling thread reads the RSS of this process (and of a child process
a system runs, e.g. llama-speculative-simple) while that system generates; CUDA peaks come from the
allocator. Everything runs in one process, so RSS peaks include the other systems' resident
weights; `load_delta` (RSS added when a system was built) tells the systems apart."""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import psutil
import torch


def rss_bytes(pid: Optional[int] = None) -> int:
    try:
        return psutil.Process(pid).memory_info().rss
    except psutil.Error:
        return 0


def tree_rss_bytes(pid: int) -> int:
    """RSS of a child process and its descendants (vLLM runs its engine in a process of its own;
    pages they share are counted once per process)."""
    try:
        procs = [psutil.Process(pid)]
        procs += procs[0].children(recursive=True)
    except psutil.Error:
        return 0
    return sum(rss_bytes(p.pid) for p in procs)


class PeakMemory:
    """`with peaks.track(name, child_pid=lambda: ...)`: max RSS seen per name (bytes)."""

    def __init__(self, interval_s: float = 0.02):
        self.interval_s = interval_s
        self.rss: dict[str, int] = {}
        self.child_rss: dict[str, int] = {}
        self.gpu: dict[str, int] = {}

    @contextmanager
    def track(self, name: str, child_pid: Callable[[], Optional[int]] = lambda: None,
              device: str = "cpu") -> Iterator[None]:
        stop = threading.Event()
        peak = [rss_bytes(), 0]

        def sample() -> None:
            while not stop.wait(self.interval_s):
                peak[0] = max(peak[0], rss_bytes())
                pid = child_pid()
                if pid is not None:
                    peak[1] = max(peak[1], tree_rss_bytes(pid))

        cuda = device.startswith("cuda")
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
            self.rss[name] = max(self.rss.get(name, 0), peak[0], rss_bytes())
            if peak[1]:
                self.child_rss[name] = max(self.child_rss.get(name, 0), peak[1])
            if cuda:
                self.gpu[name] = max(self.gpu.get(name, 0), torch.cuda.max_memory_allocated())
