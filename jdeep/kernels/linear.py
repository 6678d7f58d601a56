"""Dense products with PyTorch-layout weights (`W [N, K]`, `y = x Wᵀ`) and the decode of quantized weight leaves:
the building blocks the hot-op references and the layers share."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .registry import get

__all__ = ["linear", "linear_f32", "dequant", "is_quantized_leaf", "stack_dims", "from_bits"]


def linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., K] · W [N, K]ᵀ -> [..., N] in x's dtype, fp32 accumulation."""
    y = jax.lax.dot_general(x.astype(w.dtype), w, (((x.ndim - 1,), (1,)), ((), ())),
                            precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


def linear_f32(x: jax.Array, w: jax.Array) -> jax.Array:
    """Same product with both operands cast to fp32 first (gate, compressor, mHC, head: spec §6.3)."""
    return jax.lax.dot_general(x.astype(jnp.float32), w.astype(jnp.float32), (((x.ndim - 1,), (1,)), ((), ())),
                               precision=jax.lax.Precision.HIGHEST)


def from_bits(a: jax.Array) -> jax.Array:
    """A bf16 weight carried as its uint16 bit patterns (kernels.registry.bf16_weights_as_bits) -> the bf16 array, a
    bitcast; any other array unchanged. Called on slices, after the loop that sliced them."""
    return jax.lax.bitcast_convert_type(a, jnp.bfloat16) if a.dtype == jnp.uint16 else a


def is_quantized_leaf(w) -> bool:
    """Whether `w` is a checkpoint's quantized weight as loaded: {"codes", "scale"} (fp8) or {"packed", "scale"} (fp4)."""
    return isinstance(w, dict) and set(w) in ({"codes", "scale"}, {"packed", "scale"})


def stack_dims(w, n: int) -> tuple[int, ...]:
    """The first n dims of a weight leaf (float array, codes with scales, or decoded values): its stack dims
    ([R, E] of stacked experts), which every part of a quantized leaf shares."""
    if isinstance(w, dict):
        w = w["decoded"] if "decoded" in w else w["scale"]
    return tuple(w.shape[:n])


def dequant(w: dict, numerics, dtype) -> jax.Array:
    """Quantized weight leaf ({"codes", "scale"} fp8 / {"packed", "scale"} fp4, or {"decoded": values} decoded at
    load, model/weights.py) -> values in `dtype` (exact for float32 and bfloat16), through the dequant_fp8 /
    dequant_fp4 hot ops."""
    if "decoded" in w:
        return from_bits(w["decoded"]).astype(dtype)
    if "codes" in w:
        return get("dequant_fp8")(w["codes"], w["scale"], numerics.weight_block, dtype, numerics.trn2_weights)
    return get("dequant_fp4")(w["packed"], w["scale"], dtype, numerics.fp4_block)
