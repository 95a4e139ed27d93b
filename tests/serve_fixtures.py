"""Server test support: tiny engines with the real SmolLM2 tokenizer, a grouped stand-in for
speculation, and a uvicorn server on a random loopback port run in a thread."""
from __future__ import annotations

import socket
import threading
import time
from functools import lru_cache
from typing import Optional

import torch

from eagle3.generate import Engine, PlainDecoder, SamplingParams
from eagle3.speculative.step import Step
from eagle3.models.config import ModelConfig
from eagle3.models.llama import LlamaModel
from eagle3.speculative.tree import SpecParams

VOCAB = 49152      # the real tokenizer's vocabulary, so decoded text is real text


@lru_cache(maxsize=1)
def tokenizer():
    from eagle3.runtime.loader import load_tokenizer, resolve_model
    return load_tokenizer(resolve_model(None).hf_dir)


def tiny_target(seed: int = 0) -> LlamaModel:
    torch.manual_seed(seed)
    cfg = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB,
                               "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
                               "num_attention_heads": 4, "num_key_value_heads": 2,
                               "max_position_embeddings": 1024, "tie_word_embeddings": True,
                               "eos_token_id": 2})
    model = LlamaModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.3)
    return model.eval()


class GroupedDecoder:
    """Plain greedy/sampled tokens, emitted in groups of 1, 2, ..., depth+1 tokens per step with all
    but the last of a group reported as accepted draft tokens. The output is exactly the plain
    decoder's; only the per-step bookkeeping imitates speculation (a known drafted pattern)."""

    def __init__(self, plain: PlainDecoder, depth: int, delay_s: float = 0.0,
                 never_accept: bool = False, arms: tuple[str, ...] = ()):
        self.plain, self.depth, self.delay_s = plain, depth, delay_s
        self.never_accept = never_accept      # a draft whose proposals are all rejected
        self.arms = arms
        self.steps = 0

    def prefill(self, prompt_ids: list[int], max_new_tokens: int) -> Step:
        return self.plain.prefill(prompt_ids, max_new_tokens)

    def step(self) -> Step:
        if self.delay_s:
            time.sleep(self.delay_s)
        group = 1 if self.never_accept else 1 + self.steps % (self.depth + 1)
        self.steps += 1
        arm = self.arms[(self.steps - 1) % len(self.arms)] if self.arms else ""
        if arm == "plain":
            return Step(self.plain.step().tokens, 0, arm=arm)
        tokens = [t for _ in range(group) for t in self.plain.step().tokens]
        suffix = group - 1 if arm == "suffix" else 0
        return Step(tokens, group - 1, proposed=self.depth, accepted_suffix=suffix, arm=arm)


class GroupedEngine(Engine):
    """An Engine that is speculative to the server (spec depth, monitor) but decodes with
    GroupedDecoder; `speculative=False` gives the plain reference."""

    speculative = True

    def __init__(self, target, tok, max_model_len: int = 256, depth: int = 2, delay_s: float = 0.0):
        spec = SpecParams(top_k=1, depth=depth, num_draft_tokens=depth + 1)
        super().__init__(target, tok, spec=spec, max_model_len=max_model_len)
        self.delay_s = delay_s
        self.never_accept = False
        self.arms: tuple[str, ...] = ()       # step labels in turn ("plain": 1 token, "suffix": its
                                              # accepted tokens count as suffix-only)

    def make_decoder(self, params: SamplingParams, speculative: bool = True):
        plain = PlainDecoder(self.target, self.cache, params)
        if not speculative:
            return plain
        return GroupedDecoder(plain, self.spec.depth, self.delay_s, self.never_accept, self.arms)


def free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


class RunningServer:
    """`with RunningServer(app) as s:` uvicorn on 127.0.0.1:<random port>; s.url, s.port."""

    def __init__(self, app, start_timeout_s: float = 30.0):
        import uvicorn
        self.sock = free_socket()
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread: Optional[threading.Thread] = None
        self.start_timeout_s = start_timeout_s

    def __enter__(self) -> "RunningServer":
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True, name="uvicorn-test")
        self.thread.start()
        deadline = time.monotonic() + self.start_timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.sock.close()
        assert not self.thread.is_alive(), "uvicorn did not stop"


class CountingTokenizer:
    """A tokenizer whose `encode` counts its calls and can sleep first (a long tokenization)."""

    def __init__(self, inner, delay_s: float = 0.0):
        self.inner, self.delay_s, self.calls = inner, delay_s, 0

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def encode(self, *args, **kwargs):
        self.calls += 1
        time.sleep(self.delay_s)
        return self.inner.encode(*args, **kwargs)


def wait_for(cond, timeout_s: float = 5.0) -> bool:
    """Poll `cond` until it holds or `timeout_s` passes; whether it held."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False
