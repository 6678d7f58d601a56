"""Dense projections with PyTorch-layout weights (`W [N, K]`, `y = x Wᵀ`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["linear", "linear_f32"]


def linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., K] · W [N, K]ᵀ -> [..., N] in x's dtype, fp32 accumulation."""
    y = jax.lax.dot_general(x.astype(w.dtype), w, (((x.ndim - 1,), (1,)), ((), ())),
                            precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


def linear_f32(x: jax.Array, w: jax.Array) -> jax.Array:
    """Same product with both operands cast to fp32 first (gate, compressor, mHC, head: spec §6.3)."""
    return jax.lax.dot_general(x.astype(jnp.float32), w.astype(jnp.float32), (((x.ndim - 1,), (1,)), ((), ())),
                               precision=jax.lax.Precision.HIGHEST)
