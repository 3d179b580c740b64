"""A small serving engine for Bamba on the kernels of vendored/ops: continuous batching, chunked prefill at any
boundary, state slots and a paged K/V cache; greedy or seeded sampled continuations."""

from .engine import LLMEngine, RequestOutput
from .errors import EngineError
from .sampling import SamplingParams

__all__ = ["EngineError", "LLMEngine", "RequestOutput", "SamplingParams"]
