"""eagle3: EAGLE-3 speculative decoding in plain PyTorch."""
from . import memory as _memory, threads as _threads

_threads.install()          # before any import of torch: OpenMP reads its settings when it loads
_memory.tune()              # freed buffers stay in the process (no page faults per decode step)

__version__ = "0.1.0"
