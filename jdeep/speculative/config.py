"""The `speculative` argument (vLLM's spelling: {"method": "mtp", "num_speculative_tokens": k}), validated.

Methods: "mtp" (alias "deepseek_mtp": DeepSeek-V4's MTP block, mtp_decode.py) and "dspark" (DeepSeek-V4.1's DSpark
drafter, dspark_decode.py; k is checked against the checkpoint's dspark_block_size where the model is known)."""

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
    k = spec.get("num_speculative_tokens", 1)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
    return method, k
