"""Where eagle3 keeps what it builds (converted checkpoints, compiled kernels): a leaf module."""
from __future__ import annotations

import functools
import os
import sys
import tempfile
from pathlib import Path

from . import settings


def cache_root() -> Path:
    """$EAGLE3_CACHE, else ~/.cache/eagle3; without a home directory, a temp dir (said once)."""
    if settings.env("EAGLE3_CACHE"):
        return Path(settings.env("EAGLE3_CACHE")).expanduser()
    home = os.path.expanduser("~")
    if home.startswith("~"):   # HOME unset and no passwd entry: "~" would be a relative path
        return _no_home_cache(Path(tempfile.gettempdir()) / f"eagle3-{os.getuid()}")
    return Path(home) / ".cache" / "eagle3"


@functools.lru_cache(maxsize=None)
def _no_home_cache(path: Path) -> Path:
    print(f"eagle3: no home directory (HOME unset); caching in {path} (set EAGLE3_CACHE to choose)",
          file=sys.stderr)
    return path
