"""Lightning indexer (model-spec.md §4.4.5): picks each query's top-k compressed entries."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .. import kernels
from ..config import ModelConfig
from ..kernels.linear import linear_f32
from ..kernels.quant import fp4_fake_quant, hadamard
from ..numerics import Numerics
from .chunk import Chunk
from .compressor import compress_chunk
from .linear import dense
from .rope import apply_rope
from .stages import stage

__all__ = ["index_select"]


@stage("indexer")
def index_select(x: jax.Array, q_latent: jax.Array, p: dict, st: dict, layer: jax.Array, chunk: Chunk, *,
                 config: ModelConfig, numerics: Numerics, ratio: int, freqs: np.ndarray
                 ) -> tuple[jax.Array, jax.Array, dict, jax.Array]:
    """Update the indexer's key cache with this chunk and select entries for every query.

    x [B, S, d] attention input; q_latent [B, S, q_lora] (c_q). st holds ikeys [R, B, Tc+1, DI] and the
    indexer compressor ring. Returns (idx int32 [B, S, K], selected bool [B, S, K], st, score fp32 [B, S, Tc+1])
    with K = min(index_topk, Tc + 1); entries not visible to a query are never marked selected (score -inf).
    The inputs are detached: the indexer learns from its own objective (layers/index_loss.py), and the
    selection it feeds is not differentiable anyway.
    """
    x, q_latent = jax.lax.stop_gradient(x), jax.lax.stop_gradient(q_latent)
    B, S, _ = x.shape
    nI, DI = config.index_n_heads, config.index_head_dim
    qat = None
    if numerics.quantize_activations:   # Hadamard rotation, then fp4 QAT of queries and keys
        def qat(v):
            return fp4_fake_quant(hadamard(v), numerics.fp4_block)
    ikeys, ibuf_kv, ibuf_sc = compress_chunk(
        x, p["compressor"], st["ikeys"], st["ibuf_kv"], st["ibuf_score"], layer, chunk,
        ratio=ratio, overlap=True, freqs=freqs, norm_eps=config.norm_eps, qat=qat, numerics=numerics)
    st = {**st, "ikeys": ikeys, "ibuf_kv": ibuf_kv, "ibuf_score": ibuf_sc}

    q = dense(q_latent, p["wq_b"], numerics).reshape(B, S, nI, DI)
    q = apply_rope(q, chunk.positions[..., None], freqs)
    if qat is not None:
        q = qat(q)
    w = linear_f32(x, p["weights_proj"]) * (DI ** -0.5 * nI ** -0.5)        # [B, S, nI]
    keys = ikeys[layer]                                                      # [B, Tc+1, DI]
    visible_count = (chunk.positions + 1) // ratio                           # [B, S]
    score = kernels.get("index_scores")(q, keys, w, visible_count)           # [B, S, Tc+1], -inf past the count
    k = min(config.index_topk, keys.shape[1])
    _, idx = kernels.get("topk")(score, k)
    selected = idx < visible_count[..., None]
    return idx.astype(jnp.int32), selected, st, score
