"""eagle3: EAGLE-3 speculative decoding in plain PyTorch."""
from . import threads as _threads

_threads.install()          # before any import of torch: OpenMP reads its settings when it loads

__version__ = "0.1.0"
