"""KV compressor (model-spec.md §4.4.4): softmax-gated pooling of every m tokens into one entry.

Works on a chunk of S new tokens per sequence plus the ring of the last Rc tokens' projections kept
in the state, so prefill chunks and single decode steps run the same code with static shapes.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from .. import kernels
from ..kernels.linear import linear_f32
from .chunk import Chunk
from .norm import rms_norm
from .rope import apply_rope
from .stages import stage

__all__ = ["compress_chunk", "pool_chunk"]


def _take(ext: jax.Array, idx: jax.Array) -> jax.Array:
    """ext [B, E, C], idx [B, G, m] -> [B, G, m, C] (indices clamped; callers mask what is invalid)."""
    B, G, m = idx.shape
    idx = jnp.clip(idx, 0, ext.shape[1] - 1).reshape(B, G * m, 1)
    return jnp.take_along_axis(ext, idx, axis=1).reshape(B, G, m, ext.shape[-1])


def pool_chunk(a: jax.Array, z: jax.Array, buf_kv: jax.Array, buf_score: jax.Array, layer: jax.Array,
               chunk: Chunk, *, ratio: int, overlap: bool, n_entries: int
               ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """Softmax-gated pooling of the groups this chunk completes, and the advanced compressor ring.

    a, z: [B, S, c*Dc] fp32 projections and gate scores (position bias included) of the chunk's tokens.
    buf_kv, buf_score: [R, B, Rc+1, c*Dc] fp32 rings (`layer` selects the row). n_entries: cache rows
    (Tc) — groups at or beyond it are dropped. Returns (pooled fp32 [B, G, Dc], group ids g int32 [B, G],
    g_valid bool [B, G], buf_kv, buf_score) with G = ceil(S / m).
    """
    S = a.shape[1]
    m = ratio
    rc = (2 if overlap else 1) * m
    ring_kv, ring_sc = buf_kv[layer], buf_score[layer]            # [B, Rc+1, c*Dc]

    ring_pos = chunk.pos0[:, None] - rc + jnp.arange(rc, dtype=jnp.int32)[None, :]
    ring_slot = (ring_pos % rc)[..., None]
    ext_pos = jnp.concatenate([ring_pos, chunk.positions], axis=1)  # [B, Rc+S]
    known = (ext_pos >= 0)[..., None]
    ext_kv = jnp.where(known, jnp.concatenate([jnp.take_along_axis(ring_kv, ring_slot, axis=1), a], axis=1), 0.0)
    ext_sc = jnp.where(known, jnp.concatenate([jnp.take_along_axis(ring_sc, ring_slot, axis=1), z], axis=1), -jnp.inf)

    n_groups = -(-S // m)
    g = chunk.pos0[:, None] // m + jnp.arange(n_groups, dtype=jnp.int32)[None, :]   # [B, G]
    g_valid = ((g + 1) * m <= (chunk.pos0 + chunk.n_valid)[:, None]) & (g < n_entries)
    cur = g[..., None] * m + jnp.arange(m, dtype=jnp.int32) - (chunk.pos0[:, None, None] - rc)  # ext index
    if overlap:
        dc = a.shape[-1] // 2
        kv = jnp.concatenate([_take(ext_kv, cur - m)[..., :dc], _take(ext_kv, cur)[..., dc:]], axis=2)
        sc = jnp.concatenate([_take(ext_sc, cur - m)[..., :dc], _take(ext_sc, cur)[..., dc:]], axis=2)
    else:
        kv, sc = _take(ext_kv, cur), _take(ext_sc, cur)
    pooled = kernels.get("softmax_pool")(sc, kv)                  # [B, G, Dc] fp32 (the softmax_pool hot op)

    # Keep the projections of the last Rc real tokens; everything else lands in the scratch slot.
    end = (chunk.pos0 + chunk.n_valid)[:, None]
    keep = chunk.valid & (chunk.positions >= end - rc)
    slot = jnp.where(keep, chunk.positions % rc, rc)
    buf_kv = buf_kv.at[layer, chunk.batch_index, slot].set(jnp.where(keep[..., None], a, 0.0))
    buf_score = buf_score.at[layer, chunk.batch_index, slot].set(jnp.where(keep[..., None], z, -jnp.inf))
    return pooled, g, g_valid, buf_kv, buf_score


@stage("compressor")
def compress_chunk(x: jax.Array, p: dict, cache: jax.Array, buf_kv: jax.Array, buf_score: jax.Array,
                   layer: jax.Array, chunk: Chunk, *, ratio: int, overlap: bool, freqs: np.ndarray,
                   norm_eps: float, qat: Callable[[jax.Array], jax.Array] | None = None,
                   store: Callable[[jax.Array], jax.Array] | None = None, numerics=None
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Emit the compressed entries completed by this chunk and advance the compressor ring (V4).

    x: [B, S, d] attention input (after attn_norm). p: wkv, wgate [c*Dc, d], ape [m, c*Dc], norm [Dc].
    cache: [R, B, Tc+1, Dc]; buf_kv, buf_score: [R, B, Rc+1, c*Dc] fp32 (stacked layer-major; `layer`
    selects the row). `qat` simulates the entry's storage precision after RoPE (DeepSeek's numerics);
    `store` turns entries into cache rows (packed records) before the write. numerics: the platform's product
    choices (kernels.linear.native_rows).
    Returns the updated (cache, buf_kv, buf_score).
    """
    m = ratio
    a = linear_f32(x, p["wkv"], numerics)                         # [B, S, c*Dc]
    z = linear_f32(x, p["wgate"], numerics) + p["ape"][chunk.positions % m]
    tc = cache.shape[2] - 1
    pooled, g, g_valid, buf_kv, buf_score = pool_chunk(a, z, buf_kv, buf_score, layer, chunk, ratio=m,
                                                       overlap=overlap, n_entries=tc)
    entry = rms_norm(pooled.astype(x.dtype), p["norm"], norm_eps)
    entry = apply_rope(entry, g * m, freqs)
    if qat is not None:
        entry = qat(entry)
    entry = jnp.where(g_valid[..., None], entry, 0)
    if store is not None:
        entry = store(entry)
    entry = entry.astype(cache.dtype)
    # indices clamped in the graph: Neuron's indirect DMA faults on out-of-range rows (graphcheck S12)
    cache = cache.at[layer, chunk.batch_index, jnp.where(g_valid, jnp.clip(g, 0, tc), tc)].set(entry)
    return cache, buf_kv, buf_score
