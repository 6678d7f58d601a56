"""A checkpoint Linear in the graph: float weights, or fp8/fp4 codes decoded where used, with DeepSeek's
activation quantisation in front of quantized GEMMs."""

from __future__ import annotations

import jax

from .. import kernels
from ..kernels.linear import dequant, linear
from ..kernels.quant import gemm_input

__all__ = ["dense"]


def dense(x: jax.Array, w, numerics) -> jax.Array:
    """A checkpoint Linear: float weight [N, K], or quantized codes ({"codes", "scale"} fp8 /
    {"packed", "scale"} fp4) decoded in the graph. With DeepSeek's numerics the input is first
    act-quantised (fp8, 1 x act_block groups). Returns x's dtype, fp32 accumulation."""
    if not isinstance(w, dict):
        return linear(x, w, numerics)
    x = gemm_input(x, numerics)
    if "codes" in w:        # the block-fp8 GEMM hot op (jnp reference or NKI kernel)
        return kernels.get("fp8_linear")(x, w["codes"], w["scale"], numerics.weight_block, numerics.trn2_weights)
    return linear(x, dequant(w, numerics, x.dtype), numerics)
