"""Generation: sampling parameters, prompt/text handling, plain decoding and the Engine API."""
from .engine import Engine
from .plain import PlainDecoder
from ..sampling import SamplingParams, sample_next, target_probs
from .text import TextStream, encode_prompt
from ..speculative.step import Step
from .types import Chunk, Decoder, GenerationResult

__all__ = ["Engine", "PlainDecoder", "SamplingParams", "sample_next", "target_probs", "TextStream",
           "encode_prompt", "Chunk", "Decoder", "GenerationResult", "Step"]
