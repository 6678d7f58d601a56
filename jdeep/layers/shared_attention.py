"""DeepSeek-V4.1 attention with cross-layer KV and index sharing (model-spec.md §5.1, §5.3-§5.5).

Every layer keeps its own sliding window. Compressed layers read the compressed KV of their *KV source*
(the latest source at or before them); only the source runs the compressor and writes the shared caches
(compressed KV and index keys). Index sources score those keys and publish a top-k that the following
layers reuse; the candidate source additionally publishes a block candidate mask that later index
sources of the same KV source apply before their own top-k.

What flows from layer to layer inside one forward is a `Published` value (top-k and candidate mask); the
shared caches live in `state["sources"]` (see state.py) and are indexed by a traced source row.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .. import kernels
from ..config import ModelConfig
from ..kernels.linear import linear, linear_f32
from ..kernels.quant import fp4_fake_quant, fp4e4_fake_quant, fp8_fake_quant
from ..numerics import Numerics
from ..plan import CANDIDATE, RESTRICTED, REUSE, LayerKind
from .attention import output_projection, window_keys, write_window
from .chunk import Chunk
from .compressor import pool_chunk
from .linear import dense
from .norm import rms_norm
from .rope import apply_rope
from .stages import scope, stage

__all__ = ["Published", "empty_published", "shared_attention", "compress_source", "candidate_blocks",
           "candidate_mask", "query_heads", "window_entries", "window_codec"]


class Published(NamedTuple):
    """Per-forward values one layer hands to the next ones.

    idx int32 [B, S, K] / selected bool [B, S, K]: the latest index source's top-k (K = index_topk);
    blocks int32 [B, S, Kb] / blocks_kept bool [B, S, Kb]: the candidate source's kept blocks
    (Kb = candidate_topk_blocks; the per-entry mask is rebuilt where it is applied, so the carry stays
    small at long context).
    """

    idx: jax.Array
    selected: jax.Array
    blocks: jax.Array
    blocks_kept: jax.Array


def empty_published(config: ModelConfig, B: int, S: int) -> Published:
    K = config.index_topk
    Kb = config.sharing.candidate_topk_blocks if config.sharing.candidate_source is not None else 1
    return Published(jnp.zeros((B, S, K), jnp.int32), jnp.zeros((B, S, K), bool),
                     jnp.zeros((B, S, Kb), jnp.int32), jnp.zeros((B, S, Kb), bool))


@stage("compressor")
def compress_source(x: jax.Array, p: dict, src: dict, row: jax.Array, chunk: Chunk, *, ratio: int,
                    freqs: np.ndarray, config: ModelConfig, numerics: Numerics) -> dict:
    """A KV source's compressor: pool the groups completed by this chunk into latents L_j (before RoPE),
    then write the compressed KV entry RoPE(L_j) and the index key RoPE(k_norm(W_k L_j)) of each.

    x [B, S, d] attention input; p = {"compressor": {wkv, wgate (ratio > 1), norm}, "indexer": {wk, k_norm}};
    src: this ratio's shared caches (ckv, ikeys [n, B, Tc+1, ...], cbuf_* [n, B, m+1, D]); `row` selects
    the source. Returns the updated caches.
    """
    m, eps = ratio, config.norm_eps
    pc, pi = p["compressor"], p["indexer"]
    tc = src["ckv"].shape[2] - 1
    if m == 1:   # every token is its own group: no gate, a plain bf16 projection
        latent = rms_norm(linear(x, pc["wkv"], numerics), pc["norm"], eps)
        g = chunk.positions
        g_valid = chunk.valid & (g < tc)
    else:
        a, z = linear_f32(x, pc["wkv"], numerics), linear_f32(x, pc["wgate"], numerics)
        pooled, g, g_valid, buf_kv, buf_sc = pool_chunk(a, z, src["cbuf_kv"], src["cbuf_score"], row, chunk,
                                                        ratio=m, overlap=False, n_entries=tc)
        src = {**src, "cbuf_kv": buf_kv, "cbuf_score": buf_sc}
        latent = rms_norm(pooled.astype(x.dtype), pc["norm"], eps)
    entry_pos = g * m
    kv = apply_rope(latent, entry_pos, freqs)
    key = apply_rope(rms_norm(linear(latent, pi["wk"], numerics), pi["k_norm"], eps), entry_pos, freqs)
    if numerics.packed_kv:     # records quantise the raw values: decoding gives the QAT'd ones exactly
        kv = kernels.get("encode_ckv_v41")(kv, numerics.ckv_fp4_block)
        key = kernels.get("encode_ikey_v41")(key, numerics.fp4_block)
    elif numerics.quantize_activations:
        kv = fp4e4_fake_quant(kv, numerics.ckv_fp4_block)
        key = fp4_fake_quant(key, numerics.fp4_block)
    at = jnp.where(g_valid, jnp.clip(g, 0, tc), tc)          # clamped in the graph (graphcheck S12)
    ckv = src["ckv"].at[row, chunk.batch_index, at].set(jnp.where(g_valid[..., None], kv, 0).astype(src["ckv"].dtype))
    ikeys = src["ikeys"].at[row, chunk.batch_index, at].set(
        jnp.where(g_valid[..., None], key, 0).astype(src["ikeys"].dtype))
    return {**src, "ckv": ckv, "ikeys": ikeys}


def candidate_blocks(score: jax.Array, visible_count: jax.Array, *, block: int, top_blocks: int
                     ) -> tuple[jax.Array, jax.Array]:
    """Two-level preselection (§5.5): score [B, S, T] (-inf where not visible) max-pooled over blocks of
    `block` entries; the block of the newest visible entry pinned to +inf; the best `top_blocks` blocks
    with a finite pooled score kept. Returns (block ids int32 [B, S, top_blocks], kept bool [...])."""
    B, S, T = score.shape
    nb = -(-T // block)
    padded = jnp.pad(score, ((0, 0), (0, 0), (0, nb * block - T)), constant_values=-jnp.inf)
    pooled = jnp.max(padded.reshape(B, S, nb, block), axis=-1)
    newest = jnp.where(visible_count > 0, (visible_count - 1) // block, -1)
    pooled = jnp.where(jnp.arange(nb, dtype=jnp.int32) == newest[..., None], jnp.inf, pooled)
    vals, bidx = kernels.get("topk")(pooled, min(top_blocks, nb))
    kept = vals > -jnp.inf
    pad = top_blocks - bidx.shape[-1]
    return (jnp.pad(bidx.astype(jnp.int32), ((0, 0), (0, 0), (0, pad))),
            jnp.pad(kept, ((0, 0), (0, 0), (0, pad))))


def candidate_mask(blocks: jax.Array, kept: jax.Array, T: int, block: int) -> jax.Array:
    """Kept candidate blocks [B, S, Kb] -> bool mask over T entries [B, S, T]."""
    B, S, _ = blocks.shape
    nb = -(-T // block)
    b = jnp.arange(B)[:, None, None]
    s = jnp.arange(S)[None, :, None]
    mask = jnp.zeros((B, S, nb), bool).at[b, s, jnp.clip(blocks, 0, nb - 1)].max(kept)
    return jnp.repeat(mask, block, axis=-1)[..., :T]


@stage("indexer")
def _index_select(x: jax.Array, q_latent: jax.Array, p: dict, keys: jax.Array, chunk: Chunk, published: Published,
                  *, role: str, ratio: int, freqs: np.ndarray, config: ModelConfig, numerics: Numerics) -> Published:
    """An index source's top-k over its KV source's index keys [B, Tc+1, DI] (no Hadamard in V4.1)."""
    B, S, _ = x.shape
    nI, DI, K = config.index_n_heads, config.index_head_dim, config.index_topk
    q = dense(q_latent, p["wq_b"], numerics).reshape(B, S, nI, DI)
    q = apply_rope(q, chunk.positions[..., None], freqs)
    if numerics.quantize_activations:
        q = fp4_fake_quant(q, numerics.fp4_block)
    w = linear_f32(x, p["weights_proj"]) * (DI ** -0.5 * nI ** -0.5)        # [B, S, nI]
    visible_count = (chunk.positions + 1) // ratio                            # [B, S]
    T = keys.shape[1]
    score = kernels.get("index_scores")(q, keys, w, visible_count)            # [B, S, T], -inf past the count
    sh = config.sharing
    blocks, kept = published.blocks, published.blocks_kept
    if role == CANDIDATE:
        blocks, kept = candidate_blocks(score, visible_count, block=sh.candidate_block_size,
                                        top_blocks=sh.candidate_topk_blocks)
    elif role == RESTRICTED:
        score = jnp.where(candidate_mask(blocks, kept, T, sh.candidate_block_size), score, -jnp.inf)
    topk = kernels.get("topk")
    vals, idx = topk(score, min(K, T))
    selected = vals > -jnp.inf
    # DeepSeek re-sorts the selection ascending (summation order in the attention); a float top-k of -idx
    # does it without a sort op (exact: entry ids < 2^24)
    _, order = topk(jnp.where(selected, -idx.astype(jnp.float32), -jnp.inf), idx.shape[-1])
    idx = jnp.take_along_axis(idx, order, axis=-1).astype(jnp.int32)
    selected = jnp.take_along_axis(selected, order, axis=-1)
    if K > T:
        idx = jnp.pad(idx, ((0, 0), (0, 0), (0, K - T)))
        selected = jnp.pad(selected, ((0, 0), (0, 0), (0, K - T)))
    return Published(idx, selected, blocks, kept)


@stage("projection")
def query_heads(p: dict, x: jax.Array, positions: jax.Array, freqs: np.ndarray, *, config: ModelConfig,
                numerics: Numerics) -> tuple[jax.Array, jax.Array]:
    """x [B, S, d] (after attn_norm) at positions int32 [B, S] -> (q latent [B, S, q_lora_rank], RoPE'd queries
    [B, S, H, D]); no per-head q norm in V4.1."""
    B, S, _ = x.shape
    q_latent = rms_norm(dense(x, p["wq_a"], numerics), p["q_norm"], config.norm_eps)
    q = dense(q_latent, p["wq_b"], numerics).reshape(B, S, config.n_heads, config.head_dim)
    return q_latent, apply_rope(q, positions[..., None], freqs)


@stage("projection")
def window_entries(p: dict, x: jax.Array, positions: jax.Array, freqs: np.ndarray, *, config: ModelConfig,
                   numerics: Numerics) -> tuple[jax.Array, jax.Array]:
    """The window K=V of x [B, S, d] at positions int32 [B, S]: (raw kv_norm(W_kv x) RoPE'd [B, S, D], the value
    attended: with DeepSeek's numerics fp8-simulated over all D dims, rope tail included, §5.3)."""
    kv_raw = apply_rope(rms_norm(dense(x, p["wkv"], numerics), p["kv_norm"], config.norm_eps), positions, freqs)
    if numerics.quantize_activations:
        return kv_raw, fp8_fake_quant(kv_raw, numerics.kv_block, numerics.fp8_max)
    return kv_raw, kv_raw


def window_codec(numerics: Numerics, config: ModelConfig, dtype) -> tuple:
    """(read, store) between window K=V values and ring rows: identity for float rows; with packed_kv, fp8 records
    (store takes the raw values, window_entries' first output)."""
    if not numerics.packed_kv:
        return (lambda v: v), (lambda v: v)
    nx = numerics
    read = functools.partial(kernels.get("decode_window_v41"), D=config.head_dim, block=nx.kv_block, dtype=dtype)
    store = functools.partial(kernels.get("encode_window_v41"), block=nx.kv_block, fp8_max=nx.fp8_max)
    return read, store


def shared_attention(p: dict, window: jax.Array, layer: jax.Array, sources: dict, row: jax.Array, x: jax.Array,
                     chunk: Chunk, published: Published, *, config: ModelConfig, numerics: Numerics, kind: LayerKind,
                     freqs: np.ndarray) -> tuple[jax.Array, jax.Array, dict, Published]:
    """x [B, S, d] (after attn_norm) -> ([B, S, d], window, sources, published).

    window [R, B, W+1, D]: this slot's window rings (`layer` = repetition); sources: all shared caches
    (state["sources"]), `row` = this layer's source row in its ratio's group (traced int32).
    """
    D, W = config.head_dim, config.window_size
    pos = chunk.positions

    q_latent, q = query_heads(p, x, pos, freqs, config=config, numerics=numerics)
    kv_raw, kv = window_entries(p, x, pos, freqs, config=config, numerics=numerics)
    read, store = window_codec(numerics, config, x.dtype)
    ckv_read = ikey_read = (lambda v: v)
    if numerics.packed_kv:
        nx = numerics
        ckv_read = functools.partial(kernels.get("decode_ckv_v41"), D=D, block=nx.ckv_fp4_block, dtype=x.dtype)
        ikey_read = functools.partial(kernels.get("decode_ikey_v41"), DI=config.index_head_dim, block=nx.fp4_block,
                                      dtype=x.dtype)

    ring, ring_visible = window_keys({"window": window}, layer, chunk, W, read)
    t = pos[..., None]
    chunk_visible = (pos[:, None, :] <= t) & (pos[:, None, :] > t - W) & chunk.valid[:, None, :]
    sel_keys = sel_mask = None

    m, role = kind.attn.ratio, kind.shared
    if m > 0:
        key = f"r{m}"
        src = sources[key]
        if role.kv_source:
            src = compress_source(x, {"compressor": p["compressor"], "indexer": p["indexer"]}, src, row, chunk,
                                  ratio=m, freqs=freqs, config=config, numerics=numerics)
            sources = {**sources, key: src}
        if role.index != REUSE:
            published = _index_select(x, q_latent, p["indexer"], ikey_read(src["ikeys"][row]), chunk, published,
                                      role=role.index, ratio=m, freqs=freqs, config=config, numerics=numerics)
        entries = src["ckv"][row]                                            # [B, Tc+1, D | record]
        idx = jnp.clip(published.idx, 0, entries.shape[1] - 1)
        sel_keys = ckv_read(jnp.take_along_axis(entries[:, None], idx[..., None], axis=2))   # [B, S, K, D]
        sel_mask = published.selected

    with scope("attention_core"):
        o = kernels.get("sparse_attention")(
            q, jnp.concatenate([ring.astype(kv.dtype), kv], axis=1),
            jnp.concatenate([ring_visible, chunk_visible], axis=2), sel_keys, sel_mask, p["attn_sink"], D ** -0.5)
    window = write_window(window, layer, chunk, kv_raw if numerics.packed_kv else kv, W, store)
    y = output_projection(o, p, chunk, config=config, numerics=numerics, freqs=freqs, dtype=x.dtype)
    return y, window, sources, published
