"""Where eagle3 keeps what it builds (converted checkpoints, compiled kernels): a leaf module."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$EAGLE3_CACHE, else ~/.cache/eagle3."""
    return Path(os.environ.get("EAGLE3_CACHE", Path.home() / ".cache" / "eagle3"))
