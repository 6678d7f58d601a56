"""Hot ops: pure-jnp references (the spec, the CPU/GPU path), NKI kernels (Neuron) and a native CPU kernel for
products with few rows (kernels/cpu), behind one dispatch point (registry.py: `kernels.get(name)` and the
per-platform choices). Importing the package registers every reference op."""

from __future__ import annotations

from . import kv_record, kv_record_v41, quant, reference  # noqa: F401  (register the reference ops)
from .registry import (bf16_weights_as_bits, fence_gemm_inputs, get, implementation, native_gemm_rows,
                       pair_kernel_limit, register, registered, skip_padding_tiles, weight_format)

__all__ = ["register", "get", "registered", "implementation", "weight_format", "pair_kernel_limit",
           "bf16_weights_as_bits", "fence_gemm_inputs", "skip_padding_tiles", "native_gemm_rows"]
