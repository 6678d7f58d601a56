"""jdeep's native CPU kernels: products with few rows that read their weight in place (rows_gemm.cc).

`rows_gemm(x, w, index)` is x [..., K] · w[index]ᵀ for a weight stack w [*S, N, K] (f32, or bf16 as its values
or as uint16 bit patterns), an XLA FFI call on the CPU platform. It exists because XLA:CPU's own products with
2-16 rows run at a fifth of memory bandwidth after copying a sliced weight out of its stack (docs/performance.md).
The kernel dispatch (kernels.registry.native_gemm_rows, Numerics.native_gemm_rows) decides where it runs; the jnp
products stay the reference it is tested against.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .build import load, status

__all__ = ["rows_gemm", "available", "status", "MAX_ROWS"]

MAX_ROWS = 16      # rows the kernel keeps in registers per pass over the weight


def available() -> bool:
    """Whether the kernels are built and registered in this process (builds them at the first call)."""
    return load() is not None


def rows_gemm(x: jax.Array, w: jax.Array, index: tuple = ()) -> jax.Array:
    """fp32 [..., N] = x [..., K] · W[N, K]ᵀ with W = w[index] (w [*S, N, K], one int per stack dim in `index`,
    each clamped into range as lax.dynamic_slice does). x is taken in fp32; w in f32, bf16, or uint16 (bf16 bit
    patterns, kernels.linear.from_bits). Needs `available()`."""
    if w.ndim - 2 != len(index):
        raise ValueError(f"rows_gemm: weight {w.shape} takes {w.ndim - 2} indices, got {len(index)}")
    if w.dtype == jnp.uint16:
        w = jax.lax.bitcast_convert_type(w, jnp.bfloat16)
    target = {jnp.dtype(jnp.float32): "jdeep_rows_gemm_f32", jnp.dtype(jnp.bfloat16): "jdeep_rows_gemm_bf16"}
    if jnp.dtype(w.dtype) not in target:
        raise TypeError(f"rows_gemm: weights must be float32 or bfloat16, got {w.dtype}")
    idx = jnp.stack([jnp.asarray(i, jnp.int32) for i in index]) if index else jnp.zeros((0,), jnp.int32)
    out = jax.ShapeDtypeStruct(x.shape[:-1] + (w.shape[-2],), jnp.float32)
    return jax.ffi.ffi_call(target[jnp.dtype(w.dtype)], out)(x.astype(jnp.float32), w, idx)
