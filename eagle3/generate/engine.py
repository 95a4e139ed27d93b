"""The generation API used by the CLI, the server and the bench.

An Engine owns a target (and optionally a draft), their preallocated caches and the tokenizer. It
serves one sequence at a time; `stream` yields Chunks, `generate` collects them into a
GenerationResult, `start` gives the same request as a RequestRun, a step at a time (how the
schedulers drive it). Every step's tokens become a Chunk through the request's Output
(output.py). The per-step token source is a Decoder: PlainDecoder, or the speculative decoder from
eagle3.speculative when a draft is attached, or a policy of suffix-only blocks without one.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterator, Optional, Sequence

from .plain import PlainDecoder
from ..sampling import SamplingParams
from .output import Output, check_length
from .text import encode_prompt
from ..speculative.step import Step
from ..threads import ThreadGovernor, governor_enabled
from .types import Chunk, Decoder, GenerationResult

if TYPE_CHECKING:
    from ..speculative.policy import AdaptivePolicy


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
        run = self.start(ids, params, speculative)
        try:
            while not run.done:
                yield run.step()
        finally:
            run.close()

    def start(self, prompt_ids: list[int], params: SamplingParams, speculative: bool = True,
              output: Optional[Output] = None) -> "RequestRun":
        """A request on this engine, run a step at a time (its length is checked by the caller)."""
        output = output or Output(self.tokenizer, params, self.eos_ids, len(prompt_ids))
        return RequestRun(self, self.make_decoder(params, speculative), prompt_ids, output)

    def check_length(self, prompt_len: int, max_new_tokens: int) -> None:
        check_length(prompt_len, max_new_tokens, self.max_model_len)

    def make_decoder(self, params: SamplingParams, speculative: bool = True) -> Decoder:
        if not (self.speculative and speculative and params.speculative):
            return PlainDecoder(self.target, self.cache, params)
        from ..speculative.decoder import SpecDecoder
        return SpecDecoder(self.target, self.draft, self.cache, self.draft_cache, params, self.spec,
                           policy=self.policy_for(params))

    def policy_for(self, params: SamplingParams) -> Optional["AdaptivePolicy"]:
        if self.policy_factory is None:
            return None
        return self.policies[params.greedy]

    # ------------------------------------------------------------------ a step
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


class RequestRun:
    """One request on an Engine: the prefill on the first `step`, a decode step on each later one,
    every step's Chunk from the request's Output. It ends itself at its last chunk; `close` ends it
    early (the thread governor gives the cores back either way)."""

    def __init__(self, engine: Engine, decoder: Decoder, prompt_ids: list[int], output: Output):
        self.engine, self.decoder, self.prompt_ids, self.output = engine, decoder, prompt_ids, output

    @property
    def done(self) -> bool:
        return self.output.done

    def step(self) -> Chunk:
        if not self.output.steps:
            step = self.decoder.prefill(self.prompt_ids, self.output.max_new_tokens)
        else:
            step = self.engine.decode_step(self.decoder)
            if self.engine.monitor is not None:
                self.engine.monitor.observe(step)
        chunk = self.output.push(step)
        if self.output.done:
            self.close()
        return chunk

    def close(self) -> None:
        if self.engine.governor is not None:
            self.engine.governor.restore()
