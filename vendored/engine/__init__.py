"""A small serving engine for Bamba on the kernels of vendored/ops: continuous batching, chunked prefill at any
boundary, state slots and a paged K/V cache."""

from .engine import EngineError, LLMEngine, RequestOutput

__all__ = ["EngineError", "LLMEngine", "RequestOutput"]
