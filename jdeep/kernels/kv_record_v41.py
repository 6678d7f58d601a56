"""DeepSeek-V4.1 packed cache records (model-spec.md §6.5, "natural packed records"): one uint8 record per
cached entry instead of a float row, holding exactly the values DeepSeek's QAT simulation produces.

    window entry   [ D fp8 e4m3 codes | D/32 ue8m0 exponents ]               528 B at D = 512
    compressed KV  [ D/2 bytes of packed e2m1 codes | D/16 e4m3 scale codes ]  288 B at D = 512
    index key      [ DI/2 bytes of packed e2m1 codes | DI/32 ue8m0 exponents ]  68 B at DI = 128

Encoders take the values *before* the QAT (they quantise, so decoding gives the QAT'd values bit for bit)
and return int32 bytes that the caller narrows to uint8 once, at the store. No bitcasts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import codecs
from .quant import FP4_AMAX_FLOOR, FP4E4_AMAX_FLOOR, _blocks, act_quant, act_scale
from .registry import register

__all__ = ["window_record_bytes", "ckv_record_bytes", "ikey_record_bytes", "encode_window", "decode_window",
           "encode_ckv", "decode_ckv", "encode_ikey", "decode_ikey"]


def window_record_bytes(D: int, block: int = 32) -> int:
    return D + D // block


def ckv_record_bytes(D: int, block: int = 16) -> int:
    return D // 2 + D // block


def ikey_record_bytes(DI: int, block: int = 32) -> int:
    return DI // 2 + DI // block


@register("encode_window_v41")
def encode_window(kv: jax.Array, block: int, fp8_max: float) -> jax.Array:
    """kv [..., D] -> int32 bytes [..., D + D/block]: fp8 codes with power-of-two scales (act_quant)."""
    q, s = act_quant(kv, block, fp8_max)
    return jnp.concatenate([codecs.e4m3_encode(jnp, q, fp8_max), codecs.ue8m0_encode(jnp, s)], axis=-1)


@register("decode_window_v41")
def decode_window(rec: jax.Array, D: int, block: int, dtype) -> jax.Array:
    """Codes saturate at the fp8 maximum in use (<= 240 on trn2), where e4m3fn and trn2 e4m3 agree."""
    r = rec.astype(jnp.int32)
    scale = jnp.repeat(codecs.ue8m0_decode(jnp, r[..., D:]), block, axis=-1)
    return (codecs.e4m3_decode(jnp, r[..., :D]) * scale).astype(dtype)


@register("encode_ckv_v41")
def encode_ckv(kv: jax.Array, block: int) -> jax.Array:
    """kv [..., D] -> int32 bytes [..., D/2 + D/block]: e2m1 codes with an e4m3fn scale amax/6 per block."""
    xb = _blocks(kv.astype(jnp.float32), block)
    amax = jnp.maximum(jnp.max(jnp.abs(xb), axis=-1), FP4E4_AMAX_FLOOR)
    s = codecs.e4m3_round(jnp, amax / codecs.E2M1_MAX)
    codes = codecs.e2m1_encode(jnp, (xb / s[..., None]).reshape(kv.shape))
    return jnp.concatenate([codecs.pack_e2m1(jnp, codes), codecs.e4m3_encode(jnp, s)], axis=-1)


def _decode_fp4(rec: jax.Array, n: int, block: int, scale_decode, dtype) -> jax.Array:
    """[n/2 packed e2m1 bytes | n/block scale bytes] -> values [..., n]."""
    r = rec.astype(jnp.int32)
    vals = codecs.e2m1_decode(jnp, codecs.unpack_e2m1(jnp, r[..., : n // 2]))
    scale = jnp.repeat(scale_decode(jnp, r[..., n // 2:]), block, axis=-1)
    return (vals * scale).astype(dtype)


@register("decode_ckv_v41")
def decode_ckv(rec: jax.Array, D: int, block: int, dtype) -> jax.Array:
    return _decode_fp4(rec, D, block, codecs.e4m3_decode, dtype)


@register("encode_ikey_v41")
def encode_ikey(key: jax.Array, block: int) -> jax.Array:
    """key [..., DI] -> int32 bytes [..., DI/2 + DI/block]: e2m1 codes with power-of-two scales (Qfp4)."""
    xb = _blocks(key.astype(jnp.float32), block)
    s = act_scale(jnp.max(jnp.abs(xb), axis=-1), codecs.E2M1_MAX, FP4_AMAX_FLOOR)
    codes = codecs.e2m1_encode(jnp, (xb / s[..., None]).reshape(key.shape))
    return jnp.concatenate([codecs.pack_e2m1(jnp, codes), codecs.ue8m0_encode(jnp, s)], axis=-1)


@register("decode_ikey_v41")
def decode_ikey(rec: jax.Array, DI: int, block: int, dtype) -> jax.Array:
    return _decode_fp4(rec, DI, block, codecs.ue8m0_decode, dtype)
