"""Serving: per-request sampling on the device, the tokenizer (chat format, streaming detokenisation), the
continuous-batching engine (engine.py), the benchmark harness (bench.py) and the OpenAI-compatible HTTP server
(server.py, on async_engine.py, openai_protocol.py, metrics.py)."""

from ..runtime.sampling import SamplingParams, sample
from ..io.tokenizer import IncrementalDetokenizer, Tokenizer, chat_prompt

__all__ = ["SamplingParams", "sample", "Tokenizer", "IncrementalDetokenizer", "chat_prompt"]
