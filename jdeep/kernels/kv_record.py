"""Packed KV records (model-spec.md §6.5): one uint8 record per cached K=V entry instead of a float row.

Layout of a record for head_dim D, rope_dim r, QAT block b (V4: 448 + 128 + 7 + 1 = 584 bytes at
D = 512 with bf16 activations):

    [ D-r fp8 e4m3 codes | r rope values as little-endian float bytes (bf16: 2, fp32: 4 each) |
      (D-r)/b ue8m0 exponent bytes | zero padding to a multiple of 8 ]

Encoding assumes the entry already went through DeepSeek's KV QAT (fp8 on the non-rope dims), so the
record holds exactly the values the float cache would: decoding gives them back bit for bit. Codes
are assembled as int32 and narrowed to uint8 once by the caller, at the store. Float bytes are built
arithmetically (no bitcast).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import codecs
from .quant import act_quant
from .registry import register

__all__ = ["record_bytes", "encode_kv_record", "decode_kv_record"]


def record_bytes(head_dim: int, rope_dim: int, block: int, itemsize: int) -> int:
    nope = head_dim - rope_dim
    raw = nope + rope_dim * itemsize + nope // block
    return -(-raw // 8) * 8


def _f32_bits(v: jax.Array) -> jax.Array:
    """IEEE float32 bit pattern of v as int32, by arithmetic."""
    a = jnp.abs(v.astype(jnp.float32))
    normal = a >= jnp.float32(2.0 ** -126)
    e = codecs.floor_log2(jnp, jnp.maximum(a, jnp.float32(2.0 ** -126)))
    mant_n = (a / codecs.pow2(jnp, e) - 1.0) * jnp.float32(2.0 ** 23)
    mant_s = a / jnp.float32(2.0 ** -149)
    mant = jnp.where(normal, mant_n, mant_s).astype(jnp.int32)
    field = jnp.where(normal, e + 127, 0)
    sign = (v < 0).astype(jnp.int32)
    return (sign << 31) | (field << 23) | mant


def _f32_from_bits(bits: jax.Array) -> jax.Array:
    sign = (bits >> 31) & 1
    field = (bits >> 23) & 255
    mant = (bits & 0x7FFFFF).astype(jnp.float32)
    mag = jnp.where(field == 0, mant * jnp.float32(2.0 ** -149),
                    (mant + jnp.float32(2.0 ** 23)) * codecs.pow2(jnp, field - 150))
    return jnp.where(sign == 1, -mag, mag)


@register("encode_kv_record")
def encode_kv_record(kv: jax.Array, rope_dim: int, block: int, fp8_max: float = codecs.E4M3FN_MAX) -> jax.Array:
    """kv [..., D] (QAT'd values, bf16 or fp32) -> int32 bytes [..., record_bytes]."""
    D = kv.shape[-1]
    itemsize = jnp.dtype(kv.dtype).itemsize
    q, s = act_quant(kv[..., : D - rope_dim], block, fp8_max)
    codes = codecs.e4m3_encode(jnp, q, fp8_max)
    bits = _f32_bits(kv[..., D - rope_dim:])
    shifts = (16, 24) if itemsize == 2 else (0, 8, 16, 24)
    rope = jnp.stack([(bits >> k) & 255 for k in shifts], axis=-1).reshape(kv.shape[:-1] + (rope_dim * itemsize,))
    exps = codecs.ue8m0_encode(jnp, s)
    parts = [codes, rope, exps]
    n = record_bytes(D, rope_dim, block, itemsize)
    used = sum(p.shape[-1] for p in parts)
    if n > used:
        parts.append(jnp.zeros(kv.shape[:-1] + (n - used,), jnp.int32))
    return jnp.concatenate(parts, axis=-1)


@register("decode_kv_record")
def decode_kv_record(rec: jax.Array, head_dim: int, rope_dim: int, block: int, dtype) -> jax.Array:
    """uint8 records [..., record_bytes] -> values [..., head_dim] in dtype (bf16 or fp32 rope bytes)."""
    nope = head_dim - rope_dim
    itemsize = jnp.dtype(dtype).itemsize
    r = rec.astype(jnp.int32)
    codes = r[..., :nope]
    rope_b = r[..., nope: nope + rope_dim * itemsize].reshape(rec.shape[:-1] + (rope_dim, itemsize))
    exps = r[..., nope + rope_dim * itemsize: nope + rope_dim * itemsize + nope // block]
    scale = jnp.repeat(codecs.ue8m0_decode(jnp, exps), block, axis=-1)
    vals = codecs.e4m3_decode(jnp, codes) * scale
    shifts = (16, 24) if itemsize == 2 else (0, 8, 16, 24)
    bits = sum(rope_b[..., i] << k for i, k in enumerate(shifts))
    rope = _f32_from_bits(bits)
    return jnp.concatenate([vals, rope], axis=-1).astype(dtype)
