"""Generation: sampling parameters, prompt/text handling, plain decoding, the Engine API, a
request's output (Output: the one emit/finish path) and the schedulers the server drives
(SerialScheduler: one request at a time; BatchScheduler: continuous batching)."""
from .batch import BatchScheduler
from .engine import Engine
from .output import Output
from .plain import PlainDecoder
from .serial import SerialScheduler
from ..sampling import SamplingParams, sample_next, target_probs
from .text import TextStream, encode_prompt
from ..speculative.step import Step
from .types import Chunk, Decoder, GenerationResult

__all__ = ["BatchScheduler", "Engine", "Output", "PlainDecoder", "SerialScheduler", "SamplingParams",
           "sample_next", "target_probs", "TextStream", "encode_prompt", "Chunk", "Decoder",
           "GenerationResult", "Step"]
