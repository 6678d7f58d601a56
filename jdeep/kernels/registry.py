"""The one dispatch point of the hot ops: each op's implementations by platform, chosen per JAX backend.

The pure-jnp reference of every op (reference.py, quant.py, kv_record*.py) registers under the platform
"reference"; it is the spec and the CPU/GPU path. NKI kernels (kernels/nki) register under "neuron" when
`get` is first called with JAX's default backend `neuron`; nothing else imports the Neuron toolchain.
"""

from __future__ import annotations

import functools
import importlib
from typing import Callable

import jax

from . import cpu

__all__ = ["register", "get", "registered", "implementation", "weight_format", "pair_kernel_limit",
           "bf16_weights_as_bits", "fence_gemm_inputs", "skip_padding_tiles", "native_gemm_rows"]

_IMPLS: dict[str, dict[str, Callable]] = {}
_NEURON_LOADED = False


def register(name: str, platform: str = "reference") -> Callable[[Callable], Callable]:
    """Register fn as op `name`'s implementation on `platform`. What is registered (and returned) traces fn under
    the named scope `name`: the op's name is then in every source location of its StableHLO (debug info only; the
    ops themselves do not change), where `jdeep doctor` finds the model stage a failing sub-program lies in."""
    def deco(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def scoped(*args, **kwargs):
            with jax.named_scope(name):
                return fn(*args, **kwargs)

        _IMPLS.setdefault(name, {})[platform] = scoped
        return scoped

    return deco


def _backend() -> str:
    return jax.default_backend()


def get(name: str) -> Callable:
    """The implementation of op `name` for the current backend (falls back to the reference). On the neuron
    platform the NKI kernels (kernels/nki, which import the `nki` package) are registered at the first call."""
    global _NEURON_LOADED
    backend = _backend()
    if backend == "neuron" and not _NEURON_LOADED:
        # by name, at the first neuron call: the nki package exists only where the Neuron toolchain is installed
        importlib.import_module(f"{__package__}.nki").register_all()
        _NEURON_LOADED = True
    impls = _IMPLS[name]
    return impls.get(backend, impls["reference"])


def implementation(name: str, platform: str) -> Callable:
    """Op `name`'s implementation registered for `platform` ("reference", "neuron"); KeyError if none."""
    return _IMPLS[name][platform]


def registered() -> dict[str, tuple[str, ...]]:
    """Op name -> the platforms it has implementations for."""
    return {k: tuple(v) for k, v in _IMPLS.items()}


def weight_format(backend: str | None = None) -> str:
    """How a loaded model keeps quantized checkpoint weights on `backend` (default: JAX's): "codes" where the GEMM
    kernels decode them on the fly (Neuron's NKI kernels read fp8/fp4 codes), "decoded" where the GEMMs are the jnp
    references, which would otherwise decode every weight again at every step (CPU, GPU). model/weights.py."""
    return "codes" if (backend or _backend()) == "neuron" else "decoded"


# (token, expert) pairs per routed expert below which a decode step's MoE runs one expert slice per pair
# (moe_experts_gather) rather than expert tiles (moe_experts_grouped_nosort). XLA:CPU runs a [1, d] x [I, d]^T
# product at memory bandwidth but a [2..16, d] one through its GEMM path at a fifth of it (docs/performance.md),
# so on CPU reading an expert once per pair beats reading it once per tile until pairs are about 8 per expert.
_PAIR_KERNEL_LIMIT = {"cpu": 8}


def pair_kernel_limit(backend: str | None = None) -> int:
    """The decode crossover above for `backend` (default: JAX's): per-pair kernel while T*k < limit * E."""
    return _PAIR_KERNEL_LIMIT.get(backend or _backend(), 1)


def bf16_weights_as_bits(backend: str | None = None) -> bool:
    """Whether a bfloat16 model's layer weights ride through the layer scan as their uint16 bit patterns on `backend`
    (default: JAX's). XLA:CPU's float normalisation rewrites a bf16 array that a while loop slices into an f32 copy
    made before the loop, at every step: the whole stacked weights converted and written out again (38x slower than
    float32 weights, docs/performance.md). A uint16 operand is sliced as it is; the layer (scan body) or the expert
    kernel bitcasts its slice back to bf16 (kernels.linear.from_bits), and the convert fuses into the product."""
    return (backend or _backend()) == "cpu"


def fence_gemm_inputs(backend: str | None = None) -> bool:
    """Whether an act-quantised GEMM input is written out before its product on `backend` (default: JAX's).
    XLA:CPU fuses the elementwise producers of a matrix-vector product's vector into its dot loop and evaluates them
    again for every output row: the fp8 rounding in front of a [1, K] x [N, K]^T product then costs 8x the product
    (docs/performance.md). quant.written_out stops that fusion; the values are the same."""
    return (backend or _backend()) == "cpu"


def skip_padding_tiles(backend: str | None = None) -> bool:
    """Whether the grouped MoE kernels loop over the used expert tiles only on `backend` (default: JAX's), a trip
    count the routing decides, instead of all of the static tile count (N/tile + E, enough for any routing). The
    tiles past the used ones hold padding rows only, whose products are zero and unread; at a 256-token prefill
    chunk of 32 experts they are a quarter of the tiles (docs/performance.md). Neuron needs static trip counts
    (neuron-notes S3), and XLA:GPU reads a while loop's predicate back to the host at every trip: CPU only."""
    return (backend or _backend()) == "cpu"


def native_gemm_rows(backend: str | None = None) -> int:
    """Products of 2 to this many rows run jdeep's native CPU kernel (kernels.cpu.rows_gemm) on `backend` (default:
    JAX's); 0 = none. XLA:CPU's products with 2-16 rows run at a fifth of bandwidth after copying a weight sliced
    out of its stack; the kernel reads the weight where it lies (docs/performance.md). CPU only, and only where
    the kernel could be built (a C++ compiler; kernels/cpu/build.py): elsewhere XLA's products run."""
    if (backend or _backend()) != "cpu":
        return 0
    return cpu.MAX_ROWS if cpu.available() else 0
