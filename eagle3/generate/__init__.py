"""Generation: sampling parameters, prompt/text handling, plain decoding, the Engine API and
continuous batching (BatchScheduler)."""
from .batch import BatchScheduler
from .engine import Engine
from .plain import PlainDecoder
from ..sampling import SamplingParams, sample_next, target_probs
from .text import TextStream, encode_prompt
from ..speculative.step import Step
from .types import Chunk, Decoder, GenerationResult

__all__ = ["BatchScheduler", "Engine", "PlainDecoder", "SamplingParams", "sample_next", "target_probs", "TextStream",
           "encode_prompt", "Chunk", "Decoder", "GenerationResult", "Step"]
