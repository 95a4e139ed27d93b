"""Draft names, the one place they are read: `default`, `none`, `suffix` or a checkpoint directory.

`resolve_draft_name` turns what a user wrote (`--draft`, `load_engine(draft=...)`) into what to load
and whether to speculate without a draft model; the API, the doctor and the bench call it.

| name              | draft model loaded                              | speculates without one          |
|-------------------|-------------------------------------------------|---------------------------------|
| `default`         | the shipped draft, for the packaged target only | yes: suffix-only blocks         |
| `suffix`          | none                                            | yes: suffix-only blocks         |
| `none`, "", None  | none                                            | no: plain decoding              |
| anything else     | that directory                                  | (it has a draft)                |
"""
from __future__ import annotations

from pathlib import Path
from typing import NamedTuple, Optional

SHIPPED_DRAFTS = Path(__file__).parent.parent / "drafts"
DEFAULT_DRAFT = SHIPPED_DRAFTS / "smollm2-135m-eagle3"
DEFAULT_DRAFT_NAME = "default"
SUFFIX_ONLY_DRAFT = "suffix"       # no draft model, suffix-only blocks under the adaptive step
NO_DRAFT_NAMES = (None, "", "none")


class DraftChoice(NamedTuple):
    path: Optional[Path]           # the checkpoint to load (None: no draft model)
    suffix_only: bool              # without a draft model, still speculate with suffix-only blocks
    reason: Optional[str]          # why there is no draft model (None: there is one)


def default_draft_path(model: Optional[str]) -> Optional[Path]:
    """The shipped draft goes with the packaged default target only."""
    from ..runtime.assets import DEFAULT_MODEL
    if model in (None, "", "default", DEFAULT_MODEL) and (DEFAULT_DRAFT / "config.json").is_file():
        return DEFAULT_DRAFT
    return None


def resolve_draft_name(draft: Optional[str], model: Optional[str]) -> DraftChoice:
    """What `draft` means for the target `model` (the table above)."""
    if draft in NO_DRAFT_NAMES:
        return DraftChoice(None, False, "--draft none")
    if draft == SUFFIX_ONLY_DRAFT:
        return DraftChoice(None, True, "--draft suffix (no draft model: suffix-only blocks)")
    if draft == DEFAULT_DRAFT_NAME:
        path = default_draft_path(model)
        if path is None:
            return DraftChoice(None, True, "no shipped draft for this model yet; pass --draft PATH")
        return DraftChoice(path, True, None)
    return DraftChoice(Path(draft), False, None)
