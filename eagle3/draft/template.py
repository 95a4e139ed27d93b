"""The chat template a draft was trained with, recorded as a fingerprint in its config.json (and card)
on export, so that a server applying another template is caught (SpecForge#296: Qwen3's thinking
template at serving, another at training; acceptance drops with no error).

    config.json: "eagle3_chat_template": {"sha256": "<16 hex>", "source": "<where it was read>"}
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Optional

TEMPLATE_KEY = "eagle3_chat_template"


def fingerprint(template: Any) -> Optional[str]:
    """The first 16 hex digits of the template text's sha256 (None for no template). A list of named
    templates (tokenizer_config.json's other form) is hashed as its JSON."""
    if not template:
        return None
    text = template if isinstance(template, str) else json.dumps(template, sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def read_template(model_dir: str | Path) -> Optional[str | list]:
    """A local HF directory's chat template: chat_template.jinja, else tokenizer_config.json's."""
    path = Path(model_dir)
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    try:
        return json.loads((path / "tokenizer_config.json").read_text()).get("chat_template")
    except (OSError, ValueError):
        return None


def recorded(config: Optional[dict]) -> Optional[str]:
    """The fingerprint a draft's config.json records (None: not recorded)."""
    entry = (config or {}).get(TEMPLATE_KEY)
    return entry.get("sha256") if isinstance(entry, dict) else None


def record(draft_dir: str | Path, sha256: str, source: str) -> None:
    """Write the fingerprint into draft_dir/config.json and its CARD.md (created if absent)."""
    path = Path(draft_dir)
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg[TEMPLATE_KEY] = {"sha256": sha256, "source": source}
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    card = path / "CARD.md"
    text = card.read_text() if card.is_file() else f"# {path.name}\n"
    line = f"- Chat template trained with: sha256 {sha256} ({source})"
    if line not in text:
        card.write_text(text.rstrip("\n") + "\n\n## Chat template\n" + line + "\n")
