"""One DeepSeek-V4 layer (model-spec.md §4.3): mHC around attention, then mHC around the MoE.

Each layer is two halves, `*_attention_half` and `*_ffn_half`, so that the regions compile mode can
compile each half once per layer kind; `block` / `block_v41` run both (the scan compile mode).
"""

from __future__ import annotations

import jax
import numpy as np

from ..config import ModelConfig
from ..numerics import Numerics
from ..plan import LayerKind
from .attention import attention
from .chunk import Chunk
from .engram import engram_update
from .mhc import hc_collapse, hc_expand, hc_mixes
from .moe import moe
from .norm import rms_norm
from .shared_attention import Published, shared_attention

__all__ = ["block", "block_v41", "attention_half", "ffn_half", "v41_attention_half", "v41_ffn_half"]


def _hc(config: ModelConfig) -> dict:
    return dict(norm_eps=config.norm_eps, hc_eps=config.hc_eps, sinkhorn_iters=config.hc_sinkhorn_iters)


def attention_half(p: dict, st: dict, layer: jax.Array, X: jax.Array, chunk: Chunk, *, config: ModelConfig,
                   numerics: Numerics, kind: LayerKind, freqs: np.ndarray) -> tuple[jax.Array, dict]:
    """X [B, S, n, d] -> (X', state): mHC-wrapped attention. p: this layer's hc_attn_*, attn_norm and attn;
    st: this kind's stacked state ([R, B, ...]), indexed by `layer`."""
    pre, post, comb = hc_mixes(X, p["hc_attn_fn"], p["hc_attn_base"], p["hc_attn_scale"], **_hc(config))
    h = rms_norm(hc_collapse(X, pre), p["attn_norm"], config.norm_eps)
    y, st = attention(p["attn"], st, layer, h, chunk, config=config, numerics=numerics, kind=kind.attn, freqs=freqs)
    return hc_expand(y, post, comb, X), st


def ffn_half(p: dict, experts: dict, layer: jax.Array, X: jax.Array, chunk: Chunk, *, config: ModelConfig,
             numerics: Numerics, hash_moe: bool, layout=None) -> jax.Array:
    """X [B, S, n, d] -> X': mHC-wrapped MoE. p: this layer's hc_ffn_*, ffn_norm and ffn (gate, shared
    expert); experts: w1/w2/w3 of every layer of this kind ([R, E, ...]), indexed by `layer`."""
    pre, post, comb = hc_mixes(X, p["hc_ffn_fn"], p["hc_ffn_base"], p["hc_ffn_scale"], **_hc(config))
    h = rms_norm(hc_collapse(X, pre), p["ffn_norm"], config.norm_eps)
    y = moe(p["ffn"], experts, layer, h, chunk.tokens, config=config, numerics=numerics, hash_moe=hash_moe,
            layout=layout)
    return hc_expand(y, post, comb, X)


def block(p: dict, experts: dict, st: dict, layer: jax.Array, X: jax.Array, chunk: Chunk, *,
          config: ModelConfig, numerics: Numerics, kind: LayerKind, freqs: np.ndarray, layout=None
          ) -> tuple[jax.Array, dict]:
    """X [B, S, n, d] residual streams -> (X', state). `layer` indexes this kind's stacked state/experts.
    layout: the sharding.Layout of a model on a mesh (expert-parallel MoE), else None."""
    X, st = attention_half(p, st, layer, X, chunk, config=config, numerics=numerics, kind=kind, freqs=freqs)
    return ffn_half(p, experts, layer, X, chunk, config=config, numerics=numerics, hash_moe=kind.hash_moe,
                    layout=layout), st


def v41_attention_half(p: dict, window: jax.Array, layer: jax.Array, sources: dict, row: jax.Array, X: jax.Array,
                       pre_in: jax.Array, published: Published, engram_rows: tuple | None, chunk: Chunk, *,
                       config: ModelConfig, numerics: Numerics, kind: LayerKind, freqs: np.ndarray,
                       record: list | None = None):
    """[Engram], then attention collapsed with the previous layer's FFN pre-mix `pre_in` [B, S, n].
    Returns (X, pre_attn, window, sources, published); pre_attn collapses this layer's MoE input."""
    if kind.engram:
        dead = None if config.image_token_id is None else chunk.tokens == config.image_token_id
        X = engram_update(X, p["engram"], *engram_rows, eps=config.norm_eps, numerics=numerics, dead=dead)
        if record is not None:
            record.append(X)
    pre_a, post, comb = hc_mixes(X, p["hc_attn_fn"], p["hc_attn_base"], p["hc_attn_scale"], **_hc(config))
    h = rms_norm(hc_collapse(X, pre_in), p["attn_norm"], config.norm_eps)
    y, window, sources, published = shared_attention(p["attn"], window, layer, sources, row, h, chunk, published,
                                                     config=config, numerics=numerics, kind=kind, freqs=freqs)
    return hc_expand(y, post, comb, X), pre_a, window, sources, published


def v41_ffn_half(p: dict, experts: dict, layer: jax.Array, X: jax.Array, pre_a: jax.Array, chunk: Chunk, *,
                 config: ModelConfig, numerics: Numerics, layout=None) -> tuple[jax.Array, jax.Array]:
    """The MoE collapsed with this layer's attention pre-mix. Returns (X, pre_ffn)."""
    pre_f, post, comb = hc_mixes(X, p["hc_ffn_fn"], p["hc_ffn_base"], p["hc_ffn_scale"], **_hc(config))
    h = rms_norm(hc_collapse(X, pre_a), p["ffn_norm"], config.norm_eps)
    y = moe(p["ffn"], experts, layer, h, chunk.tokens, config=config, numerics=numerics, hash_moe=False,
            layout=layout)
    return hc_expand(y, post, comb, X), pre_f


def block_v41(p: dict, experts: dict, window: jax.Array, layer: jax.Array, sources: dict, row: jax.Array,
              X: jax.Array, pre_in: jax.Array, published: Published, engram_rows: tuple | None, chunk: Chunk, *,
              config: ModelConfig, numerics: Numerics, kind: LayerKind, freqs: np.ndarray, record: list | None = None,
              layout=None):
    """One DeepSeek-V4.1 layer (model-spec.md §5.2): [Engram], then attention collapsed with the previous
    layer's FFN pre-mix `pre_in` [B, S, n] and the MoE collapsed with this layer's attention pre-mix.
    `record` (a list) receives the streams after the Engram update (if any) and after the block.

    Returns (X, pre_ffn, window, sources, published)."""
    X, pre_a, window, sources, published = v41_attention_half(
        p, window, layer, sources, row, X, pre_in, published, engram_rows, chunk, config=config, numerics=numerics,
        kind=kind, freqs=freqs, record=record)
    X, pre_f = v41_ffn_half(p, experts, layer, X, pre_a, chunk, config=config, numerics=numerics, layout=layout)
    if record is not None:
        record.append(X)
    return X, pre_f, window, sources, published
