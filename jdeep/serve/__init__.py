"""Serving pieces: per-request sampling on the device, the tokenizer (chat format, streaming detokenisation).
The continuous-batching engine and the benchmark harness are tracked in issue 5."""

from .sampling import SamplingParams, sample
from .tokenizer import IncrementalDetokenizer, Tokenizer, chat_prompt

__all__ = ["SamplingParams", "sample", "Tokenizer", "IncrementalDetokenizer", "chat_prompt"]
