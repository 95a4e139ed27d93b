"""Shared fixtures: the real packaged SmolLM2 (tiny random models live in eagle3.testing)."""
from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(int(os.environ.get("EAGLE3_TEST_THREADS", "2")))


@pytest.fixture(autouse=True)
def eagle3_environment():
    """A test that sets EAGLE3_* switches for the process (config.use) leaves them as it found them."""
    before = {k: v for k, v in os.environ.items() if k.startswith("EAGLE3_")}
    yield
    for k in [k for k in os.environ if k.startswith("EAGLE3_") and k not in before]:
        del os.environ[k]
    os.environ.update(before)


@pytest.fixture(scope="session")
def real_model():
    from eagle3.runtime.loader import load_model, load_tokenizer, resolve_model
    src = resolve_model(None)
    return load_model(src.hf_dir), load_tokenizer(src.hf_dir), src


@pytest.fixture
def one_thread():
    """Tiny ops on a shared 2-core machine run faster (and steadier) on one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
