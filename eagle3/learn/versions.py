"""Draft versions under DIR/drafts: `vN/` (a draft directory in the SpecForge layout, which
`eagle3 generate --draft DIR/drafts/vN` loads, and `card.json`: its data, steps and gate figures),
and `current`, a one-line file naming the served version (written atomically). A rejected
candidate keeps its weights when they are finite (it can be measured or served by hand). v0 is the draft the
server started with (a record of where it came from, no copy of its weights)."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

from ..errors import LoadError
from .capture import write_atomic

VERSION = re.compile(r"^v(\d+)$")


def drafts_dir(root: Path) -> Path:
    return Path(root) / "drafts"


def versions(root: Path) -> list[int]:
    d = drafts_dir(root)
    if not d.is_dir():
        return []
    return sorted(int(m.group(1)) for p in d.iterdir() if (m := VERSION.match(p.name)) and (p / "card.json").is_file())


def next_version(root: Path) -> int:
    d = drafts_dir(root)
    taken = [int(m.group(1)) for p in d.iterdir() if (m := VERSION.match(p.name))] if d.is_dir() else []
    return max(taken, default=0) + 1


def card(root: Path, version: int) -> dict:
    path = drafts_dir(root) / f"v{version}" / "card.json"
    if not path.is_file():
        raise LoadError(f"{path}: no such draft version (versions: {versions(root)})")
    return json.loads(path.read_text())


def write_card(root: Path, version: int, body: dict) -> Path:
    d = drafts_dir(root) / f"v{version}"
    d.mkdir(parents=True, exist_ok=True)
    write_atomic(d / "card.json", json.dumps({"version": version, **body}, indent=2))
    return d


def current(root: Path) -> Optional[int]:
    """The served version named by DIR/drafts/current (None: none written yet)."""
    path = drafts_dir(root) / "current"
    if not path.is_file():
        return None
    m = VERSION.match(path.read_text().strip())
    if m is None:
        raise LoadError(f"{path}: expected a version such as 'v3', found {path.read_text()[:40]!r}")
    return int(m.group(1))


def set_current(root: Path, version: int) -> None:
    drafts_dir(root).mkdir(parents=True, exist_ok=True)
    write_atomic(drafts_dir(root) / "current", f"v{version}\n")


def draft_path(root: Path, version: int) -> Optional[Path]:
    """The draft directory a version serves: vN itself, or for v0 the draft the server started with
    (None: it started without one)."""
    body = card(root, version)
    if body.get("source"):
        return Path(body["source"])
    path = drafts_dir(root) / f"v{version}"
    return path if (path / "config.json").is_file() else None


def ensure_v0(root: Path, served: Optional[Path]) -> int:
    """Record the draft the server starts with as v0 (once) and make it current when nothing is.
    Returns the version to serve."""
    if 0 not in versions(root):
        write_card(root, 0, {"status": "served", "source": str(served.resolve()) if served else None,
                             "note": "the draft the server started with" if served else
                                     "no draft: suffix-only speculation until a draft is learned"})
    cur = current(root)
    if cur is None:
        set_current(root, 0)
        return 0
    return cur
