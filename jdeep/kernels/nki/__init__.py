"""NKI kernels of the hot ops (AWS Neuron), one module per kernel family, each written against the NKI 0.6 API
(`import nki`, `nki.language as nl`, `nki.isa as nisa`; outputs allocated in shared HBM and returned).

Each module holds the kernel body (`*_kernel`, run by `nki.jit` on Neuron or `nki.simulate` in tests) and the JAX op
with its jnp twin's signature (kernels/reference.py), registered for the `neuron` platform by `register_all`.
Importing a module imports `nki`: `jdeep.kernels.get` does so only when JAX's backend is neuron.
"""

from __future__ import annotations

import importlib

__all__ = ["KERNELS", "register_all"]

# op name -> (module, JAX op, kernel body)
KERNELS: dict[str, tuple[str, str, str]] = {
    "rms_norm": ("norm", "rms_norm", "rmsnorm_kernel"),
    "swiglu": ("swiglu", "swiglu", "swiglu_kernel"),
    "fp8_linear": ("gemm", "fp8_linear", "fp8_linear_kernel"),
    "hc_split_sinkhorn": ("mhc", "hc_split_sinkhorn", "hc_sinkhorn_kernel"),
}


def module(op: str):
    return importlib.import_module(f"{__name__}.{KERNELS[op][0]}")


def register_all() -> None:
    """Register every NKI op under the `neuron` platform (imports the `nki` package)."""
    from .. import register

    for op, (_, fn, _) in KERNELS.items():
        register(op, "neuron")(getattr(module(op), fn))
