"""One adapter per benchmarked system, behind one interface.

    system.name, system.family                    "ours-tree", "ours"
    system.warmup(prompt, params)                 one untimed generation
    system.run(prompt, params) -> RunResult       tokens, seconds, and what the system can tell

Every system gets the same prompt ids, the same stop ids (the target's eos set), the same token
budget and, when sampling, the same seed per prompt; sampling is plain temperature sampling (no
top-k/top-p/min-p/repetition penalty) everywhere, so the workloads match. Emitted tokens exclude
the stop token. `seconds` is wall time of the whole generation, prefill included.

Systems that are not installed are not built: `build_*` functions return (systems, skipped) where
skipped holds (name, reason) pairs that the report prints.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional, Protocol

import torch

from ..generate import Engine, GenerationResult, SamplingParams
from .workload import BenchPrompt


@dataclass(frozen=True)
class GenParams:
    temperature: float
    max_new_tokens: int
    seed: int
    stop_ids: tuple[int, ...]
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class RunResult:
    tokens: list[int]
    seconds: float
    tau: Optional[float] = None               # tokens per target forward (speculative systems)
    accept_lens: Optional[list[int]] = None   # accepted draft tokens per decode step (ours)
    draft_s: Optional[float] = None
    verify_s: Optional[float] = None          # target forwards (prefill + decode/verify)
    extra: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else 0.0

    @property
    def other_s(self) -> Optional[float]:
        if self.draft_s is None or self.verify_s is None:
            return None
        return max(self.seconds - self.draft_s - self.verify_s, 0.0)


class System(Protocol):
    name: str
    family: str       # "ours" | "hf" | "llama.cpp"
    device: str

    def warmup(self, prompt: BenchPrompt, params: GenParams) -> None: ...

    def run(self, prompt: BenchPrompt, params: GenParams) -> RunResult: ...


def cut_at_stop(tokens: list[int], params: GenParams) -> list[int]:
    """Tokens before the first stop id (all of them with ignore_eos), at most max_new_tokens."""
    if not params.ignore_eos:
        for i, tok in enumerate(tokens):
            if tok in params.stop_ids:
                return tokens[:i]
    return tokens[:params.max_new_tokens]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------- this project
class OursSystem:
    """This project's Engine: plain decoding (speculative=False) or a draft with one tree shape."""
    family = "ours"

    def __init__(self, name: str, engine: Engine, speculative: bool):
        self.name, self.engine, self.speculative = name, engine, speculative
        self.device = str(engine.target.device)
        self.spec = engine.spec if speculative else None

    def sampling(self, params: GenParams) -> SamplingParams:
        return SamplingParams(temperature=params.temperature, seed=params.seed,
                              max_new_tokens=params.max_new_tokens,
                              stop_token_ids=params.stop_ids, ignore_eos=params.ignore_eos)

    def warmup(self, prompt: BenchPrompt, params: GenParams) -> None:
        self.run(prompt, params)

    def run(self, prompt: BenchPrompt, params: GenParams) -> RunResult:
        sampling = self.sampling(params)
        policy = self.engine.policy_for(sampling) if self.speculative else None
        before = Counter(policy.spent) if policy is not None else None
        res = self.engine.generate(prompt_ids=list(prompt.ids), params=sampling,
                                   speculative=self.speculative)
        sync(self.device)
        out = self.result(res)
        if policy is not None:           # the policy's time by kind over this run (bench: policy time)
            out.extra["spent_ms"] = dict(Counter(policy.spent) - before)
        return out

    def result(self, res: GenerationResult) -> RunResult:
        steps = res.steps
        draft_s, verify_s = sum(s.draft_s for s in steps), sum(s.verify_s for s in steps)
        if not self.speculative:
            return RunResult(list(res.token_ids), res.wall_s, draft_s=0.0, verify_s=verify_s)
        return RunResult(list(res.token_ids), res.wall_s, tau=res.tau,
                         accept_lens=[s.accepted for s in res.decode_steps],
                         draft_s=draft_s, verify_s=verify_s,
                         extra={"proposed": sum(s.proposed for s in res.decode_steps),
                                "accepted_suffix": sum(s.accepted_suffix for s in res.decode_steps),
                                "arms": dict(Counter(s.arm for s in res.decode_steps if s.arm))})


def build_ours(target, draft, tokenizer, max_model_len: int, shapes: dict[str, object],
               policy=None) -> list[OursSystem]:
    """ours-plain on `target` (an inference layout), one speculative system per named SpecParams,
    and ours-adaptive when a policy factory is given (api.adaptive_policy), each on its own Engine
    (and caches)."""
    plain = Engine(target, tokenizer, max_model_len=max_model_len)
    systems = [OursSystem("ours-plain", plain, speculative=False)]
    for name, spec in shapes.items():
        shaped = Engine(target, tokenizer, draft=draft, spec=spec, max_model_len=max_model_len)
        systems.append(OursSystem(name, shaped, speculative=True))
    if policy is not None:
        adaptive = Engine(target, tokenizer, draft=draft, max_model_len=max_model_len, policy=policy)
        systems.append(OursSystem(ADAPTIVE, adaptive, speculative=True))
    return systems


ADAPTIVE = "ours-adaptive"


# ---------------------------------------------------------------------------- HF transformers
class HFSystem:
    """transformers `generate`: greedy/sampling, or prompt-lookup decoding."""
    family = "hf"

    def __init__(self, name: str, model, prompt_lookup: Optional[int] = None):
        self.name, self.model, self.prompt_lookup = name, model, prompt_lookup
        self.device = str(model.device)

    def kwargs(self, params: GenParams, x: torch.Tensor) -> dict:
        kw = dict(attention_mask=torch.ones_like(x), max_new_tokens=params.max_new_tokens,
                  do_sample=not params.greedy, pad_token_id=params.stop_ids[0])
        kw["eos_token_id"] = list(params.stop_ids)
        if params.ignore_eos:
            kw["min_new_tokens"] = params.max_new_tokens
        if not params.greedy:
            kw.update(temperature=params.temperature, top_k=0, top_p=1.0)
        if self.prompt_lookup:
            kw["prompt_lookup_num_tokens"] = self.prompt_lookup
        return kw

    def warmup(self, prompt: BenchPrompt, params: GenParams) -> None:
        self.run(prompt, params)

    @torch.inference_mode()
    def run(self, prompt: BenchPrompt, params: GenParams) -> RunResult:
        x = torch.tensor([prompt.ids], device=self.model.device)
        kw = self.kwargs(params, x)
        torch.manual_seed(params.seed)
        sync(self.device)
        t0 = time.perf_counter()
        out = self.model.generate(x, **kw)
        sync(self.device)
        seconds = time.perf_counter() - t0
        return RunResult(cut_at_stop(out[0, x.shape[1]:].tolist(), params), seconds)


def load_hf_model(hf_dir, device: str, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype).to(device).eval()


def build_hf(hf_dir, device: str, prompt_lookup: int,
             bf16: bool = False) -> tuple[list[HFSystem], list[tuple[str, str]]]:
    """hf-generate and hf-prompt-lookup in fp32; with bf16 (when our target runs bf16 weights)
    also hf-generate-bf16, so the comparison at the same weight precision is in the same run."""
    try:
        model = load_hf_model(hf_dir, device)
    except ImportError as e:
        return [], [("hf-generate", f"transformers is not importable ({e})"),
                    ("hf-prompt-lookup", "transformers is not importable")]
    systems = [HFSystem("hf-generate", model),
               HFSystem("hf-prompt-lookup", model, prompt_lookup=prompt_lookup)]
    if bf16:
        systems.append(HFSystem("hf-generate-bf16", load_hf_model(hf_dir, device, torch.bfloat16)))
    return systems, []
