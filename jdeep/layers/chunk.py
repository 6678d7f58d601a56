"""The per-step token layout shared by prefill and decode.

A step processes a chunk of S tokens for each of B sequences. Row b holds n_valid[b] real tokens at
the consecutive positions pos0[b] .. pos0[b]+n_valid[b]-1, then padding. Decode is S = 1.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["Chunk", "make_chunk"]


class Chunk(NamedTuple):
    tokens: jax.Array     # int32 [B, S], clipped into the vocabulary
    positions: jax.Array  # int32 [B, S], pos0 + j (also for padding, which is masked by `valid`)
    valid: jax.Array      # bool [B, S]
    pos0: jax.Array       # int32 [B]
    n_valid: jax.Array    # int32 [B]
    batch_index: jax.Array  # int32 [B, 1], for scatters into [B, ...] state rows


def make_chunk(tokens: jax.Array, positions: jax.Array, vocab_size: int) -> Chunk:
    """tokens, positions: int32 [B, S]; positions[b, j] = -1 marks padding (only after the real tokens)."""
    valid = positions >= 0
    n_valid = jnp.sum(valid, axis=1).astype(jnp.int32)
    pos0 = jnp.where(n_valid > 0, positions[:, 0], 0).astype(jnp.int32)
    S = tokens.shape[1]
    pos = pos0[:, None] + jnp.arange(S, dtype=jnp.int32)[None, :]
    tok = jnp.clip(tokens, 0, vocab_size - 1).astype(jnp.int32)
    bidx = jnp.arange(tokens.shape[0], dtype=jnp.int32)[:, None]
    return Chunk(tok, pos, valid, pos0, n_valid, bidx)
