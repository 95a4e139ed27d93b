"""The generation API used by the CLI, the server and the bench.

An Engine owns a target (and optionally a draft), their preallocated caches and the tokenizer. It
serves one sequence at a time; `stream` yields Chunks, `generate` collects them into a
GenerationResult. The per-step token source is a Decoder: PlainDecoder, or the speculative decoder
from eagle3.speculative when a draft is attached, or a policy of suffix-only blocks without one.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Iterator, Optional, Sequence

from ..errors import InputError
from .plain import PlainDecoder
from ..sampling import SamplingParams
from .text import TextStream, encode_prompt
from ..speculative.step import Step
from ..threads import ThreadGovernor, governor_enabled
from .types import Chunk, Decoder, GenerationResult

if TYPE_CHECKING:
    from ..speculative.policy import AdaptivePolicy


def check_length(prompt_len: int, max_new_tokens: int, max_model_len: int) -> None:
    """InputError unless a prompt is given and it fits the context with max_new_tokens."""
    if prompt_len == 0:
        raise InputError("empty prompt: give some text or chat messages")
    if prompt_len + max_new_tokens > max_model_len:
        raise InputError(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) = "
            f"{prompt_len + max_new_tokens} exceeds the context ({max_model_len} tokens); "
            "shorten the prompt or lower max_new_tokens")


class Engine:
    def __init__(self, target, tokenizer, draft=None, spec=None, max_model_len: int = 2048,
                 policy: Optional[Callable[[bool], "AdaptivePolicy"]] = None):
        """policy: makes the adaptive step's policy (speculative.policy) for greedy (True) or sampled
        (False) requests, each kept across requests; None = every step drafts `spec`. Without a
        draft, a policy of suffix-only blocks (api.adaptive_policy(target, None)) still speculates."""
        if draft is not None and spec is None:
            from ..speculative.tree import SpecParams
            spec = SpecParams()
        self.target, self.tokenizer, self.draft, self.spec = target, tokenizer, draft, spec
        self.max_model_len = max_model_len
        self.policy_factory = policy
        self.policies: dict[bool, "AdaptivePolicy"] = {}        # params.greedy -> its policy
        shapes = [spec] if spec else []
        if self.policy_factory is not None:                     # made now: their shapes size the caches
            self.policies = {greedy: self.policy_factory(greedy) for greedy in (True, False)}
            shapes += [s for p in self.policies.values() for s in p.shapes]
        from ..speculative.decoder import cache_slack
        slack = cache_slack(shapes, max((p.suffix_only_tokens for p in self.policies.values()), default=0))
        self.cache = target.new_cache(max_model_len + slack)
        self.draft_cache = draft.new_cache(max_model_len + slack) if draft is not None else None
        self.eos_ids = set(getattr(target.config, "eos_token_ids", ()) or ())
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_ids.add(int(tokenizer.eos_token_id))
        self.governor = None              # threads.ThreadGovernor: 1 thread while a core is taken
        if target.device.type == "cpu" and governor_enabled():
            self.governor = ThreadGovernor()
        self.monitor = None
        if self.speculative:
            from ..speculative.monitor import AcceptanceMonitor
            self.monitor = AcceptanceMonitor()

    @property
    def speculative(self) -> bool:
        """True when a draft is attached or a policy of suffix-only blocks stands in for one (steps
        are speculative unless a call asks for plain)."""
        return self.draft is not None or self.policy_factory is not None

    # ------------------------------------------------------------------ entry points
    def encode(self, prompt: Optional[str] = None, messages: Optional[Sequence[dict]] = None,
               chat: bool = True) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, messages, chat)

    def generate(self, prompt: Optional[str] = None, params: SamplingParams = SamplingParams(),
                 messages: Optional[Sequence[dict]] = None, chat: bool = True,
                 prompt_ids: Optional[list[int]] = None, speculative: bool = True) -> GenerationResult:
        result = None
        for chunk in self.stream(prompt, params, messages, chat, prompt_ids, speculative):
            result = chunk.result or result
        return result

    def stream(self, prompt: Optional[str] = None, params: SamplingParams = SamplingParams(),
               messages: Optional[Sequence[dict]] = None, chat: bool = True,
               prompt_ids: Optional[list[int]] = None, speculative: bool = True) -> Iterator[Chunk]:
        ids = list(prompt_ids) if prompt_ids is not None else self.encode(prompt, messages, chat)
        self.check_length(len(ids), params.max_new_tokens)
        decoder = self.make_decoder(params, speculative)
        yield from self.run(decoder, ids, params)

    def check_length(self, prompt_len: int, max_new_tokens: int) -> None:
        check_length(prompt_len, max_new_tokens, self.max_model_len)

    def make_decoder(self, params: SamplingParams, speculative: bool = True) -> Decoder:
        if not (self.speculative and speculative):
            return PlainDecoder(self.target, self.cache, params)
        from ..speculative.decoder import SpecDecoder
        return SpecDecoder(self.target, self.draft, self.cache, self.draft_cache, params, self.spec,
                           policy=self.policy_for(params))

    def policy_for(self, params: SamplingParams) -> Optional["AdaptivePolicy"]:
        if self.policy_factory is None:
            return None
        return self.policies[params.greedy]

    # ------------------------------------------------------------------ the loop
    def run(self, decoder: Decoder, prompt_ids: list[int], params: SamplingParams) -> Iterator[Chunk]:
        """prefill -> step ... ; cut at eos / stop strings / max_new_tokens; yield text deltas."""
        text = TextStream(self.tokenizer, params.stop)
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_ids)
        out_ids: list[int] = []
        steps: list[Step] = []
        t0 = time.perf_counter()
        ttft = 0.0
        try:
            for step in self._steps(decoder, prompt_ids, params.max_new_tokens):
                steps.append(step)
                if self.monitor is not None and len(steps) > 1:
                    self.monitor.observe(step)
                new, finish = take_tokens(step, out_ids, stop_ids, params.max_new_tokens)
                out_ids.extend(new)
                delta = text.push(new)
                if text.stopped:
                    finish = "stop"
                ttft = ttft or time.perf_counter() - t0
                from_draft = [i < step.accepted for i in range(len(new))]
                if finish:
                    delta += text.flush()
                    result = GenerationResult(text.text, out_ids, len(prompt_ids), finish, steps,
                                              time.perf_counter() - t0, ttft)
                    yield Chunk(delta, new, from_draft, finish, result, step)
                    return
                yield Chunk(delta, new, from_draft, step=step)
        finally:
            if self.governor is not None:
                self.governor.restore()

    def _steps(self, decoder: Decoder, prompt_ids: list[int], max_new_tokens: int) -> Iterator[Step]:
        """The prefill, then decode steps, each on the thread count the governor chooses."""
        yield decoder.prefill(prompt_ids, max_new_tokens)
        while True:
            yield self.decode_step(decoder)

    def decode_step(self, decoder: Decoder) -> Step:
        """One decode step on the thread count the governor chooses (also the batch's solo steps).
        The governor's probe of another thread count and the adaptive step's probe of another arm
        never share a step, and the policy does not time a step run on the probed count."""
        policy = getattr(decoder, "policy", None)
        if self.governor is not None:
            probing = self.governor.before_step(hold=policy is not None and policy.probe_due)
            if policy is not None:
                decoder.timed = not probing
        step = decoder.step()
        if self.governor is not None:
            self.governor.after_step(getattr(decoder, "expected_ms", None))
        return step


def take_tokens(step: Step, out_ids: list[int], stop_ids: set[int] | frozenset[int],
                max_new: int) -> tuple[list[int], Optional[str]]:
    """Tokens of this step that are emitted, and the finish reason if generation ends here."""
    new: list[int] = []
    for tok in step.tokens:
        if tok in stop_ids:
            return new, "stop"
        new.append(tok)
        if len(out_ids) + len(new) >= max_new:
            return new, "length"
    return new, None
