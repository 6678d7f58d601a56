"""Engram's device half (model-spec.md §5.7): the gated update of each residual stream from the table
rows the host gathered for this chunk (hashing and the table lookup run on the host, jdeep/engram.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..kernels import codecs
from ..numerics import Numerics
from .linear import dense

__all__ = ["engram_update", "decode_rows"]


def decode_rows(codes: jax.Array, scales: jax.Array, dtype) -> jax.Array:
    """Table rows as stored: e4m3fn codes uint8 [..., hd] with ue8m0 scales uint8 [..., hd/32] -> dtype
    [..., hd] (exact in bf16: 4 significant bits times a power of two)."""
    hd = codes.shape[-1]
    s = jnp.repeat(codecs.ue8m0_decode(jnp, scales), hd // scales.shape[-1], axis=-1)
    return (codecs.e4m3_decode(jnp, codes) * s).astype(dtype)


def engram_update(X: jax.Array, p: dict, codes: jax.Array, scales: jax.Array, *, eps: float,
                  numerics: Numerics, dead: jax.Array | None = None) -> jax.Array:
    """X [B, S, n, d] streams; codes [B, S, R, hd] / scales [B, S, R, hd/32] uint8 (R = rows per token).

    kv = W_ekv · flatten(rows) splits into n keys and one shared value; stream i is gated by
    σ(signed sqrt of <rms(X_i) q_w[i], rms(key_i) k_w[i]> / sqrt(d)) and gets gate_i · value.
    p: wkv (fp8 [(n+1)d, R*hd]), q_weight / k_weight [n, d]. dead bool [B, S]: image tokens (gate 0).
    Returns X's dtype.
    """
    B, S, n, d = X.shape
    rows = decode_rows(codes, scales, X.dtype).reshape(B, S, -1)
    kv = dense(rows, p["wkv"], numerics)                                    # [B, S, (n+1) d]
    keys = kv[..., : n * d].reshape(B, S, n, d).astype(jnp.float32)
    value = kv[..., n * d:].astype(jnp.float32)
    x = X.astype(jnp.float32)
    xn = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    kn = keys * jax.lax.rsqrt(jnp.mean(keys * keys, axis=-1, keepdims=True) + eps)
    qw, kw = p["q_weight"].astype(jnp.float32), p["k_weight"].astype(jnp.float32)
    dot = jnp.sum((xn * qw) * (kn * kw), axis=-1) * d ** -0.5                # [B, S, n]
    root = jnp.sqrt(jnp.maximum(jnp.abs(dot), 1e-6))
    gate = jax.nn.sigmoid(jnp.where(dot < 0, -root, root))   # copysign without its sign-bit bitcast (Neuron)
    if dead is not None:
        gate = jnp.where(dead[..., None], 0.0, gate)
    return (x + gate[..., None] * value[:, :, None, :]).astype(X.dtype)
