"""Serving: per-request sampling (more to come: tokenizer, continuous-batching engine, benchmark harness)."""

from .sampling import SamplingParams, sample

__all__ = ["SamplingParams", "sample"]
