"""Dense projections with PyTorch-layout weights (`W [N, K]`, `y = x Wᵀ`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["linear", "linear_f32", "dense", "dequant"]


def linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., K] · W [N, K]ᵀ -> [..., N] in x's dtype, fp32 accumulation."""
    y = jax.lax.dot_general(x.astype(w.dtype), w, (((x.ndim - 1,), (1,)), ((), ())),
                            precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


def linear_f32(x: jax.Array, w: jax.Array) -> jax.Array:
    """Same product with both operands cast to fp32 first (gate, compressor, mHC, head: spec §6.3)."""
    return jax.lax.dot_general(x.astype(jnp.float32), w.astype(jnp.float32), (((x.ndim - 1,), (1,)), ((), ())),
                               precision=jax.lax.Precision.HIGHEST)


def dense(x: jax.Array, w, numerics) -> jax.Array:
    """A checkpoint Linear: float weight [N, K], or quantized codes ({"codes", "scale"} fp8 /
    {"packed", "scale"} fp4) decoded in the graph. With DeepSeek's numerics the input is first
    act-quantised (fp8, 1 x act_block groups). Returns x's dtype, fp32 accumulation."""
    if not isinstance(w, dict):
        return linear(x, w)
    from ..kernels.quant import fp8_fake_quant

    from .. import kernels

    if numerics.quantize_activations:
        x = fp8_fake_quant(x, numerics.act_block, numerics.fp8_max)
    if "codes" in w:        # the block-fp8 GEMM hot op (jnp reference or NKI kernel)
        return kernels.get("fp8_linear")(x, w["codes"], w["scale"], numerics.weight_block, numerics.trn2_weights)
    return linear(x, dequant(w, numerics, x.dtype))


def dequant(w: dict, numerics, dtype) -> jax.Array:
    """Quantized weight leaf -> values in `dtype` (exact for float32 and bfloat16)."""
    from .. import kernels

    if "codes" in w:
        return kernels.get("dequant_fp8")(w["codes"], w["scale"], numerics.weight_block, dtype, numerics.trn2_weights)
    return kernels.get("dequant_fp4")(w["packed"], w["scale"], dtype, numerics.fp4_block)
