"""A vLLM KV connector that writes each prompt's captured hidden states as feature-store rows.

Runs INSIDE vLLM (its venv has torch, safetensors and vLLM, not eagle3's other dependencies): this
module imports nothing of eagle3, and `eagle3/train/__init__.py` is lazy, so vLLM can load it by
module path:

    kv_transfer_config = {"kv_connector": "Eagle3FeatureConnector", "kv_role": "kv_producer",
                          "kv_connector_module_path": "eagle3.train.vllm_connector",
                          "kv_connector_extra_config": {"shared_storage_path": DIR}}
    speculative_config = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                          "draft_model_config": {"hf_config": {
                              IDS_KEY: [2, 15, 27, 30]}}}     # engines.IDS_KEY

vLLM's `extract_hidden_states` method puts the residual stream entering each listed layer (id i =
input to layer i, id L = the last layer's output before the final norm) into a cache-only KV
layer; at the end of a request its connector reads the request's rows out of that cache. vLLM's
example connector copies them through a CUDA stream into pinned memory, which the CPU build
cannot do ("pin_memory=True requires a CUDA or other accelerator backend"). This one reuses the
example's scheduler side (file names, lock files) and replaces the worker-side write: one plain
device-to-host copy, no pinned memory, no CUDA stream or event, then the file is written by the
connector's writer threads and its lock released. The copy blocks the step that finishes the
request; the disk write does not.

File per request (`<request id>.safetensors`, the path returned in kv_transfer_params
["hidden_states_path"]), in the store's row layout (train/store.py):
    aux        [T, k*H]  the ids below L, concatenated low -> high (the store's `aux`)
    last       [T, H]    id L: the last layer's output before the final norm (absent without L);
                         the import applies the target's final norm and lm_head (the teacher)
    token_ids  [T]       int64, the prompt
metadata: format, layer_ids (vLLM's list, input numbering), num_hidden_layers, hidden_size,
dtype, model. train/vllm_features.py reads it (and the example connector's own files).
"""
from __future__ import annotations

import os
from typing import Any

import torch
from safetensors.torch import save_file

from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector, extract_from_kv_cache)

from ..engines import IDS_KEY
from .vllm_rows import rows_metadata, split_rows


class Eagle3FeatureConnector(ExampleHiddenStatesConnector):
    """ExampleHiddenStatesConnector with a worker-side write that needs no accelerator."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        hf = vllm_config.speculative_config.draft_model_config.hf_config
        self._layer_ids = [int(i) for i in getattr(hf, IDS_KEY, [])]
        model_config = vllm_config.model_config
        self._num_hidden_layers = model_config.get_total_num_hidden_layers()
        self._meta = rows_metadata(self._layer_ids, self._num_hidden_layers,
                                   model_config.get_hidden_size(), model_config.dtype, str(model_config.model))
        self._written: set[str] = set()

    def _submit_async_write(self, pending) -> None:
        if not self._is_tp_rank_zero:
            return
        cache = self._kv_cache
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (blocks[:, None] * self._block_size + torch.arange(self._block_size)).flatten()
        num_tokens = pending.token_ids.shape[0]
        states = extract_from_kv_cache(cache, slots.to(cache.device), num_tokens).to("cpu")   # [T, n, H]
        tensors = {**split_rows(states, self._layer_ids, self._num_hidden_layers),
                   "token_ids": pending.token_ids.to(torch.int64).clone()}
        os.makedirs(os.path.dirname(pending.filename) or ".", exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        future = self._executor.submit(_write, tensors, self._meta, pending.filename, lock_fd)
        self._req_futures[pending.req_id] = future
        future.add_done_callback(lambda f, rid=pending.req_id: self._on_write_done(rid, f))
        self._written.add(pending.req_id)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Any, Any]:
        """Rows are on the host as soon as they are extracted, so a request's blocks are free once
        its write was submitted; clients wait for the file on its lock."""
        if self.has_connector_metadata():
            for pending in getattr(self._get_connector_metadata(), "pending_saves", []):
                self._submit_async_write(pending)
        self._accumulated_finished_req_ids.update(finished_req_ids)
        done = self._accumulated_finished_req_ids & self._written
        for req_id in self._accumulated_finished_req_ids - done:   # aborted before any write
            fd = self._lock_fds.pop(req_id, None)
            if fd is not None:
                os.close(fd)
        self._accumulated_finished_req_ids.clear()
        self._written -= done
        return done or None, None


def _write(tensors: dict[str, torch.Tensor], meta: dict[str, str], filename: str, lock_fd) -> None:
    try:
        tmp = f"{filename}.tmp{os.getpid()}"
        save_file(tensors, tmp, metadata=meta)
        os.replace(tmp, filename)
    finally:
        if lock_fd is not None:
            os.close(lock_fd)
