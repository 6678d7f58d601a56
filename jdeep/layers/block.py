"""One DeepSeek-V4 / V4.1 layer (model-spec.md §4.3, §5.2): [Engram], mHC around attention, then mHC around the MoE.

What differs between the families is carried by the layer's kind (plan.py), not by the function called:
`kind.delayed_premix` (V4.1 collapses each half's input with the pre-mix the half before it computed, V4 with
its own), `kind.shared_kv` (V4.1 keeps one sliding window per layer and the compressed KV / index keys per KV
source, in state["sources"], and hands the published top-k on in the streams) and `kind.engram`.

Each layer is two halves, `attention_half` and `ffn_half`, so that the regions compile mode can compile each
half once per layer kind; `block` runs both (the scan compile mode).
"""

from __future__ import annotations

from typing import NamedTuple

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

__all__ = ["Streams", "block", "attention_half", "ffn_half"]


class Streams(NamedTuple):
    """What flows from half to half through the stack.

    X [B, S, n, d]: the residual streams. pre fp32 [B, S, n]: the pre-mix the next half collapses X with
    (delayed pre-mix, V4.1), else None. published: the latest index source's top-k and the candidate blocks
    (shared KV, V4.1), else None."""

    X: jax.Array
    pre: jax.Array | None = None
    published: Published | None = None


def _hc(config: ModelConfig) -> dict:
    return dict(norm_eps=config.norm_eps, hc_eps=config.hc_eps, sinkhorn_iters=config.hc_sinkhorn_iters)


def attention_half(p: dict, st: dict, sources: dict, layer: jax.Array, row: jax.Array | None, streams: Streams,
                   engram_rows: tuple | None, chunk: Chunk, *, config: ModelConfig, numerics: Numerics,
                   kind: LayerKind, freqs: np.ndarray, record: list | None = None, losses: list | None = None
                   ) -> tuple[Streams, dict, dict]:
    """[Engram], then the mHC-wrapped attention. Returns (streams, st, sources).

    p: this layer's hc_attn_*, attn_norm, attn [, engram]; st: this kind's stacked state ([R, B, ...]) indexed by
    `layer`; sources: the shared compressed caches (state["sources"], {} without shared KV), `row` (traced int32)
    this layer's row in its ratio's group; engram_rows: this layer's host-gathered table rows (codes, scales).
    `record` (a list) receives the streams right after the Engram update; `losses` (a list, training) the
    indexer objective of a V4 indexer layer (layers/attention.py)."""
    X = streams.X
    if kind.engram:
        dead = None if config.image_token_id is None else chunk.tokens == config.image_token_id
        X = engram_update(X, p["engram"], *engram_rows, eps=config.norm_eps, numerics=numerics, dead=dead)
        if record is not None:
            record.append(X)
    pre, post, comb = hc_mixes(X, p["hc_attn_fn"], p["hc_attn_base"], p["hc_attn_scale"], **_hc(config))
    h = rms_norm(hc_collapse(X, streams.pre if kind.delayed_premix else pre), p["attn_norm"], config.norm_eps)
    published = streams.published
    if kind.shared_kv:
        y, window, sources, published = shared_attention(p["attn"], st["window"], layer, sources, row, h, chunk,
                                                         published, config=config, numerics=numerics, kind=kind,
                                                         freqs=freqs)
        st = {**st, "window": window}
    else:
        y, st = attention(p["attn"], st, layer, h, chunk, config=config, numerics=numerics, kind=kind.attn,
                          freqs=freqs, losses=losses)
    X = hc_expand(y, post, comb, X)
    return Streams(X, pre if kind.delayed_premix else None, published), st, sources


def ffn_half(p: dict, experts: dict, layer: jax.Array, streams: Streams, chunk: Chunk, *, config: ModelConfig,
             numerics: Numerics, hash_moe: bool, delayed_premix: bool, layout=None) -> Streams:
    """The mHC-wrapped MoE. p: this layer's hc_ffn_*, ffn_norm and ffn (gate, shared expert); experts: w1/w2/w3 of
    every layer of this kind ([R, E, ...]), indexed by `layer`. layout: the sharding.Layout of a model on a mesh
    (expert-parallel MoE), else None."""
    X = streams.X
    pre, post, comb = hc_mixes(X, p["hc_ffn_fn"], p["hc_ffn_base"], p["hc_ffn_scale"], **_hc(config))
    h = rms_norm(hc_collapse(X, streams.pre if delayed_premix else pre), p["ffn_norm"], config.norm_eps)
    y = moe(p["ffn"], experts, layer, h, chunk.tokens, config=config, numerics=numerics, hash_moe=hash_moe,
            layout=layout)
    return Streams(hc_expand(y, post, comb, X), pre if delayed_premix else None, streams.published)


def block(p: dict, experts: dict, st: dict, sources: dict, layer: jax.Array, row: jax.Array | None, streams: Streams,
          engram_rows: tuple | None, chunk: Chunk, *, config: ModelConfig, numerics: Numerics, kind: LayerKind,
          freqs: np.ndarray, record: list | None = None, layout=None, losses: list | None = None
          ) -> tuple[Streams, dict, dict]:
    """One layer: both halves. Returns (streams, st, sources). `record` (a list) receives the streams after the
    Engram update (if any) and after the block; `losses` (a list) the indexer objective (attention_half)."""
    streams, st, sources = attention_half(p, st, sources, layer, row, streams, engram_rows, chunk, config=config,
                                          numerics=numerics, kind=kind, freqs=freqs, record=record, losses=losses)
    streams = ffn_half(p, experts, layer, streams, chunk, config=config, numerics=numerics, hash_moe=kind.hash_moe,
                       delayed_premix=kind.delayed_premix, layout=layout)
    if record is not None:
        record.append(streams.X)
    return streams, st, sources
