"""The speculative algorithm: tree shapes and layout, verification, the decoder step, the monitor."""
from .decoder import SpecDecoder
from .monitor import AcceptanceMonitor
from .tree import SpecParams

__all__ = ["SpecDecoder", "AcceptanceMonitor", "SpecParams"]
