"""The `speculative` argument (vLLM's spelling: {"method": "mtp", "num_speculative_tokens": k}), validated."""

from __future__ import annotations

from typing import Any

__all__ = ["parse_speculative", "MAX_SPECULATIVE_TOKENS"]

MAX_SPECULATIVE_TOKENS = 8
_METHODS = {"mtp": "mtp", "deepseek_mtp": "mtp", "dspark": "dspark"}


def parse_speculative(spec: Any) -> tuple[str, int]:
    """(method, num_speculative_tokens) of a speculative config dict; ValueError naming what is wrong."""
    if not isinstance(spec, dict):
        raise ValueError(f"speculative must be a dict like {{'method': 'mtp', 'num_speculative_tokens': 2}}, "
                         f"got {spec!r}")
    unknown = set(spec) - {"method", "num_speculative_tokens"}
    if unknown:
        raise ValueError(f"unknown speculative field(s): {', '.join(sorted(unknown))}")
    method = _METHODS.get(spec.get("method"))
    if method is None:
        raise ValueError(f"speculative method must be one of {', '.join(sorted(_METHODS))}, got {spec.get('method')!r}")
    if method == "dspark":
        raise ValueError("speculative method 'dspark' (DeepSeek-V4.1's drafter) is not built yet; use 'mtp' on "
                         "DeepSeek-V4 checkpoints")
    k = spec.get("num_speculative_tokens", 1)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
    return method, k
