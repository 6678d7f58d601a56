"""DeepSeek's quantisation numerics in jnp (model-spec.md §3.3, §6.3, §6.4).

The reference *simulates* low-precision activations: values are quantised and immediately dequantised
("QAT"), so the next op sees the rounded values. Weights stay uint8 codes + ue8m0 exponent bytes and
are decoded arithmetically where they are used.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import codecs
from .registry import register

__all__ = ["act_scale", "act_quant", "fp8_fake_quant", "gemm_input", "written_out", "fp4_fake_quant", "hadamard", "dequant_fp8", "dequant_fp4"]

ACT_AMAX_FLOOR = 1e-4                  # act_quant's floor on a block's max |x|
FP4_AMAX_FLOOR = 6.0 * 2.0 ** -126     # Qfp4's floor


def _blocks(x: jax.Array, block: int) -> jax.Array:
    if x.shape[-1] % block:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of the quantisation block {block}")
    return x.reshape(x.shape[:-1] + (x.shape[-1] // block, block))


def act_scale(amax: jax.Array, fmt_max: float, floor: float) -> jax.Array:
    """Power-of-two scale 2^ceil(log2(max(amax, floor) / fmt_max)) (float32)."""
    ratio = jnp.maximum(amax.astype(jnp.float32), jnp.float32(floor)) / jnp.float32(fmt_max)
    return codecs.pow2(jnp, codecs.ceil_log2(jnp, ratio))


@register("act_quant")
def act_quant(x: jax.Array, block: int, fp8_max: float = codecs.E4M3FN_MAX) -> tuple[jax.Array, jax.Array]:
    """Per 1 x block group along the last dim: (q, s) with q on the e4m3 grid (float32) and s the
    power-of-two scale [..., K/block], so that x ≈ q * s."""
    xb = _blocks(x.astype(jnp.float32), block)
    s = act_scale(jnp.max(jnp.abs(xb), axis=-1), fp8_max, ACT_AMAX_FLOOR)
    q = codecs.e4m3_round(jnp, xb / s[..., None], fp8_max)
    return q.reshape(x.shape), s


def fp8_fake_quant(x: jax.Array, block: int, fp8_max: float = codecs.E4M3FN_MAX) -> jax.Array:
    """x rounded through act_quant and dequantised, in x's dtype."""
    q, s = act_quant(x, block, fp8_max)
    return (_blocks(q, block) * s[..., None]).reshape(x.shape).astype(x.dtype)


def written_out(x: jax.Array) -> jax.Array:
    """x itself, as an array XLA writes to memory: a scatter of x's elements onto their own positions. XLA fuses
    elementwise producers into their consumers, a dot's operand included; a scatter is not fused into what reads it
    (an optimization_barrier would not do: XLA:CPU removes barriers before fusion)."""
    flat = x.reshape(-1)
    ids = jnp.arange(flat.shape[0], dtype=jnp.int32)
    return jnp.zeros_like(flat).at[ids].set(flat, indices_are_sorted=True, unique_indices=True).reshape(x.shape)


# Inputs of more rows than this are not fenced: XLA:CPU fuses elementwise producers only into matrix-vector loops
# (decode's few rows, and the per-pair expert products taken from them); a product of a prefill chunk's rows goes
# through its GEMM path, which reads the operand from memory anyway, so there the fence is one more copy.
FENCE_MAX_ROWS = 64


def gemm_input(x: jax.Array, numerics) -> jax.Array:
    """The input of a quantized GEMM under `numerics`: fp8 act_quant (1 x act_block groups) when DeepSeek's numerics
    run, else x; written out first where the platform fuses it into the product (Numerics.fence_gemm_inputs) and
    the product has at most FENCE_MAX_ROWS rows."""
    if numerics is None or not numerics.quantize_activations:
        return x
    xq = fp8_fake_quant(x, numerics.act_block, numerics.fp8_max)
    rows = x.size // x.shape[-1] if x.ndim else 1
    return written_out(xq) if numerics.fence_gemm_inputs and rows <= FENCE_MAX_ROWS else xq


@register("fp4_fake_quant")
def fp4_fake_quant(x: jax.Array, block: int = 32) -> jax.Array:
    """Qfp4: per 1 x block, power-of-two scale with amax/6, e2m1 values; dequantised, in x's dtype."""
    xb = _blocks(x.astype(jnp.float32), block)
    s = act_scale(jnp.max(jnp.abs(xb), axis=-1), codecs.E2M1_MAX, FP4_AMAX_FLOOR)
    q = codecs.e2m1_round(jnp, xb / s[..., None])
    return (q * s[..., None]).reshape(x.shape).astype(x.dtype)


FP4E4_AMAX_FLOOR = 6.0 * 2.0 ** -9      # Qfp4e4's floor: the scale never drops below e4m3's smallest subnormal


@register("fp4e4_fake_quant")
def fp4e4_fake_quant(x: jax.Array, block: int = 16) -> jax.Array:
    """Qfp4e4 (V4.1 compressed KV): per 1 x block, an e4m3fn scale amax/6 rounded to nearest (not a power of
    two), e2m1 values; dequantised, in x's dtype."""
    xb = _blocks(x.astype(jnp.float32), block)
    amax = jnp.maximum(jnp.max(jnp.abs(xb), axis=-1), FP4E4_AMAX_FLOOR)
    s = codecs.e4m3_round(jnp, amax / codecs.E2M1_MAX)
    q = codecs.e2m1_round(jnp, xb / s[..., None])
    return (q * s[..., None]).reshape(x.shape).astype(x.dtype)


@register("hadamard")
def hadamard(x: jax.Array) -> jax.Array:
    """Walsh-Hadamard transform over the last dim (Sylvester order), scaled by n^-1/2; fp32 math."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"Hadamard size {n} is not a power of two")
    y = x.astype(jnp.float32)
    h = 1
    while h < n:
        y = y.reshape(x.shape[:-1] + (n // (2 * h), 2, h))
        a, b = y[..., 0, :], y[..., 1, :]
        y = jnp.stack([a + b, a - b], axis=-2)
        h *= 2
    return (y.reshape(x.shape) * jnp.float32(n ** -0.5)).astype(x.dtype)


def _expand_scale(scale: jax.Array, block: tuple[int, int], shape: tuple[int, int]) -> jax.Array:
    """[..., ceil(N/bn), ceil(K/bk)] exponent bytes -> float32 scale per element [..., N, K]."""
    s = codecs.ue8m0_decode(jnp, scale)
    s = jnp.repeat(jnp.repeat(s, block[0], axis=-2), block[1], axis=-1)
    return s[..., : shape[0], : shape[1]]


@register("dequant_fp8")
def dequant_fp8(codes: jax.Array, scale: jax.Array, block: tuple[int, int], dtype, trn2: bool = False) -> jax.Array:
    """fp8 weight codes [..., N, K] with ue8m0 block scales [..., ceil(N/bn), ceil(K/bk)] -> dtype [..., N, K]."""
    w = codecs.e4m3_decode(jnp, codes, trn2=trn2) * _expand_scale(scale, block, codes.shape[-2:])
    return w.astype(dtype)


@register("dequant_fp4")
def dequant_fp4(packed: jax.Array, scale: jax.Array, dtype, block: int = 32) -> jax.Array:
    """Packed e2m1 weights [..., N, K/2] with ue8m0 scales [..., N, K/block] -> dtype [..., N, K]."""
    w = codecs.e2m1_decode(jnp, codecs.unpack_e2m1(jnp, packed))
    s = jnp.repeat(codecs.ue8m0_decode(jnp, scale), block, axis=-1)
    return (w * s).astype(dtype)

