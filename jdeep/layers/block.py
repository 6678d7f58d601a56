"""One DeepSeek-V4 layer (model-spec.md §4.3): mHC around attention, then mHC around the MoE."""

from __future__ import annotations

import jax
import numpy as np

from ..config import ModelConfig
from ..numerics import Numerics
from ..plan import LayerKind
from .attention import attention
from .chunk import Chunk
from .mhc import hc_collapse, hc_expand, hc_mixes
from .moe import moe
from .norm import rms_norm

__all__ = ["block"]


def block(p: dict, experts: dict, st: dict, layer: jax.Array, X: jax.Array, chunk: Chunk, *,
          config: ModelConfig, numerics: Numerics, kind: LayerKind, freqs: np.ndarray) -> tuple[jax.Array, dict]:
    """X [B, S, n, d] residual streams -> (X', state). `layer` indexes this kind's stacked state/experts."""
    hc = dict(norm_eps=config.norm_eps, hc_eps=config.hc_eps, sinkhorn_iters=config.hc_sinkhorn_iters)

    pre, post, comb = hc_mixes(X, p["hc_attn_fn"], p["hc_attn_base"], p["hc_attn_scale"], **hc)
    h = rms_norm(hc_collapse(X, pre), p["attn_norm"], config.norm_eps)
    y, st = attention(p["attn"], st, layer, h, chunk, config=config, numerics=numerics, kind=kind.attn, freqs=freqs)
    X = hc_expand(y, post, comb, X)

    pre, post, comb = hc_mixes(X, p["hc_ffn_fn"], p["hc_ffn_base"], p["hc_ffn_scale"], **hc)
    h = rms_norm(hc_collapse(X, pre), p["ffn_norm"], config.norm_eps)
    y = moe(p["ffn"], experts, layer, h, chunk.tokens, config=config, numerics=numerics, hash_moe=kind.hash_moe)
    return hc_expand(y, post, comb, X), st
