"""DeepSeek-V4 attention (model-spec.md §4.4): low-rank q with per-head norm, one shared K=V head,
sliding window + compressed entries (all visible ones, or the indexer's top-k), sink, inverse RoPE on
the output and the grouped low-rank output projection."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .. import kernels
from ..config import AttentionKind, ModelConfig
from ..kernels.linear import grouped, in_place, materialized, native_rows, product
from ..kernels.quant import fp8_fake_quant
from ..numerics import Numerics
from .chunk import Chunk
from .compressor import compress_chunk
from .index_loss import index_kl
from .indexer import index_select
from .linear import dense
from .norm import rms_norm
from .rope import apply_rope
from .stages import scope, stage

__all__ = ["attention", "write_window", "output_projection", "window_keys"]

HIGHEST = jax.lax.Precision.HIGHEST


def window_keys(st: dict, layer: jax.Array, chunk: Chunk, W: int, read) -> tuple[jax.Array, jax.Array]:
    """Ring entries written before this chunk and which query may see them: ([B, W, D], bool [B, S, W])."""
    ring = read(st["window"][layer][:, :W])
    last = chunk.pos0[:, None] - 1
    ring_pos = last - (last - jnp.arange(W, dtype=jnp.int32)[None, :]) % W      # [B, W]
    t = chunk.positions[..., None]
    visible = (ring_pos[:, None, :] >= 0) & (ring_pos[:, None, :] > t - W)
    return ring, visible


def _kv_qat(numerics: Numerics, rope_dim: int):
    """DeepSeek's KV storage simulation: fp8 (1 x kv_block groups) on the non-rope dims; rope dims untouched."""
    def qat(kv: jax.Array) -> jax.Array:
        nope = fp8_fake_quant(kv[..., :-rope_dim], numerics.kv_block, numerics.fp8_max)
        return jnp.concatenate([nope, kv[..., -rope_dim:]], axis=-1)

    return qat


def _kv_codec(numerics: Numerics, config: ModelConfig, dtype):
    """(read, store) between K=V values and the cache rows: identity for a float cache; uint8 records
    (int32 bytes, narrowed once at the scatter) with packed_kv."""
    if not numerics.packed_kv:
        return (lambda rows: rows), (lambda kv: kv)
    r, b = config.rope_head_dim, numerics.kv_block

    def read(rows):
        return kernels.get("decode_kv_record")(rows, config.head_dim, r, b, dtype)

    def store(kv):
        return kernels.get("encode_kv_record")(kv, r, b, numerics.fp8_max)

    return read, store


def _head_rms(q: jax.Array, eps: float) -> jax.Array:
    """Weightless per-head RMS norm computed in the activation dtype, as DeepSeek's reference does
    (bf16 square and rsqrt; the mean accumulates in fp32 but is rounded back), not upcast like RMSNorm."""
    ms = jnp.mean((q * q).astype(jnp.float32), axis=-1, keepdims=True).astype(q.dtype)
    return q * jax.lax.rsqrt(ms + jnp.asarray(eps, q.dtype))


def attention(p: dict, st: dict, layer: jax.Array, x: jax.Array, chunk: Chunk, *, config: ModelConfig,
              numerics: Numerics, kind: AttentionKind, freqs: np.ndarray, losses: list | None = None
              ) -> tuple[jax.Array, dict]:
    """x [B, S, d] (after attn_norm) -> ([B, S, d], updated state of this layer kind). `losses` (a list, training)
    receives the indexer's objective of an indexer layer: fp32 [2] (KL sum, count; layers/index_loss.py)."""
    B, S, _ = x.shape
    H, D, W, eps = config.n_heads, config.head_dim, config.window_size, config.norm_eps
    pos = chunk.positions
    qat = _kv_qat(numerics, config.rope_head_dim) if numerics.quantize_activations else None
    read, store = _kv_codec(numerics, config, x.dtype)

    with scope("projection"):
        q_latent = rms_norm(dense(x, p["wq_a"], numerics), p["q_norm"], eps)
        q = dense(q_latent, p["wq_b"], numerics).reshape(B, S, H, D)
        q = _head_rms(q, eps)
        q = apply_rope(q, pos[..., None], freqs)
        kv = rms_norm(dense(x, p["wkv"], numerics), p["kv_norm"], eps)
        kv = apply_rope(kv, pos, freqs)                                     # [B, S, D]
        if qat is not None:
            kv = qat(kv)

    ring, ring_visible = window_keys(st, layer, chunk, W, read)
    t = pos[..., None]
    chunk_visible = (pos[:, None, :] <= t) & (pos[:, None, :] > t - W) & chunk.valid[:, None, :]
    shared_keys = [ring.astype(kv.dtype), kv]
    shared_mask = [ring_visible, chunk_visible]
    sel_keys = sel_mask = None

    m = kind.ratio
    if m > 0:
        ckv, cbuf_kv, cbuf_sc = compress_chunk(
            x, p["compressor"], st["ckv"], st["cbuf_kv"], st["cbuf_score"], layer, chunk,
            ratio=m, overlap=kind.overlap, freqs=freqs, norm_eps=eps, qat=qat, store=store, numerics=numerics)
        st = {**st, "ckv": ckv, "cbuf_kv": cbuf_kv, "cbuf_score": cbuf_sc}
        entries = ckv[layer]                                                 # [B, Tc+1, D | record]
        if kind.has_indexer:
            idx, selected, st, score = index_select(x, q_latent, p["indexer"], st, layer, chunk,
                                                    config=config, numerics=numerics, ratio=m, freqs=freqs)
            if losses is not None:
                losses.append(index_kl(q, read(entries), score, (pos + 1) // m, chunk.valid, D ** -0.5))
            sel_keys = read(jnp.take_along_axis(entries[:, None], idx[..., None], axis=2))   # [B, S, K, D]
            sel_mask = selected
        else:
            visible_count = (pos + 1) // m
            entries = read(entries)
            shared_keys.append(entries)
            shared_mask.append(jnp.arange(entries.shape[1], dtype=jnp.int32)[None, None, :] < visible_count[..., None])

    with scope("attention_core"):
        o = kernels.get("sparse_attention")(
            q, jnp.concatenate(shared_keys, axis=1), jnp.concatenate(shared_mask, axis=2),
            sel_keys, sel_mask, p["attn_sink"], D ** -0.5)
    st = {**st, "window": write_window(st["window"], layer, chunk, kv, W, store)}
    return output_projection(o, p, chunk, config=config, numerics=numerics, freqs=freqs, dtype=x.dtype), st


def write_window(window: jax.Array, layer: jax.Array, chunk: Chunk, kv: jax.Array, W: int, store) -> jax.Array:
    """Write the chunk's last W real tokens' K=V [B, S, D] into the ring [R, B, W+1, row] at slot t mod W;
    everything else goes to the scratch slot W."""
    pos = chunk.positions
    end = (chunk.pos0 + chunk.n_valid)[:, None]
    keep = chunk.valid & (pos >= end - W)
    slot = jnp.where(keep, pos % W, W)
    return window.at[layer, chunk.batch_index, slot].set(store(jnp.where(keep[..., None], kv, 0)).astype(window.dtype))


@stage("projection")
def output_projection(o: jax.Array, p: dict, chunk: Chunk, *, config: ModelConfig, numerics: Numerics,
                      freqs: np.ndarray, dtype) -> jax.Array:
    """Attention output o [B, S, H, D] -> [B, S, d]: inverse RoPE at the query position, then the grouped
    low-rank projection (wo_a per group, bf16 einsum; wo_b)."""
    B, S, H, D = o.shape
    o = apply_rope(o, chunk.positions[..., None], freqs, inverse=True)
    G = config.o_groups
    o = o.reshape(B, S, G, H * D // G)
    wo_a = grouped(p["wo_a"], (G, config.o_lora_rank, H * D // G))
    if native_rows(o[:, :, 0], wo_a, numerics):     # each group's product reads its [O, K] block in place
        u = jnp.stack([product(o[:, :, g], in_place(wo_a, (g,), o[:, :, g], numerics)) for g in range(G)],
                      axis=2).astype(dtype)
    else:
        u = jnp.einsum("bsgk,gok->bsgo", o, materialized(wo_a), precision=HIGHEST,
                       preferred_element_type=jnp.float32).astype(dtype)
    return dense(u.reshape(B, S, G * config.o_lora_rank), p["wo_b"], numerics)
