"""Rotary embedding on the tail dims, interleaved pairs, with optional YaRN (model-spec.md §3.2)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from ..config import RopeConfig

__all__ = ["inv_freq", "apply_rope"]


def inv_freq(rope: RopeConfig, rope_dim: int) -> np.ndarray:
    """Per-pair frequencies f_i [rope_dim/2] float32, YaRN-interpolated when configured."""
    i = np.arange(rope_dim // 2, dtype=np.float64)
    f = rope.theta ** (-2.0 * i / rope_dim)
    y = rope.yarn
    if y is not None:
        def corr_dim(k: float) -> float:
            return rope_dim * math.log(y.original_seq_len / (2 * math.pi * k)) / (2 * math.log(rope.theta))

        low = max(math.floor(corr_dim(y.beta_fast)), 0)
        high = min(math.ceil(corr_dim(y.beta_slow)), rope_dim - 1)
        width = (high - low) if high != low else 0.001
        ramp = np.clip((i - low) / width, 0.0, 1.0)
        f = f / y.factor * ramp + f * (1.0 - ramp)
    return f.astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, freqs: np.ndarray, inverse: bool = False) -> jax.Array:
    """Rotate the last 2*len(freqs) dims of x by angle position*f_i, pairs (2i, 2i+1) interleaved.

    x: [..., S, (heads,) D]; positions: int32 broadcastable to x's leading dims without the last
    one (e.g. [B, S] for x [B, S, D], or [B, S, 1] for x [B, S, H, D]). fp32 math, result in x.dtype.
    """
    r = 2 * freqs.shape[0]
    ang = positions.astype(jnp.float32)[..., None] * jnp.asarray(freqs)  # [..., r/2]
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    if inverse:
        sin = -sin
    tail = x[..., x.shape[-1] - r:].astype(jnp.float32)
    tail = tail.reshape(tail.shape[:-1] + (r // 2, 2))
    a, b = tail[..., 0], tail[..., 1]
    rot = jnp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(x.shape[:-1] + (r,))
    return jnp.concatenate([x[..., : x.shape[-1] - r], rot.astype(x.dtype)], axis=-1)
