"""The lightning indexer's training objective (DeepSeek-V3.2's recipe, which V4 keeps): the KL divergence from the
main attention's distribution over the compressed entries to the softmax of the indexer's scores, so that the
indexer learns to rank the entries the heads attend to. The target carries no gradient (the main model learns only
from the language-model loss) and the indexer's inputs are detached where they enter it (layers/indexer.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["index_kl"]

HIGHEST = jax.lax.Precision.HIGHEST
_MASKED = -1e30   # finite, so rows without visible entries stay free of NaNs (their terms are dropped)


def index_kl(q: jax.Array, entries: jax.Array, score: jax.Array, visible_count: jax.Array, valid: jax.Array,
             scale: float) -> jax.Array:
    """Σ over queries of KL(p_t || softmax(score_t)) over the entries visible to each query, and the number of
    queries that see any: fp32 [2].

    q [B, S, H, D] the main attention's queries (normed, rotated); entries [B, T, D] the compressed K=V entries;
    score fp32 [B, S, T] the indexer's scores; visible_count int32 [B, S] (entries j < count are visible);
    valid bool [B, S] the real tokens; scale the attention's logit scale. p_t is the heads' mean of each head's
    softmax of q_h · entries · scale over the visible entries (the sink and the window left out: the indexer
    only ranks compressed entries)."""
    vis = jnp.arange(entries.shape[1], dtype=jnp.int32)[None, None, :] < visible_count[..., None]      # [B, S, T]
    logits = jnp.einsum("bshd,btd->bsht", q, entries, precision=HIGHEST, preferred_element_type=jnp.float32) * scale
    p = jnp.mean(jax.nn.softmax(jnp.where(vis[:, :, None, :], logits, _MASKED), axis=-1), axis=2)
    p = jax.lax.stop_gradient(jnp.where(vis, p, 0.0))
    log_q = jax.nn.log_softmax(jnp.where(vis, score, _MASKED), axis=-1)
    kl = jnp.sum(jnp.where(vis, jax.scipy.special.xlogy(p, p) - p * log_q, 0.0), axis=-1)                 # [B, S]
    counted = valid & (visible_count > 0)
    return jnp.stack([jnp.sum(jnp.where(counted, kl, 0.0)), jnp.sum(counted).astype(jnp.float32)])
