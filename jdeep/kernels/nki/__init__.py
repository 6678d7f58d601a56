"""NKI kernels of the hot ops (AWS Neuron), one module per kernel family, each written against the NKI 0.6 API
(`import nki`, `nki.language as nl`, `nki.isa as nisa`; outputs allocated in shared HBM and returned).

Each module holds the kernel body (`*_kernel`, run by `nki.jit` on Neuron or `nki.simulate` in tests) and the JAX op
with its jnp twin's signature (kernels/reference.py), registered for the `neuron` platform by `register_all`.
Importing a module imports `nki`: `jdeep.kernels.get` does so only when JAX's backend is neuron.
"""

from __future__ import annotations

import importlib

from ..registry import register

__all__ = ["KERNELS", "register_all"]

# op name -> (module, JAX op, kernel body)
KERNELS: dict[str, tuple[str, str, str]] = {
    "rms_norm": ("norm", "rms_norm", "rmsnorm_kernel"),
    "swiglu": ("swiglu", "swiglu", "swiglu_kernel"),
    "fp8_linear": ("gemm", "fp8_linear", "fp8_linear_kernel"),
    "hc_split_sinkhorn": ("mhc", "hc_split_sinkhorn", "hc_sinkhorn_kernel"),
    "sparse_attention": ("attention", "sparse_attention", "sparse_attention_kernel"),
    "index_scores": ("indexer", "index_scores", "index_scores_kernel"),
    "topk": ("topk", "topk", "topk_kernel"),
    "hc_mix_logits": ("mhc", "hc_mix_logits", "hc_mix_logits_kernel"),
    "hc_collapse": ("mhc", "hc_collapse", "hc_collapse_kernel"),
    "hc_expand": ("mhc", "hc_expand", "hc_expand_kernel"),
    "softmax_pool": ("pool", "softmax_pool", "softmax_pool_kernel"),
    # the MoE ops run two kernels each: expert_gate_up_kernel, then expert_down_kernel
    "moe_experts_gather": ("moe", "moe_experts_gather", "expert_gate_up_kernel"),
    "moe_experts_grouped": ("moe", "moe_experts_grouped", "expert_gate_up_kernel"),
    "moe_experts_dense": ("moe", "moe_experts_dense", "expert_gate_up_kernel"),
    "shared_expert": ("moe", "shared_expert", "expert_gate_up_kernel"),
}


def module(op: str):
    return importlib.import_module(f"{__name__}.{KERNELS[op][0]}")


def register_all() -> None:
    """Register every NKI op under the `neuron` platform (imports the `nki` package)."""
    for op, (_, fn, _) in KERNELS.items():
        register(op, "neuron")(getattr(module(op), fn))
