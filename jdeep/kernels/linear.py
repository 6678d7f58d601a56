"""Dense products with PyTorch-layout weights (`W [N, K]`, `y = x Wᵀ`) and the decode of quantized weight leaves:
the building blocks the hot-op references and the layers share."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import cpu
from .registry import get

__all__ = ["linear", "linear_f32", "dequant", "is_quantized_leaf", "stack_dims", "from_bits", "native_rows",
           "InPlace", "in_place", "as_in_place", "materialized", "grouped", "product"]


def native_rows(x: jax.Array, w: jax.Array, numerics, compute_dtype=None) -> bool:
    """Whether the product of x [..., K] with the weight stack w [..., N, K] runs jdeep's CPU kernel (kernels.cpu):
    the platform's limit (Numerics.native_gemm_rows; 0 off CPU and on a mesh) admits x's row count, and the weight
    is float32 or bf16 (or its uint16 bits) whose cast to compute_dtype (if given) keeps its values (the same dtype,
    or bf16 -> float32). One-row products stay XLA's: its matrix-vector loop streams the weight in place."""
    if isinstance(w, InPlace):
        w = w.stack
    if numerics is None or not numerics.native_gemm_rows or not isinstance(w, jax.Array):
        return False
    stored = jnp.dtype(jnp.bfloat16 if w.dtype == jnp.uint16 else w.dtype)
    if stored not in (jnp.float32, jnp.bfloat16):
        return False
    if compute_dtype is not None and jnp.dtype(compute_dtype) not in (stored, jnp.dtype(jnp.float32)):
        return False
    return 2 <= x.size // x.shape[-1] <= numerics.native_gemm_rows


class InPlace:
    """The matrix stack[index] of a weight stack [*S, N, K] (float, or bf16 as uint16 bits), for the native CPU kernel
    to read where it lies instead of a copy sliced out of the stack. Not a pytree: tree maps over layer parameters
    see it as one leaf. `value()` is the slice itself, for a product that does not take the native path."""

    __slots__ = ("stack", "index")

    def __init__(self, stack: jax.Array, index: tuple):
        self.stack, self.index = stack, tuple(index)

    @property
    def dtype(self):
        return jnp.dtype(jnp.bfloat16) if self.stack.dtype == jnp.uint16 else self.stack.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.stack.shape[len(self.index):])

    def value(self) -> jax.Array:
        start = tuple(self.index) + (0,) * len(self.shape)
        return from_bits(jax.lax.dynamic_slice(self.stack, start, (1,) * len(self.index) + self.shape)
                         .reshape(self.shape))


def materialized(w):
    """w itself, or the slice an InPlace matrix stands for."""
    return w.value() if isinstance(w, InPlace) else w


def in_place(w, index: tuple, x: jax.Array, numerics, dtype=None) -> InPlace | None:
    """w[index] as an InPlace matrix when x's product with it runs the native kernel (`native_rows`), else None.
    w: a float stack, an InPlace stack (its index is extended), or a quantized leaf decoded at load
    ({"decoded": values}, whose values the product casts to `dtype`)."""
    stack = w.get("decoded") if isinstance(w, dict) else w
    index = tuple(index)
    if isinstance(stack, InPlace):
        stack, index = stack.stack, stack.index + index
    if stack is None or not native_rows(x, stack, numerics, dtype if isinstance(w, dict) else None):
        return None
    return InPlace(stack, index)


def grouped(w, shape: tuple[int, ...]):
    """A weight matrix reshaped to `shape` (e.g. wo_a's [G*O, K'] as [G, O, K']); an InPlace matrix's stack is
    reshaped instead (a bitcast, no copy)."""
    if isinstance(w, InPlace):
        return InPlace(w.stack.reshape(w.stack.shape[:len(w.index)] + tuple(shape)), w.index)
    return w.reshape(shape)


def as_in_place(w) -> InPlace:
    """A weight matrix [N, K] (or an InPlace one) as an InPlace matrix of itself."""
    return w if isinstance(w, InPlace) else InPlace(w, ())


def product(x: jax.Array, w) -> jax.Array:
    """fp32 [..., N] = x [..., K] · Wᵀ for W [N, K] (the operands in their promoted dtype, fp32 accumulation) or an
    InPlace matrix (the same values through the native kernel)."""
    if isinstance(w, InPlace):
        return cpu.rows_gemm(x.astype(jnp.promote_types(x.dtype, w.dtype)), w.stack, w.index)
    return jnp.einsum("...k,nk->...n", x, w, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def linear(x: jax.Array, w: jax.Array, numerics=None) -> jax.Array:
    """x [..., K] · W [N, K]ᵀ -> [..., N] in x's dtype, fp32 accumulation (x cast to W's dtype first). With
    numerics, few-row products on CPU run the native kernel (`native_rows`)."""
    if native_rows(x, w, numerics):
        return product(x.astype(w.dtype if isinstance(w, InPlace) else from_bits(w).dtype), as_in_place(w)
                       ).astype(x.dtype)
    w = from_bits(materialized(w))
    y = jax.lax.dot_general(x.astype(w.dtype), w, (((x.ndim - 1,), (1,)), ((), ())),
                            precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


def linear_f32(x: jax.Array, w: jax.Array, numerics=None) -> jax.Array:
    """Same product with both operands cast to fp32 first (gate, compressor, mHC, head: spec §6.3)."""
    if native_rows(x, w, numerics):
        return product(x.astype(jnp.float32), as_in_place(w))
    w = materialized(w)
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
        d = w["decoded"]
        if isinstance(d, InPlace):      # read in place by the native kernel where the cast keeps the values
            return d if jnp.dtype(d.dtype) == jnp.dtype(dtype) else d.value().astype(dtype)
        return from_bits(d).astype(dtype)
    if "codes" in w:
        return get("dequant_fp8")(w["codes"], w["scale"], numerics.weight_block, dtype, numerics.trn2_weights)
    return get("dequant_fp4")(w["packed"], w["scale"], dtype, numerics.fp4_block)
