"""The row layout our vLLM connector writes (vllm_connector.py, inside vLLM) and the import reads
(vllm_features.py): torch only, so both venvs import it.

    aux        [T, k*H]  the captured ids below L, concatenated low -> high (the store's `aux`)
    last       [T, H]    id L: the last layer's output before the final norm (absent without L)
    token_ids  [T]       int64, the prompt
metadata: format, layer_ids (vLLM's list, input numbering), num_hidden_layers, hidden_size, dtype, model.
"""
from __future__ import annotations

import json

import torch

ROWS_FORMAT = "eagle3-vllm-rows/1"


def split_rows(states: torch.Tensor, layer_ids: list[int], num_hidden_layers: int) -> dict[str, torch.Tensor]:
    """[T, n, H] captured states -> {"aux": [T, k*H], "last": [T, H] when id L is captured}."""
    # [T, n, H]: slot j holds layer_ids[j]
    aux_slots = [j for j, i in enumerate(layer_ids) if i != num_hidden_layers]
    out = {"aux": states[:, aux_slots].reshape(states.shape[0], -1).contiguous()}
    if num_hidden_layers in layer_ids:
        out["last"] = states[:, layer_ids.index(num_hidden_layers)].contiguous()
    return out


def rows_metadata(layer_ids: list[int], num_hidden_layers: int, hidden_size: int, dtype: torch.dtype,
                  model: str) -> dict[str, str]:
    return {"format": ROWS_FORMAT, "layer_ids": json.dumps(list(layer_ids)),
            "num_hidden_layers": str(num_hidden_layers), "hidden_size": str(hidden_size),
            "dtype": str(dtype).removeprefix("torch."), "model": model}
