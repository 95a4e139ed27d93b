"""What names a target for a learn directory: the model as given and its shape facts."""
from __future__ import annotations

from typing import Optional


def target_identity(model: Optional[str], config) -> dict:
    from ..runtime.assets import DEFAULT_MODEL
    name = DEFAULT_MODEL if model in (None, "", "default") else str(model)
    return {"model": name, "vocab_size": int(config.vocab_size), "hidden_size": int(config.hidden_size),
            "num_layers": int(config.num_layers)}
