"""Tiny random targets and drafts for the speculative-decoding tests (no files, no downloads)."""
from __future__ import annotations

from dataclasses import replace
from typing import Iterator, Optional, Sequence

import pytest

import torch

from eagle3.generate import Engine, SamplingParams
from eagle3.models.config import ModelConfig
from eagle3.models.llama import LlamaModel
from eagle3.draft.model import DraftConfig, DraftOutput, Eagle1Draft, Eagle3Draft
from eagle3.speculative.tree import SpecParams

AUX_IDS = (0, 2, 3)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Small ops on a shared 2-core machine run far faster on one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class StubTokenizer:
    """Enough of a tokenizer for Engine: ids -> text, no special tokens."""
    eos_token_id = None
    chat_template = None

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return " ".join(str(i) for i in ids)


def tiny_target(seed: int = 0, vocab: int = 32, std: float = 0.3, layers: int = 4,
                hidden: int = 32, intermediate: int = 64, arch: str = "LlamaForCausalLM") -> LlamaModel:
    torch.manual_seed(seed)
    cfg = ModelConfig.from_hf({"architectures": [arch], "vocab_size": vocab,
                               "hidden_size": hidden, "intermediate_size": intermediate,
                               "num_hidden_layers": layers, "num_attention_heads": 4,
                               "num_key_value_heads": 2, "max_position_embeddings": 256})
    model = LlamaModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, std)
    return model.eval()


def tiny_draft(target: LlamaModel, seed: int = 1, draft_vocab: Optional[int] = None,
               algorithm: str = "eagle3", layers: int = 1) -> Eagle3Draft | Eagle1Draft:
    torch.manual_seed(seed)
    cfg = DraftConfig.for_target(target.config, draft_vocab_size=draft_vocab,
                                 aux_layer_ids=AUX_IDS, algorithm=algorithm)
    cfg = replace(cfg, num_layers=layers)
    draft = (Eagle3Draft if algorithm == "eagle3" else Eagle1Draft)(cfg)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if "norm" not in name and "embed" not in name:
                p.normal_(0.0, 0.3)
    draft.set_embedding(target.embed_tokens.weight)
    if draft_vocab and draft_vocab < target.config.vocab_size:
        used = torch.randperm(target.config.vocab_size)[:draft_vocab].sort().values
        draft.d2t.copy_(used - torch.arange(draft_vocab))
        draft.t2d.zero_()
        draft.t2d[used] = True
    return draft.eval()


class OracleDraft(Eagle3Draft):
    """A real Eagle3Draft (cache, features contract) whose logits follow a known sequence.

    `seq[p]` is the token the target produces at position p. A row at position j whose input id
    is seq[j+1] proposes seq[j+2]; on rows where (j * 7) % `noise_every` == 0 a wrong token ranks
    first and the right one second, so chains miss and wider trees still find it.
    """

    def __init__(self, cfg: DraftConfig, seq: Sequence[int], noise_every: int = 3):
        super().__init__(cfg)
        self.seq = torch.tensor(list(seq) + [0, 0])
        self.noise_every = noise_every

    def forward(self, input_ids, positions, cache, **kw) -> DraftOutput:
        rows = kw.pop("logits_rows", None)
        out = super().forward(input_ids, positions, cache, **kw)
        return self.steer(input_ids, positions, out.hidden, rows, self.head)

    def steer(self, input_ids, positions, hidden, rows, head) -> DraftOutput:
        """The oracle's logits over `head(hidden)` (the draft's own, scaled down)."""
        pos = positions if positions.dim() == 2 else positions[None]
        pos = pos.clamp(max=len(self.seq) - 3)
        right = self.seq[pos + 2]
        on_track = self.seq[pos + 1] == input_ids
        logits = 0.01 * head(hidden)
        logits.scatter_add_(-1, right[..., None], on_track[..., None].float() * 10.0)
        noisy = on_track & ((pos * 7) % self.noise_every == 0)
        wrong = (right + 1) % logits.shape[-1]
        logits.scatter_add_(-1, wrong[..., None], noisy[..., None].float() * 12.0)
        if rows is not None:
            logits = logits[:, rows]
        return DraftOutput(logits, hidden)


class OracleLayout:
    """An OracleDraft's steering over an inference layout of it (draft.inference)."""

    def __init__(self, layout, oracle: OracleDraft):
        self.layout, self.oracle = layout, oracle
        self.config, self.device = layout.config, layout.device
        self.new_cache, self.to_target_ids = layout.new_cache, layout.to_target_ids

    def __call__(self, input_ids, positions, cache, **kw) -> DraftOutput:
        rows = kw.pop("logits_rows", None)
        out = self.layout(input_ids, positions, cache, **kw)
        return self.oracle.steer(input_ids, positions, out.hidden, rows,
                                 lambda h: self.layout._logits(h, None))


def oracle_draft(target: LlamaModel, seq: Sequence[int], noise_every: int = 3) -> OracleDraft:
    cfg = DraftConfig.for_target(target.config, aux_layer_ids=AUX_IDS)
    draft = OracleDraft(cfg, seq, noise_every)
    draft.set_embedding(target.embed_tokens.weight)
    return draft.eval()


def plain_greedy(target: LlamaModel, prompt: list[int], max_new: int) -> list[int]:
    engine = Engine(target, StubTokenizer(), max_model_len=len(prompt) + max_new + 8)
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    return engine.generate(prompt_ids=prompt, params=params).token_ids


def spec_engine(target, draft, spec: SpecParams, max_len: int = 200) -> Engine:
    return Engine(target, StubTokenizer(), draft=draft, spec=spec, max_model_len=max_len)


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Goodness-of-fit p-value of `counts` against `probs` (cells with expected < min_expected are
    pooled). Cells of probability 0 must have no counts."""
    counts, probs = counts.flatten().double(), probs.flatten().double()
    assert counts[probs <= 0].sum() == 0, "a token of probability 0 was emitted"
    expected = probs / probs.sum() * counts.sum()
    big = expected >= min_expected
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = obs.numel() - 1
    if dof == 0:
        return 1.0                       # one possible outcome, and nothing else was emitted
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), stat / 2.0))


def hf_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[T, V] -> [T, V]: an independent reference for the processed sampling distribution,
    transformers' own warpers (temperature, then top-k, then top-p, as generate() orders them)
    applied to the logits, then softmax."""
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)
    warpers = [TemperatureLogitsWarper(params.temperature)]
    if params.top_k:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        warpers.append(TopPLogitsWarper(params.top_p))
    scores = logits.float().reshape(-1, logits.shape[-1])
    for warp in warpers:
        scores = warp(None, scores)
    return torch.softmax(scores, dim=-1).view(logits.shape)


def assert_caches_equal_one_pass(dec, target, draft, prompt: list[int], emitted: list[int]) -> None:
    """The decoder's target and draft caches after `emitted` equal one forward over the sequence."""
    seq = torch.tensor([prompt + emitted[:-1]])
    length = seq.shape[1]
    assert dec.cache.length == dec.draft_cache.length == length
    full_cache, full_draft = target.new_cache(128), draft.new_cache(128)
    out = target(seq, torch.arange(length), full_cache, capture_ids=draft.config.aux_layer_ids)
    with torch.inference_mode():
        draft(torch.tensor([prompt[1:] + emitted]), torch.arange(length), full_draft, features=out.aux)
    for mine, want in ((dec.cache, full_cache), (dec.draft_cache, full_draft)):
        assert torch.allclose(mine.k[..., :length, :], want.k[..., :length, :], atol=1e-4)
        assert torch.allclose(mine.v[..., :length, :], want.v[..., :length, :], atol=1e-4)
