"""RMSNorm (model-spec.md §3.1): statistics in fp32, one cast back to the activation dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import kernels
from .stages import stage

__all__ = ["rms", "rms_norm"]


def rms(x: jax.Array, eps: float) -> jax.Array:
    """Weightless RMS normalisation over the last axis, fp32 result."""
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


@stage("norm")
def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """w ⊙ rms(x), returned in x's dtype (the `rms_norm` hot op: jnp reference or NKI kernel)."""
    return kernels.get("rms_norm")(x, weight, eps)
